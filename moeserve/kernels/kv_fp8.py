"""FP8 KV cache (--kv-cache-dtype fp8): K and V stored float8_e4m3fn, each layer's K and V with a float32 scale of
their own (the checkpoint's `self_attn.k_scale` / `v_scale`, 1.0 where it has none, as vLLM does):

    stored = rne_e4m3(clamp(x / scale, -448, 448)),   x ~ stored * scale

x is the value the unquantized cache would hold (the activation dtype), divided in float32 (correctly rounded).
e4m3fn has no infinity: a value beyond ±448 would cast to NaN (or saturate, depending on the implementation), so it
is clamped first. Attention never dequantizes a tile: it multiplies q·k by the softmax scale times k_scale and its
output by v_scale, the same products in another order.

Plain torch (no Triton import): the torch attention path and the kernels' twins use it; the Triton prologue
(kernels/norm_rotary.py) stores bitwise the same bytes.
"""
from __future__ import annotations

import torch

KV_FP8_DTYPE = torch.float8_e4m3fn
KV_FP8_MAX = 448.0  # e4m3fn's largest finite value


def quantize_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x (any float dtype) -> float8_e4m3fn: x / scale in float32, clamped to ±448, rounded to nearest even."""
    x32 = x.float()
    # a tensor divisor: on CUDA, torch turns division by a Python scalar into a multiply by its reciprocal, which
    # rounds differently from the kernel's correctly rounded division
    return (x32 / x32.new_full((), scale)).clamp(-KV_FP8_MAX, KV_FP8_MAX).to(KV_FP8_DTYPE)


def write_kv_slots(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, scale: float = 1.0) -> None:
    """x [T, n_kv, d] into cache [blocks, block_size, n_kv, d] at the flat slots [T]: cast to the cache's dtype, or
    quantized with `scale` where the cache is fp8."""
    nkv, d = cache.shape[-2:]
    if cache.dtype == KV_FP8_DTYPE:  # index_copy_ has no fp8 kernel: the bytes, through uint8 views
        cache.view(torch.uint8).view(-1, nkv, d).index_copy_(0, slots, quantize_kv(x, scale).view(torch.uint8))
    else:
        cache.view(-1, nkv, d).index_copy_(0, slots, x.to(cache.dtype))
