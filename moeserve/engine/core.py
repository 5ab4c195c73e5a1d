"""EngineCore: token ids in, token ids out. Scheduler, model runner, graphs and adapters.

It runs in-process under the offline `Engine`, and in its own process under the server
(core_process.py). Text never enters it: tokenizing, detokenizing and stop strings happen beside
the caller (output_processor.py).

`step` overlaps host and device: it schedules and launches step n+1, and only then waits for
step n's results and turns them into outputs. A sequence that step n ends (EOS, stop id) has one
wasted row in step n+1, whose result is dropped.
"""
from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import random
from pathlib import Path

import torch

from moeserve.config import EngineConfig
from moeserve.engine.lora_manager import LoRAManager
from moeserve.engine.request_limits import RequestLimits
from moeserve.engine.scheduler import Scheduler
from moeserve.engine.warmup import CompileWatch, decode_split_shapes, eager_decode_sizes, warm_up, warmup_token_counts
from moeserve.errors import EngineShutdownError, QueueFullError, RankFailure, RequestError
from moeserve.messages import CoreInfo, EngineStats
from moeserve.model_spec import ModelSpec
from moeserve.models.tokenizer import eos_token_ids, load_tokenizer
from moeserve.models.upcycle import demo_model_path
from moeserve.outputs import CoreOutput
from moeserve.sampling_params import SamplingParams
from moeserve.worker.graph_runner import dual_capture_plan
from moeserve.worker.kv_cache import BlockAllocator
from moeserve.worker.model_runner import InFlightStep, ModelRunner
from moeserve.worker.parallel_runner import ParallelModelRunner
from moeserve.worker.sequence import Sequence, mark_launched

logger = logging.getLogger("moeserve")


