"""DataParallelClient: N engine cores behind one frontend (--data-parallel-size N).

Each core is a whole copy of the model in its own process, reached through its own EngineClient, on its own GPUs:
core i sees GPUs i*TP .. i*TP+TP-1 of those visible (CUDA_VISIBLE_DEVICES), so its tensor-parallel ranks, if any,
are its own. The server uses this client exactly as it uses one EngineClient. A request goes to the core with the
fewest requests in flight (ties in turn) and its stream belongs to that core, so aborting it reaches that core
alone. Adapters are loaded and unloaded on every core, one call at a time, and a load lands on all of them or on
none. A core that dies fails its own requests; the others keep serving, and `dead` names it, so /health answers
503 and whoever runs the server restarts it.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import uuid
from typing import AsyncIterator

from moeserve.config import EngineConfig, cuda_device_count
from moeserve.errors import EngineDeadError, QueueFullError, RequestError
from moeserve.frontend.core_client import EngineClient, OnDemandAdapters, QueueReservation, RequestStream
from moeserve.messages import Call, EngineStats
from moeserve.outputs import RequestOutput
from moeserve.sampling_params import SamplingParams

logger = logging.getLogger("moeserve")

# EngineStats fields that a sum over the cores would misstate: /metrics gives each core's value, labelled by core
PER_CORE_FIELDS = ("kv_usage", "prefix_cache_hit_rate", "lora_adapters_known", "lora_adapters_draining",
                   "lora_versions")


def core_gpus(visible: list[str], data_parallel_size: int, tensor_parallel_size: int) -> list[str]:
    """Each core's CUDA_VISIBLE_DEVICES: core i gets GPUs i*TP .. i*TP+TP-1 of `visible` (ValueError if too few)."""
    tp = tensor_parallel_size
    need = data_parallel_size * tp
    if need > len(visible):
        raise ValueError(f"--data-parallel-size {data_parallel_size} x --tensor-parallel-size {tp} needs {need} "
                         f"GPUs, one per rank of every core; {len(visible)} visible")
    return [",".join(visible[i * tp:(i + 1) * tp]) for i in range(data_parallel_size)]


def visible_gpus() -> list[str]:
    """The GPUs this process may hand out: CUDA_VISIBLE_DEVICES if set (ids or UUIDs), else all."""
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    if given is not None:
        return [d.strip() for d in given.split(",") if d.strip()]
    return [str(i) for i in range(cuda_device_count())]


def core_environments(config: EngineConfig) -> list[dict[str, str] | None]:
    """What each core's process adds to its environment: on CUDA, the GPUs it sees; elsewhere nothing (the core
    checks the device itself). Asks torch for the GPUs only when the device may be CUDA (auto or cuda)."""
    n, tp = config.data_parallel_size, config.tensor_parallel_size
    device = config.device
    if device == "auto":
        device = "cuda" if cuda_device_count() else "cpu"
    if device.startswith("cuda:"):
        raise ValueError(f"--device {device} names one GPU; with --data-parallel-size {n} every engine core takes its "
                         "own (core i: GPUs i*TP to i*TP+TP-1): pass --device cuda and choose the GPUs with "
                         "CUDA_VISIBLE_DEVICES")
    if device != "cuda" or not cuda_device_count():
        return [None] * n  # cpu (tests), or a mistake the core reports
    if not isinstance(tp, int) or tp < 1:
        tp = 1  # the core refuses it by name
    return [{"CUDA_VISIBLE_DEVICES": gpus} for gpus in core_gpus(visible_gpus(), n, tp)]


def sum_engine_stats(per_core: list[EngineStats]) -> EngineStats:
    """The cores' stats as one: counts summed (per key for dicts), the ratios recomputed from the sums, the adapter
    counts the largest core's (every core holds the same adapters), the adapter versions the first core's."""
    total = {}
    for f in dataclasses.fields(EngineStats):
        values = [getattr(s, f.name) for s in per_core]
        if any(v is None for v in values):  # a part that is off
            total[f.name] = None
        elif f.name in ("lora_adapters_known", "lora_adapters_draining"):
            total[f.name] = max(values)
        elif f.name == "lora_versions":
            total[f.name] = values[0]
        elif isinstance(values[0], dict):
            merged: dict = {}
            for v in values:
                for key, count in v.items():
                    merged[key] = merged.get(key, 0) + count
            total[f.name] = merged
        else:
            total[f.name] = sum(values)
    total["kv_usage"] = 1.0 - total["kv_blocks_free"] / max(total["kv_blocks_total"], 1)
    total["prefix_cache_hit_rate"] = total["prefix_cache_hits"] / max(total["prefix_cache_queries"], 1)
    return EngineStats(**total)


