"""LoRA slot pool: device buffers that never move.

The pool allocates, once, a `[max_loras, ...]` buffer pair per LoRA target of every layer and
hands the layers references to them. Loading an adapter copies it into a slot in place (unused
rank columns stay zero); unloading zeroes the slot. So adapters can come and go after CUDA graph
capture without re-capture.
"""
from __future__ import annotations

import logging

import torch

from moeserve.layers.moe import ExpertLoRABuffers
from moeserve.lora.adapter import LoRAAdapter, LoRAAdapterError
from moeserve.models.moe_decoder import MoEForCausalLM
from moeserve.models.spec import ModelSpec

logger = logging.getLogger("moeserve")

ATTN_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
ALL_TARGETS = ATTN_TARGETS + MLP_TARGETS + ("shared_expert", "experts")


class LoRASlotPool:
    def __init__(self, spec: ModelSpec, model: MoEForCausalLM, max_loras: int, max_rank: int,
                 targets: set[str], device: torch.device, dtype: torch.dtype):
        self.spec, self.model, self.targets = spec, model, targets
        self.max_loras, self.max_rank = max_loras, max_rank
        L, R = max_loras, max_rank
        self.slot_ranks = torch.zeros(L, dtype=torch.int32, device=device)
        # bytes reserved per target group: logged at start, since the pool is sized before the KV cache
        # and scales with max_loras x max_lora_rank x every target (issue 10.3)
        self.nbytes_by_target: dict[str, int] = {}

        def alloc(group: str, *shape):
            t = torch.zeros(*shape, dtype=dtype, device=device)
            self.nbytes_by_target[group] = self.nbytes_by_target.get(group, 0) + t.numel() * t.element_size()
            return t

        def attach(group: str, linear, wanted: bool):
            if wanted:
                S = len(linear.slice_sizes)
                linear.lora_a = alloc(group, L, S, R, linear.in_features)
                linear.lora_b = alloc(group, L, linear.out_features, R)

        mlp_wanted = any(t in targets for t in MLP_TARGETS)
        for layer in model.layers:
            attn = layer.self_attn
            attach("q_proj/k_proj/v_proj", attn.qkv_proj, any(t in targets for t in ("q_proj", "k_proj", "v_proj")))
            attach("o_proj", attn.o_proj, "o_proj" in targets)
            mlp = layer.mlp
            if not layer.is_sparse:
                attach("gate_proj/up_proj/down_proj", mlp.gate_up_proj, mlp_wanted)
                attach("gate_proj/up_proj/down_proj", mlp.down_proj, mlp_wanted)
                continue
            if "experts" in targets:
                E, H, inter = mlp.w2.shape  # the layer's own shapes: a tensor-parallel rank holds a slice of inter
                mlp.lora_bufs = ExpertLoRABuffers(*(alloc("experts", *shape) for shape in (
                    (L, E, R, H), (L, E, 2 * inter, R), (L, E, R, inter), (L, E, H, R))))
            if mlp.shared_expert is not None and "shared_expert" in targets:
                attach("shared_expert", mlp.shared_expert.gate_up_proj, True)
                attach("shared_expert", mlp.shared_expert.down_proj, True)
        self.nbytes = sum(self.nbytes_by_target.values())
        per_target = ", ".join(f"{g} {b / 2**20:.1f} MiB" for g, b in
                               sorted(self.nbytes_by_target.items(), key=lambda kv: -kv[1]))
        logger.info("LoRA slot pool: %d slots x rank %d, %.1f MiB in all (%s); lower --max-loras / --max-lora-rank "
                    "or set --lora-target-modules to reserve less",
                    L, R, self.nbytes / 2**20, per_target or "no targets")

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