class EngineCore:
    def __init__(self, config: EngineConfig, progress: bool = False):
        # a private copy: the core fills in "auto" values and defaults without touching the caller's config
        self.config = (dataclasses.replace(config) if isinstance(config, EngineConfig)
                       else EngineConfig(**config)).resolve()
        cfg = self.config
        if cfg.data_parallel_size != 1:  # the server's DataParallelClient starts one core per copy, each given 1
            raise ValueError(f"--data-parallel-size {cfg.data_parallel_size}: an engine core (the offline Engine, "
                             "`moeserve generate`) runs one copy of the model; `moeserve serve` runs several")
        if cfg.model is None:
            cfg.model = str(demo_model_path(progress=progress))
        model_dir = Path(cfg.model)
        if not model_dir.is_dir():
            raise FileNotFoundError(f"model folder {cfg.model!r} does not exist")
        self.spec = ModelSpec.from_model_dir(model_dir)
        auto_len = cfg.max_model_len is None
        if auto_len:
            cfg.max_model_len = min(self.spec.max_position_embeddings, 4096)
        if cfg.max_model_len > self.spec.max_position_embeddings:
            raise ValueError(f"max_model_len (--max-model-len) {cfg.max_model_len} exceeds the model's "
                             f"max_position_embeddings {self.spec.max_position_embeddings}")
        self.tokenizer = load_tokenizer(cfg.tokenizer or cfg.model, self.spec.vocab_size)
        self.eos_ids = eos_token_ids(model_dir, self.spec.eos_token_ids, self.tokenizer)
        if cfg.tensor_parallel_size > 1:
            self.runner = ParallelModelRunner(cfg, self.spec, str(model_dir), progress=progress)
        else:
            self.runner = ModelRunner(cfg, self.spec, str(model_dir), progress=progress)
        self.lora_manager = None
        if cfg.enable_lora:
            self.lora_manager = LoRAManager(cfg, self.spec, self.runner.model, self.runner.device)
            if cfg.tensor_parallel_size > 1:  # loads and clears then land on every rank or none
                self.lora_manager.pool = self.runner.shard_lora_pool(self.lora_manager.pool)
            self.runner.lora_pool = self.lora_manager.pool
            self.lora_manager.register_configured()
            self.lora_manager.preload_configured()
        num_blocks = self.runner.allocate_kv_cache()
        self.allocator = BlockAllocator(num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        fits = self.allocator.num_usable * cfg.block_size
        if cfg.max_model_len > fits:
            if not auto_len:
                raise ValueError(f"max_model_len (--max-model-len) {cfg.max_model_len} does not fit the KV cache "
                                 f"({fits} tokens in {self.allocator.num_usable} blocks); lower it or give the cache "
                                 "more memory (--num-kv-blocks, --kv-cache-memory-bytes, --gpu-memory-utilization)")
            logger.warning("max_model_len lowered to %d: what the KV cache holds (set --max-model-len to refuse "
                           "instead)", fits)
            cfg.max_model_len = fits
        self.limits = RequestLimits(self.spec.vocab_size, cfg.max_model_len, cfg.block_size,
                                    self.allocator.num_usable)
        self.scheduler = Scheduler(
            self.allocator, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.enable_chunked_prefill,
            lora=self.lora_manager,
            prefill_delay_steps=cfg.prefill_delay_steps,
        )
        self.seqs: dict[str, Sequence] = {}
        self.inflight: InFlightStep | None = None
        self.closed = False
        self._ids = itertools.count()
        self._seeds = random.Random(cfg.seed)  # seeds of requests that bring none
        self.stats_counters = {"requests_total": 0, "requests_rejected": 0, "prompt_tokens_total": 0,
                               "generation_tokens_total": 0, "steps_total": 0, "decode_steps_total": 0,
                               "aborted_total": 0}
        _, warning = dual_capture_plan(cfg)
        if warning:  # on CPU graphs never exist, so it is only worth a note
            (logger.warning if cfg.device.startswith("cuda") else logger.info)(warning)
        if not cfg.enforce_eager:
            self.runner.capture_graphs(progress=progress)
        self.compile_watch = None
        if cfg.warmup and cfg.device.startswith("cuda"):
            self._warm_up()
            self.compile_watch = CompileWatch()

    def _warm_up(self) -> None:
        """Compile and run every eager shape now (engine/warmup.py): prefill chunks, and decode steps larger than
        the largest graph (every decode step without graphs) with each split count of the decode attention."""
        cfg = self.config
        counts = warmup_token_counts(cfg.max_num_batched_tokens, self.spec.top_k)
        graphs = self.runner.graph_runner
        low = max(graphs.sizes) if graphs is not None else 0
        shapes = [(b, 1) for b in eager_decode_sizes(cfg.max_num_seqs, low or None)]
        if shapes and cfg.attention_backend == "triton":
            # imported here, not at the top: it imports triton, which `import moeserve` (and the CLI) should not pay
            from moeserve.kernels.paged_attention import MAX_DECODE_SPLITS, decode_tile, default_num_splits

            n_kv = self.runner.spec.num_kv_heads  # this rank's KV heads (the runner's spec is its rank's)
            block_n = decode_tile(self.runner.kv_dtype.itemsize)[0]
            # contexts past MAX_DECODE_SPLITS tiles give no split count of their own
            max_blocks = min(self.runner.max_blocks_per_seq, -(-MAX_DECODE_SPLITS * block_n // cfg.block_size))
            shapes += decode_split_shapes(range(low + 1, cfg.max_num_seqs + 1), max_blocks, lambda b, blocks:
                                          default_num_splits(b, n_kv, blocks, cfg.block_size, self.runner.device,
                                                             block_n))
        warm_up(self.runner, counts, self.lora_manager is not None, cfg.block_size, sorted(set(shapes)),
                max_seq_tokens=cfg.max_model_len - 1)

    def info(self) -> CoreInfo:
        """What a frontend needs to know about this core (sent once, at start)."""
        cfg = self.config
        return CoreInfo(model=cfg.model, tokenizer=cfg.tokenizer or cfg.model, vocab_size=self.spec.vocab_size,
                        max_model_len=cfg.max_model_len, block_size=cfg.block_size,
                        num_kv_blocks=self.allocator.num_usable, max_queue_len=cfg.max_queue_len,
                        max_num_seqs=cfg.max_num_seqs, lora_names=self.list_loras(), device=str(self.runner.device),
                        dtype=cfg.dtype, tokenizer_class=self.tokenizer.class_name if self.tokenizer else None)

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    lora: str | None = None, request_id: str | None = None) -> str:
        """Queue a request; raises (RequestError, ValueError, LookupError) naming the problem if it is refused."""
        self.check_open()
        params = params or SamplingParams()
        try:
            params = self.limits.check(list(prompt_token_ids), params)
            if lora is not None:
                if self.lora_manager is None:
                    raise RequestError(f"adapter {lora!r} requested but LoRA is not enabled (--enable-lora)")
                self.lora_manager.check_known(lora)
            if len(self.scheduler.waiting) >= self.config.max_queue_len:
                raise QueueFullError(f"queue is full ({self.config.max_queue_len} waiting requests); retry later")
            if request_id is None:  # auto ids skip any a caller chose
                request_id = f"req-{next(self._ids)}"
                while request_id in self.seqs:
                    request_id = f"req-{next(self._ids)}"
            elif request_id in self.seqs:
                raise RequestError(f"request id {request_id!r} is already in use")
        except (ValueError, LookupError):
            self.stats_counters["requests_rejected"] += 1
            raise
        seq = Sequence(request_id, prompt_token_ids, params, lora, seed=self._seeds.getrandbits(63))
        self.seqs[request_id] = seq
        if lora is not None:  # an unload now drains: the name stays until this request is done
            self.lora_manager.add(seq)
        self.scheduler.add(seq)
        self.stats_counters["requests_total"] += 1
        self.stats_counters["prompt_tokens_total"] += len(prompt_token_ids)
        return request_id

    def abort(self, request_id: str, counted: bool = True) -> bool:
        """Stop a request and free what it holds. `counted=False`: it ended by a stop string, not an abort."""
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.finish(seq)
        seq.finish_reason = "abort"
        if counted:
            self.stats_counters["aborted_total"] += 1
        return True

    def has_work(self) -> bool:
        return not self.closed and (self.scheduler.has_work() or self.inflight is not None)

    # ---- stepping ---------------------------------------------------------------------------
    def step(self) -> list[CoreOutput]:
        """Launch the next step, then report what the previous one produced."""
        self.check_open()
        sb = self.scheduler.schedule()
        outputs = [self._fail(seq, seq.error) for seq in list(self.scheduler.failed)]
        launched = None
        if sb is not None:
            try:
                launched = self.runner.launch(sb)
            except RankFailure:  # a dead or hung tensor-parallel rank does take it down
                raise
            except Exception as e:  # noqa: BLE001 - one bad step must not take the engine down
                logger.exception("engine step failed; failing the running requests")
                return outputs + self.fail_running(f"engine step failed: {type(e).__name__}: {e}")
            self.stats_counters["steps_total"] += 1
            self.stats_counters["decode_steps_total"] += sb.is_decode
            mark_launched(sb, launched.sampling_seqs)
            self.scheduler.cache_computed_blocks(sb)
        previous, self.inflight = self.inflight, launched
        if previous is not None:
            try:
                outputs += self._process(previous)
            except RankFailure:
                raise
            except Exception as e:  # noqa: BLE001
                logger.exception("engine step failed; failing the running requests")
                self.inflight = None
                return outputs + self.fail_running(f"engine step failed: {type(e).__name__}: {e}")
        return outputs

    def _process(self, step: InFlightStep) -> list[CoreOutput]:
        result = self.runner.collect(step)
        outputs: dict[Sequence, CoreOutput] = {}

        def output(seq: Sequence) -> CoreOutput:
            out = outputs.get(seq)
            if out is None:
                out = outputs[seq] = CoreOutput(seq.request_id, [])
                if not seq.reported_cached_tokens:  # a request's first output says how much of its prompt was cached
                    out.num_cached_tokens = seq.num_cached_tokens or 0
                    seq.reported_cached_tokens = True
            return out

        for seq, lps in result.prompt_logprobs.items():
            if not seq.is_finished:
                output(seq).new_prompt_logprobs = lps
        for seq, token in result.sampled.items():
            if seq.is_finished:
                continue  # aborted, or ended by the step before (a wasted row)
            idx = seq.fill_pending(token)
            self.stats_counters["generation_tokens_total"] += 1
            out = output(seq)
            out.new_token_ids.append(token)
            if seq in result.logprobs:
                out.new_logprobs = [result.logprobs[seq]]
            p = seq.params
            if (not p.ignore_eos and token in self.eos_ids) or token in p.stop_token_ids:
                out.finish_reason = "stop"
            elif idx + 1 >= p.max_tokens:
                out.finish_reason = "length"
            if out.finish_reason is not None:
                del seq.output_token_ids[idx + 1:]  # a token the next step samples for it is dropped
                seq.num_pending = 0
                seq.finish_reason = out.finish_reason
                self.scheduler.finish(seq)
                self.seqs.pop(seq.request_id, None)
        return list(outputs.values())

    def _fail(self, seq: Sequence, error: str) -> CoreOutput:
        """End a request with finish_reason 'error' (its error says why) and free everything."""
        self.scheduler.finish(seq)
        self.seqs.pop(seq.request_id, None)
        seq.finish_reason, seq.error = "error", error
        logger.warning("request %s failed: %s", seq.request_id, error)
        return CoreOutput(seq.request_id, [], finish_reason="error", error=error)

    def fail_running(self, error: str) -> list[CoreOutput]:
        """After a failed step: fail the requests it was working on; waiting ones stay queued."""
        self.inflight = None
        self.runner.prev_tokens = None
        self.allocator.reset_prefix_cache()  # blocks that step was writing may hold garbage
        return [self._fail(seq, error) for seq in list(self.scheduler.running)]

    # ---- LoRA -----------------------------------------------------------------------------------
    def load_lora(self, name: str, path: str, pinned: bool = False, replace: bool = False) -> None:
        """Load an adapter under `name`. `replace=True` reloads a loaded name (weight sync): the new weights go
        into another slot as a new version; requests already started finish on the old version (its slot
        frees when they end), every request starting later uses the new one (LoRAManager docstring)."""
        self.check_open()
        if self.lora_manager is None:
            raise RequestError("LoRA is not enabled (start the engine with enable_lora=True, --enable-lora)")
        self.lora_manager.register(name, path, pinned=pinned, queued=list(self.seqs.values()), replace=replace)

    def unload_lora(self, name: str) -> None:
        """Unload with draining: requests for `name` are refused from now on (it is no longer listed); queued
        and running ones finish; then its slot is zeroed and the name can be loaded again."""
        self.check_open()
        if self.lora_manager is None:
            raise RequestError("LoRA is not enabled")
        self.lora_manager.unregister(name)

    def list_loras(self) -> list[str]:
        return self.lora_manager.names() if self.lora_manager else []

    # ---- lifetime -------------------------------------------------------------------------------
    def check_open(self) -> None:
        if self.closed:
            raise EngineShutdownError("this engine has been shut down (shutdown() was called); create a new one")

    def shutdown(self) -> None:
        """Release what the engine holds: tensor-parallel workers stop and the process group is left (a later
        engine in this process can start one), graphs, weights, KV cache and adapter slots are freed. Requests
        not finished are dropped. Idempotent; every later request or call raises EngineShutdownError."""
        if self.closed:
            return
        self.closed = True
        if self.compile_watch is not None:
            self.compile_watch.close()
        runner, self.inflight = self.runner, None
        try:
            if hasattr(runner, "shutdown"):  # tensor parallel: the workers, the process group, the graphs
                runner.shutdown()
        finally:
            runner.graph_runner = None  # graphs hold their memory pool until destroyed
            self.seqs.clear()
            # the scheduler and LoRA manager reach the slot pool, the runner the weights and KV cache
            self.runner = self.lora_manager = self.scheduler = self.allocator = None
            del runner
            gc.collect()
            if self.config.device.startswith("cuda"):
                torch.cuda.synchronize()  # a step still in flight finishes before its memory goes back
                torch.cuda.empty_cache()

    # ---- introspection --------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        self.check_open()
        return EngineStats(
            **self.stats_counters,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_blocks_total=self.allocator.num_usable,
            kv_blocks_free=self.allocator.num_free,
            kv_usage=1.0 - self.allocator.num_free / self.allocator.num_usable,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=self.scheduler.prefix_cache_queries,
            prefix_cache_hits=self.scheduler.prefix_cache_hits,
            prefix_cache_hit_rate=self.scheduler.prefix_cache_hits / max(self.scheduler.prefix_cache_queries, 1),
            prefix_cache_blocks=self.allocator.num_cached,
            prefix_cache_evictions=self.allocator.num_evictions,
            kernel_compiles_after_start_total=self.compile_watch.count if self.compile_watch is not None else None,
            graph_replays=self.runner.graph_runner.replay_counts() if self.runner.graph_runner is not None else None,
            **(self.lora_manager.stats() if self.lora_manager is not None else {}),
        )
