"""LoRA slot pool (device buffers that never move) and the manager that fills it.

The pool allocates, once, a `[max_loras, ...]` buffer pair per LoRA target of every layer and
hands the layers references to them. Loading an adapter copies it into a slot in place (unused
rank columns stay zero); unloading zeroes the slot. So adapters can come and go after CUDA graph
capture without re-capture. A slot is held by the running requests that use it and is only
evicted (LRU) when none does: a running request never sees its weights change.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

from moeserve.config import EngineConfig
from moeserve.layers.moe import ExpertLoRABuffers
from moeserve.lora.adapter import LoRAAdapter, LoRAAdapterError, load_lora_adapter
from moeserve.models.moe_decoder import MoEForCausalLM
from moeserve.models.spec import ModelSpec

if TYPE_CHECKING:  # the scheduler hands sequences in; lora/ does not depend on runtime/
    from moeserve.runtime.sequence import Sequence

logger = logging.getLogger("moeserve")

ATTN_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
ALL_TARGETS = ATTN_TARGETS + MLP_TARGETS + ("shared_expert", "experts")


class UnknownLoRAError(LookupError):
    """A request or call names an adapter the engine does not know."""


class LoRAInUseError(RuntimeError):
    """The adapter is used by queued or running requests."""


class LoRASlotPool:
    def __init__(self, spec: ModelSpec, model: MoEForCausalLM, max_loras: int, max_rank: int,
                 targets: set[str], device: torch.device, dtype: torch.dtype):
        self.spec, self.model, self.targets = spec, model, targets
        self.max_loras, self.max_rank = max_loras, max_rank
        L, R = max_loras, max_rank
        self.slot_ranks = torch.zeros(L, dtype=torch.int32, device=device)
        self.nbytes = 0

        def alloc(*shape):
            t = torch.zeros(*shape, dtype=dtype, device=device)
            self.nbytes += t.numel() * t.element_size()
            return t

        def attach(linear, wanted: bool):
            if wanted:
                S = len(linear.slice_sizes)
                linear.lora_a = alloc(L, S, R, linear.in_features)
                linear.lora_b = alloc(L, linear.out_features, R)

        mlp_wanted = any(t in targets for t in MLP_TARGETS)
        for layer in model.layers:
            attn = layer.self_attn
            attach(attn.qkv_proj, any(t in targets for t in ("q_proj", "k_proj", "v_proj")))
            attach(attn.o_proj, "o_proj" in targets)
            mlp = layer.mlp
            if not layer.is_sparse:
                attach(mlp.gate_up_proj, mlp_wanted)
                attach(mlp.down_proj, mlp_wanted)
                continue
            if "experts" in targets:
                E, H, inter = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size
                mlp.lora_bufs = ExpertLoRABuffers(alloc(L, E, R, H), alloc(L, E, 2 * inter, R),
                                                  alloc(L, E, R, inter), alloc(L, E, H, R))
            if mlp.shared_expert is not None and "shared_expert" in targets:
                attach(mlp.shared_expert.gate_up_proj, True)
                attach(mlp.shared_expert.down_proj, True)
        logger.info("LoRA slot pool: %d slots x rank %d over %s (%.1f MiB)", L, R, sorted(targets), self.nbytes / 2**20)

    def _dense_site(self, layer_idx: int, target: str):
        """(LoRALinear, slice index) that holds `target` of layer `layer_idx`."""
        layer = self.model.layers[layer_idx]
        if target in ("q_proj", "k_proj", "v_proj"):
            return layer.self_attn.qkv_proj, ("q_proj", "k_proj", "v_proj").index(target)
        if target == "o_proj":
            return layer.self_attn.o_proj, 0
        mlp = layer.mlp
        if target.startswith("shared_expert."):
            mlp, target = mlp.shared_expert, target.split(".", 1)[1]
        if target == "down_proj":
            return mlp.down_proj, 0
        return mlp.gate_up_proj, ("gate_proj", "up_proj").index(target)

    def check_fits(self, adapter: LoRAAdapter) -> None:
        """Raise LoRAAdapterError if the pool has no buffer for one of the adapter's targets."""
        for (layer_idx, target) in adapter.dense:
            linear, _ = self._dense_site(layer_idx, target)
            if linear is None or linear.lora_a is None:
                raise LoRAAdapterError(
                    f"adapter {adapter.name!r} targets {target} (layer {layer_idx}) but the engine's LoRA targets are "
                    f"{sorted(self.targets)}; start it with lora_target_modules including it")
        for layer_idx in adapter.experts:
            if self.model.layers[layer_idx].mlp.lora_bufs is None:
                raise LoRAAdapterError(
                    f"adapter {adapter.name!r} has routed-expert LoRA (layer {layer_idx}) but the engine's LoRA "
                    f"targets are {sorted(self.targets)}; start it with lora_target_modules including 'experts'")

    def clear(self, slot: int) -> None:
        for layer in self.model.layers:
            for linear in self._linears(layer):
                if linear.lora_a is not None:
                    linear.lora_a[slot].zero_()
                    linear.lora_b[slot].zero_()
            bufs = getattr(layer.mlp, "lora_bufs", None)
            if bufs is not None:
                for t in (bufs.gate_up_a, bufs.gate_up_b, bufs.down_a, bufs.down_b):
                    t[slot].zero_()
        self.slot_ranks[slot] = 0

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy an adapter into `slot` in place (after zeroing it: unused rank columns are zero)."""
        self.clear(slot)
        for (layer_idx, target), (a, b) in adapter.dense.items():
            linear, i = self._dense_site(layer_idx, target)
            r = a.shape[0]
            off = sum(linear.slice_sizes[:i])
            linear.lora_a[slot, i, :r].copy_(a)
            linear.lora_b[slot, off:off + linear.slice_sizes[i], :r].copy_(b)
        for layer_idx, ex in adapter.experts.items():
            bufs = self.model.layers[layer_idx].mlp.lora_bufs
            if ex.gate_up_a is not None:
                r = ex.gate_up_a.shape[1]
                bufs.gate_up_a[slot, :, :r].copy_(ex.gate_up_a)
                bufs.gate_up_b[slot, :, :, :r].copy_(ex.gate_up_b)
            if ex.down_a is not None:
                r = ex.down_a.shape[1]
                bufs.down_a[slot, :, :r].copy_(ex.down_a)
                bufs.down_b[slot, :, :, :r].copy_(ex.down_b)
        self.slot_ranks[slot] = adapter.rank

    @staticmethod
    def _linears(layer):
        out = [layer.self_attn.qkv_proj, layer.self_attn.o_proj]
        mlp = layer.mlp
        if not layer.is_sparse:
            out += [mlp.gate_up_proj, mlp.down_proj]
        elif mlp.shared_expert is not None:
            out += [mlp.shared_expert.gate_up_proj, mlp.shared_expert.down_proj]
        return out


class LoRAManager:
    """Known adapters (name -> path), a host LRU cache of parsed adapters, and slot assignment."""

    def __init__(self, config: EngineConfig, spec: ModelSpec, model: MoEForCausalLM, device: torch.device):
        self.config, self.spec = config, spec
        targets = self._resolve_targets(config)
        self.pool = LoRASlotPool(spec, model, config.max_loras, config.max_lora_rank, targets, device,
                                 config.torch_dtype)
        self.paths: dict[str, str] = {}
        self.pinned: set[str] = set()
        self.host_cache: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self.slot_name: list[str | None] = [None] * config.max_loras
        self.slot_users = [0] * config.max_loras
        self.slot_lru: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self.counters = {"lora_loads_total": 0, "lora_evictions_total": 0}

    def _resolve_targets(self, config: EngineConfig) -> set[str]:
        if config.lora_target_modules:
            bad = [t for t in config.lora_target_modules if t not in ALL_TARGETS]
            if bad:
                raise ValueError(f"lora_target_modules: unsupported {bad}; supported: {', '.join(ALL_TARGETS)}")
            return set(config.lora_target_modules)
        if config.lora_modules:
            targets: set[str] = set()
            for name, path in config.lora_modules.items():
                a = load_lora_adapter(name, path, self.spec, config.max_lora_rank)
                targets |= {t.split(".")[0] if t.startswith("shared_expert") else t for t in a.target_modules}
            return targets
        return set(ALL_TARGETS)

    # ---- registry ---------------------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self.paths)

    def _require_known(self, name: str) -> None:
        if name not in self.paths:
            raise UnknownLoRAError(f"unknown LoRA adapter {name!r}; loaded adapters: {sorted(self.paths) or 'none'}")

    def check_known(self, name: str) -> None:
        """Raise unless requests for `name` can be served (known, and a slot it could ever get)."""
        self._require_known(name)
        if name not in self.pinned and len(self.pinned) >= len(self.slot_name):
            raise LoRAAdapterError(f"adapter {name!r} cannot be served: all {len(self.slot_name)} LoRA slots are "
                                   f"pinned by {sorted(self.pinned)}")

    def register(self, name: str, path: str, pinned: bool = False, queued: list[Sequence] = ()) -> None:
        """Parse and validate now (errors leave every state unchanged), then make the name known.
        Pinning the last unpinned slot is refused while `queued` requests need other adapters."""
        if not isinstance(name, str) or not name or ":" in name:
            raise LoRAAdapterError(f"invalid adapter name {name!r} (non-empty, no ':')")
        if name in self.paths:
            raise LoRAAdapterError(f"an adapter named {name!r} is already loaded (from {self.paths[name]})")
        adapter = load_lora_adapter(name, path, self.spec, self.config.max_lora_rank)
        self.pool.check_fits(adapter)
        if pinned:
            needy = [q.request_id for q in queued if q.lora_name and q.lora_name not in self.pinned and not q.is_finished]
            if len(self.pinned) + 1 >= len(self.slot_name) and needy:
                raise LoRAInUseError(f"cannot pin {name!r}: it would take the last LoRA slot that {len(needy)} queued or "
                                     "running request(s) for unpinned adapters need")
            slot = self._free_slot()
            if slot is None:
                raise LoRAAdapterError(f"cannot pin {name!r}: every LoRA slot is in use")
            self._load_into(slot, name, adapter)
            self.pinned.add(name)
        self.paths[name] = str(path)
        self._cache(name, adapter)
        logger.info("registered LoRA adapter %s (rank %d, targets %s)", name, adapter.rank, sorted(adapter.target_modules))

    def unregister(self, name: str, running: list[Sequence]) -> None:
        self._require_known(name)
        users = [s.request_id for s in running if s.lora_name == name and not s.is_finished]
        if users:
            raise LoRAInUseError(f"adapter {name!r} is used by {len(users)} queued or running request(s); "
                                 "unload it when they finish")
        if name in self.slot_name:
            slot = self.slot_name.index(name)
            self.pool.clear(slot)
            self.slot_name[slot] = None
            self.slot_lru.pop(slot, None)
        self.paths.pop(name)
        self.pinned.discard(name)
        self.host_cache.pop(name, None)

    def _cache(self, name: str, adapter: LoRAAdapter) -> None:
        self.host_cache[name] = adapter
        self.host_cache.move_to_end(name)
        while len(self.host_cache) > self.config.max_cpu_loras:
            self.host_cache.popitem(last=False)

    def _adapter(self, name: str) -> LoRAAdapter:
        if name in self.host_cache:
            self.host_cache.move_to_end(name)
            return self.host_cache[name]
        adapter = load_lora_adapter(name, self.paths[name], self.spec, self.config.max_lora_rank)
        self._cache(name, adapter)
        return adapter

    # ---- slots (called by the scheduler) ----------------------------------------------------
    def _has_evictable_slot(self) -> bool:
        return any(n is None or (self.slot_users[i] == 0 and n not in self.pinned)
                   for i, n in enumerate(self.slot_name))

    def _free_slot(self) -> int | None:
        if None in self.slot_name:
            return self.slot_name.index(None)
        for slot in self.slot_lru:  # least recently used first
            if self.slot_users[slot] == 0 and self.slot_name[slot] not in self.pinned:
                self.counters["lora_evictions_total"] += 1
                return slot
        return None

    def _load_into(self, slot: int, name: str, adapter: LoRAAdapter) -> None:
        self.pool.load(slot, adapter)
        self.slot_name[slot] = name
        self.slot_lru[slot] = None
        self.slot_lru.move_to_end(slot)
        self.counters["lora_loads_total"] += 1

    def acquire(self, seq: Sequence) -> bool:
        """Give seq a slot holding its adapter; False if every slot is held by other adapters' requests."""
        name = seq.lora_name
        if name not in self.paths:
            return False
        if name in self.slot_name:
            slot = self.slot_name.index(name)
        else:
            if not self._has_evictable_slot():
                return False
            adapter = self._adapter(name)  # may re-read from disk: fail before touching any slot
            slot = self._free_slot()
            self._load_into(slot, name, adapter)
        self.slot_users[slot] += 1
        self.slot_lru.move_to_end(slot)
        seq.lora_slot = slot
        return True

    def release(self, seq: Sequence) -> None:
        if seq.lora_slot >= 0:
            self.slot_users[seq.lora_slot] -= 1
            seq.lora_slot = -1

    def stats(self) -> dict:
        s = dict(self.counters)
        s["lora_adapters_known"] = len(self.paths)
        s["lora_slots_used"] = sum(n is not None for n in self.slot_name)
        s["lora_slots_total"] = self.config.max_loras
        return s
