"""Engine: requests in, tokens out. add_request / step / abort, and generate() on top.

A bad request raises ValueError (or LoRA errors) from add_request and never reaches the
scheduler, so one client's mistake cannot disturb anybody else's generation.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
from pathlib import Path

from moeserve.config import EngineConfig
from moeserve.models.spec import ModelSpec
from moeserve.runtime.detokenizer import TokenizerWrapper, detokenize_step
from moeserve.runtime.kv_cache import BlockAllocator
from moeserve.runtime.model_runner import ModelRunner
from moeserve.runtime.scheduler import Scheduler
from moeserve.runtime.sequence import RequestOutput, Sequence
from moeserve.sampling_params import SamplingParams

logger = logging.getLogger("moeserve")


class RequestError(ValueError):
    """A request the engine refuses; the message says why."""


class Engine:
    def __init__(self, config: EngineConfig, progress: bool = False):
        # a private copy: the engine fills in "auto" values and defaults without touching the caller's config
        self.config = (dataclasses.replace(config) if isinstance(config, EngineConfig)
                       else EngineConfig(**config)).resolve()
        cfg = self.config
        if cfg.model is None:
            from moeserve.models.upcycle import demo_model_path

            cfg.model = str(demo_model_path(progress=progress))
        model_dir = Path(cfg.model)
        if not model_dir.is_dir():
            raise FileNotFoundError(f"model folder {cfg.model!r} does not exist")
        self.spec = ModelSpec.from_model_dir(model_dir)
        auto_len = cfg.max_model_len is None
        if auto_len:
            cfg.max_model_len = min(self.spec.max_position_embeddings, 4096)
        if cfg.max_model_len > self.spec.max_position_embeddings:
            raise ValueError(f"max_model_len {cfg.max_model_len} exceeds the model's "
                             f"max_position_embeddings {self.spec.max_position_embeddings}")
        self.tokenizer = self._load_tokenizer(cfg.tokenizer or cfg.model)
        self.eos_ids = set(self.spec.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)
        self.runner = ModelRunner(cfg, self.spec, str(model_dir), progress=progress)
        self.lora_manager = None
        if cfg.enable_lora:
            from moeserve.lora.manager import LoRAManager

            self.lora_manager = LoRAManager(cfg, self.spec, self.runner.model, self.runner.device)
            self.runner.lora_pool = self.lora_manager.pool
            for name, path in cfg.lora_modules.items():
                self.lora_manager.register(name, path, pinned=False)
        num_blocks = self.runner.allocate_kv_cache()
        self.allocator = BlockAllocator(num_blocks, cfg.block_size)
        fits = self.allocator.num_usable * cfg.block_size
        if cfg.max_model_len > fits:
            if not auto_len:
                raise ValueError(f"max_model_len {cfg.max_model_len} does not fit the KV cache ({fits} tokens in "
                                 f"{self.allocator.num_usable} blocks); lower it or give the cache more memory")
            logger.warning("max_model_len lowered to %d: what the KV cache holds", fits)
            cfg.max_model_len = fits
        self.scheduler = Scheduler(
            self.allocator, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.enable_chunked_prefill,
            lora_acquire=self.lora_manager.acquire if self.lora_manager else None,
            lora_release=self.lora_manager.release if self.lora_manager else None,
        )
        self.seqs: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self.stats_counters = {"requests_total": 0, "requests_rejected": 0, "prompt_tokens_total": 0,
                               "generation_tokens_total": 0, "steps_total": 0, "aborted_total": 0}
        from moeserve.runtime.graph_runner import GraphRunner, dual_capture_plan

        _, warning = dual_capture_plan(cfg)
        if warning:  # on CPU graphs never exist, so it is only worth a note
            (logger.warning if cfg.device.startswith("cuda") else logger.info)(warning)
        if not cfg.enforce_eager:

            self.runner.graph_runner = GraphRunner.for_engine(self.runner, cfg, progress=progress)

    @staticmethod
    def _load_tokenizer(path: str):
        from transformers import AutoTokenizer

        try:
            return TokenizerWrapper(AutoTokenizer.from_pretrained(path))
        except Exception as e:  # noqa: BLE001 - a model without tokenizer still serves token ids
            logger.warning("no tokenizer loaded from %s (%s); prompts must be token ids", path, e)
            return None

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    lora: str | None = None, request_id: str | None = None, prompt_text: str | None = None) -> str:
        """Queue a request; raises (RequestError, ValueError, LookupError) naming the problem if it is refused.
        `prompt_text`: the text token-id prompts came from (echoed back in outputs), if the caller tokenized."""
        params = params or SamplingParams()
        cfg = self.config
        try:
            params.validate()
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    raise RequestError("this model has no tokenizer: give the prompt as token ids")
                text, ids = prompt, self.tokenizer.encode(prompt)
            elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                text, ids = prompt_text, list(prompt)
                bad = [t for t in ids if not 0 <= t < self.spec.vocab_size]
                if bad:
                    raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.spec.vocab_size})")
            else:
                raise RequestError("prompt must be a string or a list of token ids")
            if not ids:
                raise RequestError("prompt is empty")
            if len(ids) >= cfg.max_model_len:
                raise RequestError(f"prompt has {len(ids)} tokens; max_model_len is {cfg.max_model_len} "
                                   "(the prompt plus at least one generated token must fit)")
            if len(ids) + params.max_tokens > cfg.max_model_len:
                params = _copy_params(params, max_tokens=cfg.max_model_len - len(ids))
            need_blocks = -(-(len(ids) + params.max_tokens) // cfg.block_size)
            if need_blocks > self.allocator.num_usable:
                raise RequestError(f"request needs {need_blocks} KV blocks but the cache has only "
                                   f"{self.allocator.num_usable}; lower max_tokens or the prompt length")
            if lora is not None:
                if self.lora_manager is None:
                    raise RequestError(f"adapter {lora!r} requested but LoRA is not enabled (--enable-lora)")
                self.lora_manager.check_known(lora)
            if len(self.scheduler.waiting) >= cfg.max_queue_len:
                raise RequestError(f"queue is full ({cfg.max_queue_len} waiting requests); retry later")
            if request_id is None:  # auto ids skip any a caller chose
                request_id = f"req-{next(self._ids)}"
                while request_id in self.seqs:
                    request_id = f"req-{next(self._ids)}"
            elif request_id in self.seqs:
                raise RequestError(f"request id {request_id!r} is already in use")
        except (ValueError, LookupError):
            self.stats_counters["requests_rejected"] += 1
            raise
        seq = Sequence(request_id, text, ids, params, lora)
        self.seqs[request_id] = seq
        self.scheduler.add(seq)
        self.stats_counters["requests_total"] += 1
        self.stats_counters["prompt_tokens_total"] += len(ids)
        return request_id

    def abort(self, request_id: str) -> bool:
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.finish(seq)
        seq.finish_reason = "abort"
        self.stats_counters["aborted_total"] += 1
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ---- stepping ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sb = self.scheduler.schedule()
        outputs = [self._fail(seq) for seq in list(self.scheduler.failed)]
        if sb is None:
            return outputs
        self.stats_counters["steps_total"] += 1
        result = self.runner.run(sb)
        for seq, n in zip(sb.seqs, sb.num_new_tokens):
            seq.num_computed_tokens += n
            if seq in result.prompt_logprobs:
                seq.prompt_logprobs.extend(result.prompt_logprobs[seq])
            if seq not in result.sampled:
                continue
            token = result.sampled[seq]
            seq.output_token_ids.append(token)
            self.stats_counters["generation_tokens_total"] += 1
            if seq in result.logprobs:
                seq.logprobs.append(result.logprobs[seq])
            text_before = len(seq.text)
            self._detok(seq, final=False)
            self._check_stop(seq, token, text_before)
            if seq.finish_reason is not None:
                self.scheduler.finish(seq)
                self.seqs.pop(seq.request_id, None)
                if seq.finish_reason != "stop" or not seq.params.stop:
                    self._detok(seq, final=True)  # a trailing partial character is shown, not dropped
                delta = self._flush_text(seq)
            else:
                delta = self._stream_text(seq)
            outputs.append(self._output(seq, delta, [token]))
        return outputs

    def _fail(self, seq: Sequence) -> RequestOutput:
        """A request the scheduler could not admit (its error is in seq.error): end it, free everything."""
        self.scheduler.finish(seq)
        self.seqs.pop(seq.request_id, None)
        seq.finish_reason = "error"
        logger.warning("request %s failed: %s", seq.request_id, seq.error)
        return self._output(seq, self._flush_text(seq), [])

    def _detok(self, seq: Sequence, final: bool) -> str:
        if self.tokenizer is None:
            return ""
        return detokenize_step(self.tokenizer, seq, seq.params.skip_special_tokens, final=final)

    def _check_stop(self, seq: Sequence, token: int, text_before: int) -> None:
        p = seq.params
        if not p.ignore_eos and token in self.eos_ids:
            seq.finish_reason = "stop"
        elif token in p.stop_token_ids:
            seq.finish_reason = "stop"
        elif p.stop:
            # a new match ends in the text added this step, so it starts at most len(stop)-1 chars earlier
            tail_start = max(0, text_before - max(len(s) for s in p.stop) + 1)
            hits = [(i, s) for s in p.stop if (i := seq.text.find(s, tail_start)) >= 0]
            if hits:
                i, _ = min(hits)
                seq.text = seq.text[:i]
                seq.finish_reason = "stop"
        if seq.finish_reason is None and len(seq.output_token_ids) >= p.max_tokens:
            seq.finish_reason = "length"

    def _stream_text(self, seq: Sequence) -> str:
        """New text safe to hand out: hold back a suffix that could still become a stop string."""
        hold = max((len(s) - 1 for s in seq.params.stop), default=0)
        safe_end = max(seq.stream_offset, len(seq.text) - hold)
        delta = seq.text[seq.stream_offset:safe_end]
        seq.stream_offset = safe_end
        return delta

    def _flush_text(self, seq: Sequence) -> str:
        delta = seq.text[seq.stream_offset:]
        seq.stream_offset = len(seq.text)
        return delta

    def _output(self, seq: Sequence, delta_text: str, delta_ids: list[int]) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id, prompt=seq.prompt, prompt_token_ids=seq.prompt_token_ids,
            token_ids=list(seq.output_token_ids), text=seq.text[:seq.stream_offset], delta_text=delta_text,
            delta_token_ids=delta_ids, logprobs=seq.logprobs, prompt_logprobs=seq.prompt_logprobs,
            finish_reason=seq.finish_reason, lora_name=seq.lora_name, error=seq.error,
        )

    # ---- offline API --------------------------------------------------------------------------
    def generate(self, prompts, sampling_params=None, lora=None, use_tqdm: bool = False) -> list[RequestOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        n = len(prompts)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params or SamplingParams()] * n
        loras = lora if isinstance(lora, list) else [lora] * n
        if len(params) != n or len(loras) != n:
            raise ValueError(f"got {n} prompts, {len(params)} sampling params and {len(loras)} adapters")
        ids = []
        try:
            for p, sp, lo in zip(prompts, params, loras):
                ids.append(self.add_request(p, sp, lo))
        except Exception:  # all or nothing: no orphaned requests keep computing
            for rid in ids:
                self.abort(rid)
            raise
        final: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=n, desc="generating", unit="req")
        while len(final) < n:
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
                    if bar:
                        bar.update(1)
        if bar:
            bar.close()
        return [final[i] for i in ids]

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        """Token ids of a chat conversation rendered with the model's chat template."""
        if self.tokenizer is None:
            raise RequestError("this model has no tokenizer")
        return self.tokenizer.tok.encode(self.tokenizer.apply_chat_template(messages), add_special_tokens=False)

    # ---- LoRA -----------------------------------------------------------------------------------
    def load_lora(self, name: str, path: str, pinned: bool = False) -> None:
        if self.lora_manager is None:
            raise RequestError("LoRA is not enabled (start the engine with enable_lora=True)")
        self.lora_manager.register(name, path, pinned=pinned, queued=list(self.seqs.values()))

    def unload_lora(self, name: str) -> None:
        if self.lora_manager is None:
            raise RequestError("LoRA is not enabled")
        self.lora_manager.unregister(name, running=[s for s in self.seqs.values()])

    def list_loras(self) -> list[str]:
        return self.lora_manager.names() if self.lora_manager else []

    # ---- introspection --------------------------------------------------------------------------
    def stats(self) -> dict:
        s = dict(self.stats_counters)
        s.update(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_blocks_total=self.allocator.num_usable,
            kv_blocks_free=self.allocator.num_free,
            kv_usage=1.0 - self.allocator.num_free / self.allocator.num_usable,
            num_preemptions=self.scheduler.num_preemptions,
        )
        if self.runner.graph_runner is not None:
            s["graph_replays"] = self.runner.graph_runner.replay_counts()
        if self.lora_manager is not None:
            s.update(self.lora_manager.stats())
        return s


def _copy_params(p: SamplingParams, **changes) -> SamplingParams:
    return dataclasses.replace(p, **changes)
