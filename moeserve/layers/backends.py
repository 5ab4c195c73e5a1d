"""The backend registry: which implementation each backend name selects, per kind of op.

"torch" selects the layer's own plain-torch code (the reference), so the registry answers None for it; "triton"
selects a kernels module, imported when first chosen (a torch-only engine never imports Triton). Layers ask once,
at construction, and keep the answer as an attribute: nothing is looked up per step.
"""
from __future__ import annotations

from types import ModuleType

from moeserve.exec_options import BACKENDS


def _paged_attention():
    from moeserve.kernels import paged_attention
    return paged_attention


def _norm_rotary():
    from moeserve.kernels import norm_rotary
    return norm_rotary


def _fused_moe():
    from moeserve.kernels import fused_moe
    return fused_moe


def _router():
    from moeserve.kernels import router
    return router


def _lora_dense():
    from moeserve.kernels import lora_dense
    return lora_dense


def _gemv():
    from moeserve.kernels import gemv
    return gemv


# op -> the Triton kernels module that implements it
TRITON_KERNELS = {
    "attention": _paged_attention,  # paged decode / prefill attention
    "norm": _norm_rotary,  # RMSNorm (+ residual add), and the attention prologue (q/k norm + rotary + KV write)
    "moe": _fused_moe,  # the routed experts (with their LoRA)
    "routing": _router,  # router GEMM + softmax + top-k
    "lora": _lora_dense,  # dense multi-LoRA shrink / expand
    "linear": _gemv,  # the decode-size GEMV of the dense projections
}


def kernels(op: str, backend: str) -> ModuleType | None:
    """The module implementing `op` under `backend`; None for "torch" (the layer runs its reference code)."""
    if op not in TRITON_KERNELS:
        raise KeyError(f"no backend registry entry for op {op!r} (known: {', '.join(TRITON_KERNELS)})")
    if backend not in BACKENDS:
        raise ValueError(f"backend for {op} must be one of {', '.join(BACKENDS)}, got {backend!r}")
    return TRITON_KERNELS[op]() if backend == "triton" else None
