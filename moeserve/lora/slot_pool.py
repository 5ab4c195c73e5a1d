"""LoRA slot pool: device buffers that never move.

The pool allocates, once, a `[max_loras, ...]` buffer pair per LoRA target of every layer and
hands the layers references to them. Loading an adapter copies it into a slot in place (unused
rank columns stay zero); unloading zeroes the slot. So adapters can come and go after CUDA graph
capture without re-capture.
"""
from __future__ import annotations

import logging
import math

import torch

from moeserve import module_tree
from moeserve.layers.moe import ExpertLoRABuffers
from moeserve.lora.adapter import LoRAAdapter, LoRAAdapterError
from moeserve.models.moe_decoder import MoEForCausalLM
from moeserve.model_spec import ModelSpec

logger = logging.getLogger("moeserve")

# The LoRA targets (module_tree.py). "router": a dense LoRA on the MoE router's logits (PEFT `all-linear` puts one
# there); its buffers are tiny ([E + H] x rank per slot and sparse layer), so it is part of the default targets.
# "shared_expert_gate": qwen2's [1, H] sigmoid gate of the shared expert, also an `all-linear` target.
ALL_TARGETS = module_tree.ALL_TARGETS


def _layer_linears(spec: ModelSpec, layer) -> list[tuple[module_tree.Projection, object]]:
    """(first projection, LoRALinear) of every LoRA-capable linear of a decoder layer, in module-tree order."""
    out, seen = [], set()
    for p in module_tree.layer_projections(spec, layer.layer_idx):
        if p.module not in seen:
            seen.add(p.module)
            out.append((p, module_tree.submodule(layer, p.module)))
    return out


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def describe_by_target(nbytes_by_target: dict[str, int]) -> str:
    """'experts 1.20 GiB, q_proj/k_proj/v_proj 96.00 MiB, ...', largest first."""
    return ", ".join(f"{g} {format_bytes(b)}" for g, b in sorted(nbytes_by_target.items(), key=lambda kv: -kv[1]))