class DataParallelClient(OnDemandAdapters):
    def __init__(self, config: EngineConfig, log_level: str = "INFO"):
        n = config.data_parallel_size
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"data_parallel_size (--data-parallel-size) must be a positive integer, got {n!r}")
        self.config = config
        self.envs = core_environments(config)
        # each core is one copy (data_parallel_size 1); adapters are loaded at first use here, on every core at once
        core_config = dataclasses.replace(config, data_parallel_size=1, enable_lora_runtime_loading=False)
        tokenizer_lock = asyncio.Lock()
        self.clients = [EngineClient(core_config, log_level, env, tokenizer_lock, name=f"core {i}")
                        for i, env in enumerate(self.envs)]
        self.info = None
        self.lora_versions: dict[str, int] = {}  # adapters new requests may use -> version (1, +1 per reload)
        self._loads: dict[str, int] = {}  # name -> loads so far (a name unloaded and loaded again counts on)
        self._paths: dict[str, tuple[str, bool]] = {}  # loaded adapter -> (path, pinned): what undoing a reload needs
        self._on_demand: dict[str, asyncio.Future] = {}
        self._lora_calls = asyncio.Lock()  # one load or unload at a time: every core sees them in the same order
        self._placing: set[str] = set()  # request ids being submitted to a core
        self._turns = itertools.count()  # ties between equally busy cores go in turn
        self.reserved = 0  # queue places held by requests still being prepared (see reserve())

    # ---- lifecycle ------------------------------------------------------------------------------
    @classmethod
    async def start(cls, config: EngineConfig, log_level: str = "INFO") -> "DataParallelClient":
        client = cls(config, log_level)
        await client._start()
        return client

    async def _start(self) -> None:
        """Start every core at once; the first that fails (or a cancel: the server told to stop) stops the rest,
        and its error is raised."""
        starts = [asyncio.ensure_future(c._start()) for c in self.clients]
        try:
            for started in asyncio.as_completed(starts):
                await started
        except BaseException:
            for s in starts:
                s.cancel()
            await asyncio.gather(*starts, return_exceptions=True)
            up = [c for c, s in zip(self.clients, starts) if not s.cancelled() and s.exception() is None]
            await asyncio.gather(*(c.shutdown() for c in up), return_exceptions=True)
            raise
        first = self.clients[0].info
        # a request waits in one core's queue: the server's queue is all of them
        self.info = dataclasses.replace(first, max_queue_len=sum(c.info.max_queue_len for c in self.clients))
        self.lora_versions = {name: 1 for name in first.lora_names}
        self._loads = dict(self.lora_versions)
        self._paths = {name: (str(path), False) for name, path in dict(self.config.lora_modules or {}).items()}

    def where(self) -> str:
        """Where the engine runs, for the server's first line."""
        pids = ", ".join(str(c.proc.pid) for c in self.clients)
        where = ("GPUs " + " | ".join(env["CUDA_VISIBLE_DEVICES"] for env in self.envs) if self.envs[0]
                 else self.info.device)
        return f"{len(self.clients)} engine cores (data parallel), pids {pids}, {where}, {self.info.dtype}"

    @property
    def tokenizer(self):
        return self.clients[0].tokenizer

    @property
    def dead(self) -> str | None:
        """Why some core is not running (None: all are)."""
        down = [f"engine core {i}: {c.dead}" for i, c in enumerate(self.clients) if c.dead is not None]
        return "; ".join(down) or None

    @property
    def is_running(self) -> bool:
        return self.dead is None

    @property
    def streams(self) -> dict[str, RequestStream]:
        """Every open request, whichever core serves it."""
        return {rid: s for c in self.clients for rid, s in c.streams.items()}

    def _live(self) -> list[EngineClient]:
        live = [c for c in self.clients if c.is_running]
        if not live:
            raise EngineDeadError(self.dead)
        return live

    async def shutdown(self, timeout: float = 10.0) -> None:
        await asyncio.gather(*(c.shutdown(timeout) for c in self.clients))

    def abort_all(self) -> int:
        return sum(c.abort_all() for c in self.clients)

    # ---- requests ---------------------------------------------------------------------------------
    def queue_room(self) -> int:
        return sum(c.queue_room() for c in self.clients if c.is_running) - self.reserved

    def queue_full_error(self) -> QueueFullError:
        return QueueFullError(f"queue is full ({self.info.max_queue_len} waiting requests on "
                              f"{len(self.clients)} engine cores); retry later")

    def reserve(self, n: int = 1) -> QueueReservation:
        self._live()
        if self.queue_room() < n:
            raise self.queue_full_error()
        self.reserved += n
        return QueueReservation(self, n)

    def check_prompt_size(self, prompt) -> None:
        self.clients[0].check_prompt_size(prompt)

    async def prepare(self, prompt):
        """Tokenize on the first core's client's thread, whichever core runs the request: one tokenizer thread, as
        with one core (transformers imports parts of a tokenizer lazily, at first use, and not thread-safely)."""
        return await self.clients[0].prepare(prompt)

    def _pick(self) -> EngineClient:
        """The live core with the fewest requests in flight (being added included); ties in turn."""
        live = self._live()
        start = next(self._turns) % len(live)
        return min(live[start:] + live[:start], key=lambda c: len(c.streams) + c.reserved)

    async def submit(self, prompt, params: SamplingParams | None = None, lora: str | None = None,
                     request_id: str | None = None, reservation: QueueReservation | None = None) -> RequestStream:
        """As EngineClient.submit; the request runs on the least busy core."""
        self._live()
        if reservation is None:
            with self.reserve(1) as own:
                return await self.submit(prompt, params, lora, request_id, own)
        prepared = await self.prepare(prompt)
        if lora is not None:
            await self.ensure_adapter(lora)  # on every core, before one of them gets the request
        request_id = request_id if request_id is not None else f"req-{uuid.uuid4().hex}"
        if request_id in self._placing or any(request_id in c.streams for c in self.clients):
            raise RequestError(f"request id {request_id!r} is already in use")
        core = self._pick()
        reservation.use()  # the core takes a place of its own
        self._placing.add(request_id)
        try:
            return await core.submit(prepared, params, lora, request_id)
        finally:
            self._placing.discard(request_id)

    async def generate(self, prompt, params: SamplingParams | None = None, lora: str | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        stream = await self.submit(prompt, params, lora, request_id)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Stop a request on the core serving it (unknown or finished: nothing to do)."""
        for c in self.clients:
            if request_id in c.streams:
                c.abort(request_id)
                return

    async def call(self, call: Call) -> list:
        """A utility call on every live core (the test hooks); their answers in core order."""
        return await asyncio.gather(*(c.call(call) for c in self._live()))

    async def stats_per_core(self) -> list[EngineStats]:
        """Each live core's stats (a core that dies meanwhile is left out)."""
        got = await asyncio.gather(*(c.stats() for c in self._live()), return_exceptions=True)
        stats = [s for s in got if isinstance(s, EngineStats)]
        if not stats:
            raise EngineDeadError(self.dead or "no engine core answered")
        return stats

    async def stats(self) -> EngineStats:
        """All cores' stats as one (sum_engine_stats), with this client's adapter versions."""
        total = sum_engine_stats(await self.stats_per_core())
        return dataclasses.replace(total, lora_versions=dict(self.lora_versions))

    # ---- adapters: on every core, or on none ---------------------------------------------------------
    async def load_lora(self, name: str, path: str, pinned: bool = False, replace: bool = False) -> None:
        """Load (or with `replace`, reload) an adapter on every live core. If any core fails, the load is undone on
        those where it landed and that core's error is raised, of its own class."""
        await asyncio.shield(self._one_at_a_time(self._load_on_every_core(name, path, pinned, replace)))

    async def _load_on_every_core(self, name: str, path: str, pinned: bool, replace: bool) -> None:
        cores = self._live()
        results = await asyncio.gather(*(c.load_lora(name, path, pinned, replace) for c in cores),
                                       return_exceptions=True)
        failed = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
        if failed:
            landed = [c for c, r in zip(cores, results) if not isinstance(r, BaseException)]
            if landed:
                logger.warning("LoRA adapter %r failed to load on engine core %d (%s); undoing it on the %d core(s) "
                               "where it landed", name, self.clients.index(cores[failed[0][0]]), failed[0][1],
                               len(landed))
                await self._undo(landed, name, self._paths.get(name) if replace else None)
            raise failed[0][1]
        self._loads[name] = self._loads.get(name, 0) + 1
        self.lora_versions[name] = self._loads[name]
        self._paths[name] = (path, pinned)

    async def unload_lora(self, name: str) -> None:
        """Unload an adapter on every live core; if one fails, it is loaded again where it was unloaded."""
        await asyncio.shield(self._one_at_a_time(self._unload_on_every_core(name)))

    async def _one_at_a_time(self, change) -> None:
        """Run an adapter change after those before it (shielded by the callers: one whose client is gone still
        ends, in its turn)."""
        async with self._lora_calls:
            await change

    async def _unload_on_every_core(self, name: str) -> None:
        cores = self._live()
        results = await asyncio.gather(*(c.unload_lora(name) for c in cores), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            done = [c for c, r in zip(cores, results) if not isinstance(r, BaseException)]
            if done and name in self._paths:
                await self._undo(done, name, self._paths[name], reload=False)
            raise failed[0]
        self.lora_versions.pop(name, None)
        self._paths.pop(name, None)

    async def _undo(self, cores: list[EngineClient], name: str, previous: tuple[str, bool] | None,
                    reload: bool = True) -> None:
        """Put `name` back as it was on `cores`: unloaded (no `previous`), or loaded again from the files it was
        loaded from before (its previous version: exact while those files are unchanged)."""
        if previous is None:
            undo = [c.unload_lora(name) for c in cores]
        else:
            undo = [c.load_lora(name, previous[0], previous[1], replace=reload) for c in cores]
        for c, r in zip(cores, await asyncio.gather(*undo, return_exceptions=True)):
            if isinstance(r, BaseException):
                logger.error("could not undo a change of LoRA adapter %r on engine core %d (%s): the cores now "
                             "differ; restart the server", name, self.clients.index(c), r)
