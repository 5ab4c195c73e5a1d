"""float32 matmuls on the CPU through oneDNN, on weights reordered once into its blocked layout.

At decode sizes (a few rows) a CPU matmul is bound by reading the weight. MKL's GEMM on the plain layout reads
it at 6-9 GB/s on one core at 4-8 rows; oneDNN on a copy packed once at 13-17 GB/s (demo model shapes, 2x
faster at 4 rows, lm_head 20 -> 8 ms at 8 rows). The copy lives beside the parameter (twice the weight's
memory) and is remade when the parameter is replaced or written through itself.
"""
from __future__ import annotations

import torch


def packable(w: torch.Tensor) -> bool:
    """float32 on the CPU with oneDNN present (other dtypes keep the plain matmul and its rounding)."""
    return (w.device.type == "cpu" and w.dtype == torch.float32 and w.dim() == 2
            and torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled)


def pack(w: torch.Tensor) -> torch.Tensor | None:
    """The weight [out, in] reordered for oneDNN, or None where it cannot be (see packable)."""
    return torch.ops.mkldnn._reorder_linear_weight(w, None) if packable(w) else None


def linear(x: torch.Tensor, w: torch.Tensor, packed: torch.Tensor | None, bias: torch.Tensor | None = None):
    """x [T, in] @ w^T (+ bias) through the packed copy where there is one."""
    if packed is None or x.dtype != torch.float32 or x.dim() != 2:
        return torch.nn.functional.linear(x, w, bias)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


def identity(*weights: torch.Tensor) -> tuple:
    """What a packed copy was made from: storage and version (inference tensors, made under inference_mode,
    keep no version counter: their storage alone). Writes through `.data` are not seen."""
    return tuple((w.data_ptr(), None if w.is_inference() else w._version) for w in weights)


class PackedWeight:
    """One weight's packed copy, made at first use and remade when the weight changes (see identity)."""

    def __init__(self):
        self._key = None
        self._packed = None

    def get(self, w: torch.Tensor) -> torch.Tensor | None:
        if w.device.type != "cpu":
            return None
        key = identity(w)
        if key != self._key:
            self._key, self._packed = key, pack(w)
        return self._packed
