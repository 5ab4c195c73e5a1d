"""Engine: the offline API. The engine core in-process, plus tokenizing and output processing.

A bad request raises ValueError (or LoRA errors) from add_request and never reaches the
scheduler, so one client's mistake cannot disturb anybody else's generation.

`shutdown()` (or leaving a `with Engine(...) as engine:` block) releases the engine: its device memory, its
graphs and its tensor-parallel workers; another engine may then start in the same process.
"""
from __future__ import annotations

import os

from moeserve.config import EngineConfig
from moeserve.engine.core import EngineCore
from moeserve.errors import EngineShutdownError, RequestError, UnknownAdapterError
from moeserve.frontend.output_processor import OutputProcessor, RequestState
from moeserve.lora.names import CONFIG_FILE, validate_adapter_name
from moeserve.messages import EngineStats
from moeserve.outputs import RequestOutput
from moeserve.sampling_params import SamplingParams

__all__ = ["Engine", "EngineShutdownError", "RequestError"]


class Engine:
    def __init__(self, config: EngineConfig, progress: bool = False):
        self.core = EngineCore(config, progress=progress)
        self.config = self.core.config
        self.tokenizer = self.core.tokenizer
        self.output = OutputProcessor(self.tokenizer)

    # the core's parts, for callers that inspect them (tests, benchmarks)
    spec = property(lambda self: self.core.spec)
    runner = property(lambda self: self.core.runner)
    scheduler = property(lambda self: self.core.scheduler)
    allocator = property(lambda self: self.core.allocator)
    lora_manager = property(lambda self: self.core.lora_manager)
    eos_ids = property(lambda self: self.core.eos_ids)

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    lora: str | None = None, request_id: str | None = None, prompt_text: str | None = None) -> str:
        """Queue a request; raises (RequestError, ValueError, LookupError) naming the problem if it is refused.
        `prompt_text`: the text token-id prompts came from (echoed back in outputs), if the caller tokenized."""
        self.core.check_open()
        params = params or SamplingParams()
        if lora is not None:
            self._load_on_first_use(lora)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                self.core.stats_counters["requests_rejected"] += 1
                raise RequestError("this model has no tokenizer: give the prompt as token ids")
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            text, ids = prompt_text, list(prompt)
        else:
            self.core.stats_counters["requests_rejected"] += 1
            raise RequestError("prompt must be a string or a list of token ids")
        request_id = self.core.add_request(ids, params, lora, request_id)
        self.output.add(RequestState(request_id, text, ids, self.core.seqs[request_id].params, lora))
        return request_id

    def abort(self, request_id: str) -> bool:
        self.output.abort(request_id)
        return self.core.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.core.has_work()

    def step(self) -> list[RequestOutput]:
        outputs, stopped = self.output.process(self.core.step())
        for request_id in stopped:  # ended by a stop string: not an abort
            self.core.abort(request_id, counted=False)
        return outputs

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
        wanted = set(ids)
        while len(final) < n:
            for out in self.step():
                if out.finished and out.request_id in wanted:
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
        return self.tokenizer.chat_ids(messages)

    # ---- LoRA and introspection -----------------------------------------------------------------
    def _load_on_first_use(self, name: str) -> None:
        """As the server does: with runtime loading on and a lora_dir, an adapter name that is not loaded is
        loaded now from the folder of that name inside lora_dir (symlinks resolved, never outside it). Anything
        else is left to the core's checks, which name the problem."""
        cfg, manager = self.config, self.core.lora_manager
        if manager is None or not (cfg.enable_lora_runtime_loading and cfg.lora_dir) or name in manager.names():
            return
        try:
            validate_adapter_name(name)
            root = os.path.realpath(cfg.lora_dir)
            path = os.path.realpath(os.path.join(root, name))
            if os.path.commonpath([root, path]) != root or not os.path.isfile(os.path.join(path, CONFIG_FILE)):
                raise UnknownAdapterError(f"LoRA adapter {name!r} is not loaded, and lora_dir (--lora-dir) has no "
                                       f"adapter folder {name!r} ({CONFIG_FILE} inside it) to load it from")
            self.core.load_lora(name, path)
        except (ValueError, LookupError):
            self.core.stats_counters["requests_rejected"] += 1
            raise

    def load_lora(self, name: str, path: str, pinned: bool = False, replace: bool = False) -> None:
        """Load a PEFT adapter folder as `name`. `replace=True` reloads a loaded name (weight sync): requests already
        started finish on the old version, every request starting later uses the new one."""
        self.core.load_lora(name, path, pinned, replace)

    def lora_version(self, name: str) -> int:
        """The version new requests for `name` get: 1 at its first load, +1 per reload (replace=True)."""
        self.core.check_open()
        if self.core.lora_manager is None:
            raise RequestError("LoRA is not enabled")
        return self.core.lora_manager.version(name)

    def unload_lora(self, name: str) -> None:
        self.core.unload_lora(name)

    def list_loras(self) -> list[str]:
        return self.core.list_loras()

    def stats(self) -> EngineStats:
        return self.core.stats()

    # ---- lifetime -------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Free the engine's device memory and graphs and stop its tensor-parallel workers (leaving the process
        group, so another tensor-parallel engine can start in this process). Unfinished requests are dropped.
        Idempotent; afterwards requests and calls raise EngineShutdownError."""
        self.core.shutdown()
        self.output = OutputProcessor(self.tokenizer)  # drops the dropped requests' states

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