class LoRASlotPool:
    def __init__(self, spec: ModelSpec, model: MoEForCausalLM, max_loras: int, max_rank: int,
                 targets: set[str], device: torch.device, dtype: torch.dtype, separate_gate_up: bool = False):
        self.spec, self.model, self.targets = spec, model, targets
        # an up A per expert slot next to the gate_up A: adapters with separate gate and up LoRAs of rank r then
        # cost rank r (otherwise they are stacked into rank 2r); +H per rank of every expert slot
        self.separate_gate_up = separate_gate_up
        self.max_loras, self.max_rank = max_loras, max_rank
        self.slot_ranks = torch.zeros(max_loras, dtype=torch.int32, device=device)
        # bytes reserved per target group: logged at start, since the pool is sized before the KV cache
        # and scales with max_loras x max_lora_rank x every target (issue 10.3)
        self.nbytes_by_target: dict[str, int] = {}
        elem = torch.empty((), dtype=dtype).element_size()

        def count(group: str, *shape):  # 1-d: a per-slot int32 flag
            size = elem if len(shape) > 1 else 4
            self.nbytes_by_target[group] = self.nbytes_by_target.get(group, 0) + math.prod(shape) * size

        self._walk(count)  # sizes first: a pool that cannot fit is refused by name, not by an allocator error
        self.nbytes = sum(self.nbytes_by_target.values())
        self._check_device_memory(device)
        self._walk(lambda group, *shape: torch.zeros(*shape, dtype=dtype if len(shape) > 1 else torch.int32,
                                                     device=device))
        logger.info("LoRA slot pool: %d slots x rank %d, %s in all (%s); lower --max-loras / --max-lora-rank "
                    "or set --lora-target-modules to reserve less",
                    max_loras, max_rank, format_bytes(self.nbytes), describe_by_target(self.nbytes_by_target)
                    or "no targets")

    def _walk(self, make) -> None:
        """Visit every buffer the targets need; `make(group, *shape)` returns the buffer to attach, or None
        (counting only)."""
        L, R, targets = self.max_loras, self.max_rank, self.targets

        for layer in self.model.layers:
            for p, linear in _layer_linears(self.spec, layer):
                if any(t in targets for t in p.enabled_by):
                    a = make(p.pool_group, L, len(linear.slice_sizes), R, linear.in_features)
                    b = make(p.pool_group, L, linear.out_features, R)
                    if a is not None:
                        linear.lora_a, linear.lora_b = a, b
            mlp = layer.mlp
            if layer.is_sparse and module_tree.EXPERTS_TARGET in targets:
                E, H, inter = mlp.w2.shape  # the layer's own shapes: a tensor-parallel rank holds a slice of inter
                bufs = [make("experts", *shape) for shape in ((L, E, R, H), (L, E, 2 * inter, R), (L, E, R, inter),
                                                              (L, E, H, R))]
                up_a = make("experts", L, E, R, H) if self.separate_gate_up else None
                flags = make("experts", L) if self.separate_gate_up else None
                if bufs[0] is not None:
                    mlp.lora_bufs = ExpertLoRABuffers(*bufs, up_a=up_a, gate_up_separate=flags)

    def _check_device_memory(self, device: torch.device) -> None:
        if device.type != "cuda":
            return
        free = torch.cuda.mem_get_info(device)[0]
        if self.nbytes > free:
            raise ValueError(
                f"the LoRA slot pool ({self.max_loras} slots x rank {self.max_rank}) needs "
                f"{format_bytes(self.nbytes)} ({describe_by_target(self.nbytes_by_target)}) but {format_bytes(free)} "
                "of device memory are free "
                "after the weights; lower max_loras (--max-loras) or max_lora_rank (--max-lora-rank), or list only "
                "the targets your adapters use in lora_target_modules (--lora-target-modules)")

    def _dense_site(self, layer_idx: int, target: str):
        """(LoRALinear, slice index) that holds `target` of layer `layer_idx`."""
        p = module_tree.projection(target)
        return module_tree.submodule(self.model.layers[layer_idx], p.module), p.slice

    def check_fits(self, adapter: LoRAAdapter) -> None:
        """Raise LoRAAdapterError if the pool has no buffer for one of the adapter's targets."""
        for (layer_idx, target) in adapter.dense:
            linear, _ = self._dense_site(layer_idx, target)
            if linear is None or linear.lora_a is None:
                group = module_tree.target_module(target)
                raise LoRAAdapterError(
                    f"adapter {adapter.name!r} targets {target} (layer {layer_idx}) but the engine's LoRA targets are "
                    f"{sorted(self.targets)}; start it with lora_target_modules (--lora-target-modules) including "
                    f"{group!r}")
        if not self.separate_gate_up and adapter.stacked_rank > self.max_rank:
            raise LoRAAdapterError(
                f"adapter {adapter.name!r} has separate gate_proj and up_proj LoRAs on the routed experts; this "
                f"engine holds them stacked into one LoRA of rank {adapter.stacked_rank}, above its max_lora_rank "
                f"{self.max_rank} (--max-lora-rank); start it with lora_separate_gate_up (--lora-separate-gate-up) "
                f"so that each costs rank {adapter.rank}")
        for layer_idx in adapter.experts:
            if self.model.layers[layer_idx].mlp.lora_bufs is None:
                raise LoRAAdapterError(
                    f"adapter {adapter.name!r} has routed-expert LoRA (layer {layer_idx}) but the engine's LoRA "
                    f"targets are {sorted(self.targets)}; start it with lora_target_modules (--lora-target-modules) "
                    "including 'experts'")

    def clear(self, slot: int) -> None:
        for layer in self.model.layers:
            for linear in self._linears(layer):
                if linear.lora_a is not None:
                    linear.lora_a[slot].zero_()
                    linear.lora_b[slot].zero_()
            bufs = getattr(layer.mlp, "lora_bufs", None)
            if bufs is not None:
                for t in (bufs.gate_up_a, bufs.gate_up_b, bufs.down_a, bufs.down_b, bufs.up_a, bufs.gate_up_separate):
                    if t is not None:
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
                a, b = ex.gate_up_a, ex.gate_up_b
                if ex.up_a is not None and bufs.up_a is not None:
                    bufs.up_a[slot, :, :a.shape[1]].copy_(ex.up_a)
                    bufs.gate_up_separate[slot] = 1
                elif ex.up_a is not None:  # no up A in this pool: one LoRA of rank 2r (check_fits allowed it)
                    a, b = ex.stacked_gate_up()
                r = a.shape[1]
                bufs.gate_up_a[slot, :, :r].copy_(a)
                bufs.gate_up_b[slot, :, :, :r].copy_(b)
            if ex.down_a is not None:
                r = ex.down_a.shape[1]
                bufs.down_a[slot, :, :r].copy_(ex.down_a)
                bufs.down_b[slot, :, :, :r].copy_(ex.down_b)
        self.slot_ranks[slot] = adapter.rank if self.separate_gate_up else adapter.stacked_rank

    def _linears(self, layer):
        return [linear for _, linear in _layer_linears(self.spec, layer)]


def lora_slot_state(pool) -> list[tuple[int, bool]]:
    """(rank, holds any nonzero weight) per slot of a LoRA slot pool."""
    model = pool.model
    used = [False] * pool.max_loras
    for layer in model.layers:
        bufs = getattr(layer.mlp, "lora_bufs", None)
        tensors = [t for lin in pool._linears(layer) if lin.lora_a is not None for t in (lin.lora_a, lin.lora_b)]
        tensors += [] if bufs is None else [bufs.gate_up_a, bufs.gate_up_b, bufs.down_a, bufs.down_b]
        for t in tensors:
            for slot in range(pool.max_loras):
                used[slot] = used[slot] or bool(t[slot].any())
    return list(zip(pool.slot_ranks.tolist(), used))
