"""LoRA manager: which adapter version sits in which slot of the pool (lora/slot_pool.py).

A slot is held by the requests bound to its adapter version (started
and not finished, preempted ones included) and is only evicted (LRU) when none is: a started request
never sees its weights change.

Reading adapter files (`parse`) touches no manager state, so the engine-core process runs it on a worker thread
and hands the parsed adapter to `register`; with `reader` set, a version that fell out of the host cache is also
re-read there (its requests wait) instead of on the step loop.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import Executor, Future
from dataclasses import dataclass

import torch

from moeserve import module_tree
from moeserve.config import EngineConfig
from moeserve.errors import AdapterInUseError, InvalidAdapterNameError, LoRAAdapterError, UnknownAdapterError
from moeserve.lora.adapter import LoRAAdapter, load_lora_adapter
from moeserve.lora.slot_pool import ALL_TARGETS, LoRASlotPool
from moeserve.model_spec import ModelSpec
from moeserve.models.moe_decoder import MoEForCausalLM
from moeserve.worker.sequence import Sequence

logger = logging.getLogger("moeserve")


@dataclass(eq=False)
class LoRAVersion:
    """One loaded version of a named adapter. Requests are bound to a version when they first start
    computing and keep it to their end (across preemption too), so a replace or an unload never changes
    the weights a started request sees."""
    name: str
    version: int
    path: str
    pinned: bool = False
    state: str = "live"  # live: new requests get it | draining: unloaded, finishing its requests | retired: replaced
    slot: int = -1
    users: int = 0  # requests bound to it and not finished: while > 0 its slot is neither evicted nor cleared


class LoRAManager:
    """Known adapters (name -> live version), a host LRU cache of parsed adapters, and slot assignment.

    Unload drains: the name stops taking requests at once (and is no longer listed), its queued and running
    requests finish, then its slot is zeroed and the name is free. Replace (`register(..., replace=True)`)
    gives the name a new version that new requests bind to; the old version keeps its slot for the requests
    bound to it and frees it when they finish, so the new one goes into a different slot (slots never move,
    and a slot is never written while a started request uses it). A request still queued when a replace or
    unload+load lands starts on the newer version: nothing of it has been computed yet.
    """

    def __init__(self, config: EngineConfig, spec: ModelSpec, model: MoEForCausalLM, device: torch.device):
        self.config, self.spec = config, spec
        self._parsed_at_start: dict[str, LoRAAdapter] = {}  # lora_modules read to infer targets, kept for register
        targets = self._resolve_targets(config)
        separate = config.lora_separate_gate_up
        if separate is None:  # auto: what the start-up adapters need
            separate = any(self._start_adapter(name, path).separate_gate_up
                           for name, path in config.lora_modules.items())
        self.pool = LoRASlotPool(spec, model, config.max_loras, config.max_lora_rank, targets, device,
                                 config.torch_dtype, separate_gate_up=separate)
        self.live: dict[str, LoRAVersion] = {}  # name -> the version requests for it bind to (live or draining)
        self.host_cache: OrderedDict[tuple[str, int], LoRAAdapter] = OrderedDict()  # (name, version) -> parsed
        self.slot_ver: list[LoRAVersion | None] = [None] * config.max_loras
        self.slot_lru: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self.slot_loaded_at = [0] * config.max_loras  # load order: the longest-resident slot is drained first
        self._loads = 0
        self._versions: dict[str, int] = {}  # name -> last version number given (never reused, also after unload)
        self._bound: dict[Sequence, LoRAVersion] = {}
        self._queued: dict[Sequence, str] = {}  # accepted, not yet bound (see add)
        self._queued_per_name: dict[str, int] = {}
        self.reader: Executor | None = None  # where evicted adapters are re-read; None: at once, on the caller's thread
        self._reading: dict[tuple[str, int], Future] = {}  # (name, version) -> its re-read in progress
        # lora_rereads_total: adapters read from disk again after they fell out of the host cache
        self.counters = {"lora_loads_total": 0, "lora_evictions_total": 0, "lora_rereads_total": 0}

    def _resolve_targets(self, config: EngineConfig) -> set[str]:
        if config.lora_target_modules:  # checked against ALL_TARGETS by EngineConfig.resolve
            return set(config.lora_target_modules)
        if config.lora_modules:
            targets: set[str] = set()
            for name, path in config.lora_modules.items():
                a = self._start_adapter(name, path)
                targets |= {module_tree.target_module(t) for t in a.target_modules}
            return targets
        return set(ALL_TARGETS)

    def _start_adapter(self, name: str, path: str) -> LoRAAdapter:
        """A lora_modules adapter, read once at start (kept for register_configured)."""
        if name not in self._parsed_at_start:
            self._parsed_at_start[name] = load_lora_adapter(name, path, self.spec, self.config.max_lora_rank,
                                                            serve_dtype=self.config.torch_dtype)
        return self._parsed_at_start[name]

    # ---- registry ---------------------------------------------------------------------------
    @property
    def slot_name(self) -> list[str | None]:
        return [v.name if v is not None else None for v in self.slot_ver]

    @property
    def pinned(self) -> set[str]:
        return {n for n, v in self.live.items() if v.pinned}

    def names(self) -> list[str]:
        """Names new requests may use (draining ones are not listed)."""
        return [n for n, v in self.live.items() if v.state == "live"]

    def version(self, name: str) -> int:
        """Version number of the adapter `name` serves new requests with (1 at first load, +1 per reload)."""
        self._require_known(name)
        return self.live[name].version

    def versions(self) -> dict[str, int]:
        """name -> version new requests get, for every name new requests may use."""
        return {n: v.version for n, v in self.live.items() if v.state == "live"}

    def _require_known(self, name: str) -> None:
        v = self.live.get(name)
        if v is None or v.state != "live":
            raise UnknownAdapterError(f"LoRA adapter {name!r} is not loaded; "
                                   f"loaded adapters: {sorted(self.names()) or 'none'}")

    def check_known(self, name: str) -> None:
        """Raise unless requests for `name` can be served (known, and a slot it could ever get)."""
        self._require_known(name)
        pinned = self.pinned
        if name not in pinned and len(pinned) >= len(self.slot_ver):
            raise LoRAAdapterError(f"adapter {name!r} cannot be served: all {len(self.slot_ver)} LoRA slots are "
                                   f"pinned by {sorted(pinned)}")

    def parse(self, name: str, path: str) -> LoRAAdapter:
        """Read and validate the adapter folder `path` for this engine (LoRAAdapterError if it cannot be served).
        Touches no manager state: safe on another thread while the engine steps."""
        adapter = load_lora_adapter(name, path, self.spec, self.config.max_lora_rank,
                                    serve_dtype=self.config.torch_dtype)
        self.pool.check_fits(adapter)
        return adapter

    def register_configured(self) -> None:
        """Register the adapters of lora_modules, each read from disk once (target inference may have read it)."""
        for name, path in self.config.lora_modules.items():
            adapter = self._parsed_at_start.pop(name, None)
            if adapter is not None:
                self.pool.check_fits(adapter)
            self.register(name, path, adapter=adapter)

    def preload_configured(self) -> int:
        """Copy the adapters of lora_modules into free slots now, in order, while slots are free (they stay
        evictable, as if used once): the first requests of a fresh server then find their adapter resident
        instead of waiting for its copy to the device (about 1.3 GB a rank-16 adapter on every expert of a
        48-layer model). Returns how many were loaded."""
        loaded = 0
        for name in self.config.lora_modules:
            v = self.live.get(name)
            if v is None or v.slot >= 0 or None not in self.slot_ver:
                continue
            adapter = self._adapter(v)
            if adapter is None:
                continue
            self._load_into(self.slot_ver.index(None), v, adapter)
            loaded += 1
        return loaded

    def check_name(self, name: str, replace: bool = False) -> None:
        """Raise unless `name` may be registered now (valid; not loaded, or `replace`)."""
        if not isinstance(name, str) or not name or ":" in name:
            raise InvalidAdapterNameError(f"invalid adapter name {name!r} (non-empty, no ':')")
        old = self.live.get(name)
        if old is not None and old.state == "live" and not replace:
            raise LoRAAdapterError(f"an adapter named {name!r} is already loaded (from {old.path}); "
                                   "reload it with replace=True")

    def register(self, name: str, path: str, pinned: bool = False, queued: list[Sequence] = (),
                 replace: bool = False, adapter: LoRAAdapter | None = None) -> None:
        """Make the name known (errors leave every state unchanged). `adapter`: what `parse(name, path)` returned
        (parsed elsewhere); None parses here. `replace=True` gives an already loaded name a new version (see the
        class docstring). Pinning the last unpinned slot is refused while `queued` requests need other adapters."""
        self.check_name(name, replace)
        old = self.live.get(name)
        if adapter is None:
            adapter = self.parse(name, path)
        slot = None
        if pinned:
            others = self.pinned - {name}
            needy = [q.request_id for q in queued
                     if q.lora_name and q.lora_name not in others and q.lora_name != name and not q.is_finished]
            if len(others) + 1 >= len(self.slot_ver) and needy:
                raise AdapterInUseError(f"cannot pin {name!r}: it would take the last LoRA slot that {len(needy)} "
                                        "queued or running request(s) for unpinned adapters need")
            # the old version's slot counts as free when nothing uses it: it is dropped below
            slot = self._free_slot(also=old)
            if slot is None:
                raise LoRAAdapterError(f"cannot pin {name!r}: every LoRA slot is in use")
        version = self._versions.get(name, 0) + 1
        self._versions[name] = version
        new = LoRAVersion(name, version, str(path), pinned=pinned)
        if old is not None:
            self.live.pop(name)
            old.pinned = False
            old.state = "retired"
            self._maybe_drop(old)
        self.live[name] = new
        self._cache(new, adapter)
        if slot is not None:
            self._load_into(slot, new, adapter)  # evicts an unused unpinned adapter if the slot holds one
        logger.info("registered LoRA adapter %s version %d (rank %d, targets %s)", name, version, adapter.rank,
                    sorted(adapter.target_modules))

    def unregister(self, name: str) -> None:
        """Unload with draining: new requests for `name` are refused from now on; queued and running ones
        finish on it; then its slot is zeroed and the name is free (dropped at once when nothing uses it)."""
        self._require_known(name)
        v = self.live[name]
        v.pinned = False
        v.state = "draining"
        self._maybe_drop(v)

    def _maybe_drop(self, v: LoRAVersion) -> None:
        """Free a version nobody can use any more: a retired one without bound requests, a draining one
        without bound or queued requests. Its slot is zeroed in place (the buffers never move)."""
        if v.state == "live" or v.users > 0:
            return
        if v.state == "draining":
            if self._queued_per_name.get(v.name, 0) > 0:
                return
            del self.live[v.name]
        self._reading.pop((v.name, v.version), None)  # a re-read still running is dropped when it ends
        if v.slot >= 0:
            slot = v.slot
            self.pool.clear(slot)
            self.slot_ver[slot] = None
            self.slot_lru.pop(slot, None)
            v.slot = -1
        self.host_cache.pop((v.name, v.version), None)

    def _cache(self, v: LoRAVersion, adapter: LoRAAdapter) -> None:
        key = (v.name, v.version)
        self.host_cache[key] = adapter
        self.host_cache.move_to_end(key)
        while len(self.host_cache) > self.config.max_cpu_loras:
            self.host_cache.popitem(last=False)

    def _adapter(self, v: LoRAVersion) -> LoRAAdapter | None:
        """The parsed adapter of `v`: from the host cache, else read again (on `reader` when set: None until that
        read is done; its error is raised to the request that collects it, and the next one reads again)."""
        key = (v.name, v.version)
        if key in self.host_cache:
            self.host_cache.move_to_end(key)
            return self.host_cache[key]
        if self.reader is None:
            adapter = self.parse(v.name, v.path)
        else:
            read = self._reading.get(key)
            if read is None:
                self._reading[key] = self.reader.submit(self.parse, v.name, v.path)
                return None
            if not read.done():
                return None
            del self._reading[key]
            adapter = read.result()
        self.counters["lora_rereads_total"] += 1
        self._cache(v, adapter)
        return adapter

    # ---- requests and slots (called by the core and the scheduler) ----------------------------
    def add(self, seq: Sequence) -> None:
        """A request for seq.lora_name was accepted: its name is not freed before it finishes."""
        self._queued[seq] = seq.lora_name
        self._queued_per_name[seq.lora_name] = self._queued_per_name.get(seq.lora_name, 0) + 1

    def _unqueue(self, seq: Sequence) -> str | None:
        name = self._queued.pop(seq, None)
        if name is not None:
            self._queued_per_name[name] -= 1
            if not self._queued_per_name[name]:
                del self._queued_per_name[name]
        return name

    def _evictable(self, slot: int) -> bool:
        v = self.slot_ver[slot]
        return v is None or (v.users == 0 and not v.pinned)

    def _has_evictable_slot(self) -> bool:
        return any(self._evictable(i) for i in range(len(self.slot_ver)))

    def _free_slot(self, also: LoRAVersion | None = None) -> int | None:
        """An empty slot, else the least recently used one no request holds (None if there is none).
        `also`: a version about to be dropped, whose slot counts as free when it has no users."""
        if None in self.slot_ver:
            return self.slot_ver.index(None)
        if also is not None and also.slot >= 0 and also.users == 0:
            return also.slot
        for slot in self.slot_lru:  # least recently used first
            if self._evictable(slot):
                return slot
        return None

    def _evict(self, slot: int) -> None:
        """Forget an unused adapter's residency (its weights are overwritten by the next load)."""
        v = self.slot_ver[slot]
        v.slot = -1
        self.counters["lora_evictions_total"] += 1
        self.slot_ver[slot] = None
        self.slot_lru.pop(slot, None)

    def _load_into(self, slot: int, v: LoRAVersion, adapter: LoRAAdapter) -> None:
        if self.slot_ver[slot] is not None:
            self._evict(slot)
        self.pool.load(slot, adapter)
        self.slot_ver[slot] = v
        v.slot = slot
        self.slot_lru[slot] = None
        self.slot_lru.move_to_end(slot)
        self._loads += 1
        self.slot_loaded_at[slot] = self._loads
        self.counters["lora_loads_total"] += 1

    def slot_of(self, seq: Sequence) -> tuple[int, bool]:
        """(slot seq would run in without loading anything, -1 if it needs a new slot; whether it is bound)."""
        v = self._bound.get(seq)
        if v is not None:
            return v.slot, True
        v = self.live.get(seq.lora_name)
        return (v.slot if v is not None else -1), False

    def identity(self, seq: Sequence) -> tuple[str, int] | None:
        """(name, version) of the adapter version seq is bound to (after acquire): what a prefix-cache key
        holds (docs/architecture.md, invariant 9) — versions of a name are never reused, also after an unload."""
        v = self._bound.get(seq)
        return (v.name, v.version) if v is not None else None

    def acquire(self, seq: Sequence) -> bool:
        """Give seq a slot holding its adapter version (binding it to the live version if it has none yet);
        False if every slot is held by requests of other versions. Raises if the adapter cannot be read."""
        v = self._bound.get(seq)
        if v is None:
            v = self.live.get(seq.lora_name)
            if v is None:
                return False
            if v.slot < 0:
                if not self._has_evictable_slot():
                    return False
                adapter = self._adapter(v)  # may re-read from disk: fail before touching any slot
                if adapter is None:  # being read on the reader thread: wait for it like for a slot
                    return False
                self._load_into(self._free_slot(), v, adapter)
            self._unqueue(seq)
            self._bound[seq] = v
            v.users += 1
        seq.lora_slot = v.slot
        self.slot_lru.move_to_end(v.slot)
        return True

    def preempt(self, seq: Sequence) -> None:
        """seq stops computing for now (preempted, or not admitted after all): it keeps its version, and
        the version keeps its slot, so it resumes on the same weights."""
        seq.lora_slot = -1

    def release(self, seq: Sequence) -> None:
        """seq is done (finished, aborted, failed): unbind it; free versions nobody can use any more."""
        seq.lora_slot = -1
        v = self._bound.pop(seq, None)
        if v is not None:
            v.users -= 1
        else:
            name = self._unqueue(seq)
            v = self.live.get(name) if name is not None else None
        if v is not None:
            self._maybe_drop(v)

    def drain_victim(self) -> int:
        """The slot to drain so a request waiting for a new slot can have it: -1 when one is free or is
        freeing by itself (it holds a replaced or unloaded version); else the longest-resident unpinned slot
        (each adapter gets its turn), or -1 if every slot is pinned."""
        if self._has_evictable_slot() or any(v is not None and v.state != "live" for v in self.slot_ver):
            return -1
        candidates = [i for i, v in enumerate(self.slot_ver) if not v.pinned]
        return min(candidates, key=lambda i: self.slot_loaded_at[i]) if candidates else -1

    def stats(self) -> dict:
        """The lora_* fields of the engine's stats (moeserve/messages.py EngineStats)."""
        s = dict(self.counters)
        s["lora_adapters_known"] = len(self.names())
        s["lora_adapters_draining"] = sum(v.state == "draining" for v in self.live.values())
        s["lora_slots_used"] = sum(v is not None for v in self.slot_ver)
        s["lora_slots_total"] = self.config.max_loras
        s["lora_versions"] = {n: v.version for n, v in self.live.items() if v.state == "live"}
        return s
