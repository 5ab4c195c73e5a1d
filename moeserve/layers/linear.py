"""Linear projections that can carry multi-LoRA deltas.

A projection may be fused (q|k|v, gate|up): `slice_sizes` names its output slices, each of
which may have its own LoRA. The LoRA buffers (`lora_a [L, S, R, in]`, `lora_b [L, N, R]`)
are allocated once by the slot pool and never move; slots are filled in place.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.layers.batch import LoRABatch


def dense_lora_torch(x, lora_a, lora_b, token_slots, slot_ranks, slice_sizes, out, slots=None) -> None:
    """Plain-torch multi-LoRA: out[t, slice i] += (x[t] A_i[s]^T) B_i[s]^T for s = token_slots[t] >= 0.

    Sync-free and shape-static (loops over the static slot count, or the host-known `slots` of an
    eager batch); rows without an adapter are left bitwise untouched. Zero rank columns contribute
    exact zeros, so slot_ranks is not needed.
    """
    num_slots, num_slices, rank, in_dim = lora_a.shape
    x = x.to(lora_a.dtype)
    for slot in (range(num_slots) if slots is None else slots):
        shrink = x @ lora_a[slot].reshape(num_slices * rank, in_dim).t()  # [T, S*R]
        parts, off = [], 0
        for i, n in enumerate(slice_sizes):
            parts.append(shrink[:, i * rank:(i + 1) * rank] @ lora_b[slot, off:off + n].t())
            off += n
        delta = torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]
        mask = (token_slots == slot).unsqueeze(-1)
        out.copy_(torch.where(mask, out + delta.to(out.dtype), out))


class LoRALinear(nn.Module):
    """y = x W^T (+ b) (+ per-token LoRA delta when the batch carries LoRA and this layer has slots)."""

    def __init__(self, in_features: int, slice_sizes: tuple[int, ...], bias: bool, lora_backend: str = "torch"):
        super().__init__()
        self.in_features = in_features
        self.slice_sizes = tuple(slice_sizes)
        self.out_features = sum(slice_sizes)
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(self.out_features), requires_grad=False) if bias else None
        self.lora_a: torch.Tensor | None = None  # [L, S, R, in], set by the slot pool
        self.lora_b: torch.Tensor | None = None  # [L, N, R]
        self.use_triton = lora_backend == "triton"
        if self.use_triton:
            from moeserve.kernels.lora_dense import dense_lora

            self.triton_lora = dense_lora

    def forward(self, x: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if lora is not None and self.lora_a is not None:
            self.add_lora(x, lora, y)
        return y

    def add_lora(self, x: torch.Tensor, lora: LoRABatch, out: torch.Tensor) -> None:
        """out += each row's adapter delta (rows without an adapter untouched); needs the slot pool's buffers."""
        args = (x, self.lora_a, self.lora_b, lora.token_slots, lora.slot_ranks, self.slice_sizes, out)
        if self.use_triton:
            self.triton_lora(*args)
        else:
            dense_lora_torch(*args, slots=lora.active_slots)
