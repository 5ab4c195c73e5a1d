"""Block-wise FP8 (e4m3fn) as Qwen and DeepSeek publish it, and the dynamic activation quantization of W8A8.

Weights: each [out, in] matrix in blocks of 128 x 128 (edge blocks partial), one float32 `scale_inv` per block:

    scale_inv = amax(|w| over the block) / 448,   w_fp8 = rne_e4m3(clamp(w / scale_inv, -448, 448))
    w ≈ w_fp8 * scale_inv                         scale_inv [..., ceil(out/128), ceil(in/128)]

Activations (W8A8): one scale per (row, group of 128 columns along K), computed at run time the same way: the
weight convention with blocks of 1 x 128 (`quantize_block_fp8(x, (1, 128))` is the twin of the kernel).

e4m3fn: 4 exponent bits (bias 7), 3 mantissa bits, no infinities, largest finite 448, subnormals down to 2^-9.
A cast rounds to nearest even; whether it saturates depends on the implementation (torch 2.13 on CPU does,
Triton's interpreter wraps to NaN or garbage, and rounds ties away and flushes some subnormals), so every
quantizer clamps to ±448 first, and the Triton quantizer rounds to the e4m3 grid itself (`rne_e4m3`) before the
cast, which is then exact everywhere: the kernel is bitwise its twin on CPU and GPU.

Round trip: an element whose scaled value |w / scale_inv| lies in the binade [2^e, 2^(e+1)) (e >= -6) is off by
at most half an ulp, 2^(e-4) <= 2^-4 of itself; below 2^-6 (subnormal) by at most 2^-10. In units of the
block: at the top binade [256, 448] half an ulp is 16, so every element is within 16 * scale_inv = amax / 28 of
its value (2^-4 of the block amax is the looser 28 / 448 = 1 / 16 of it). All-zero blocks or groups get scale 0
and fp8 zeros (the division is skipped), which dequantize to exact zeros.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from moeserve.kernels import pdl as pdl_launch
from moeserve.kernels.moe_lora import silu_mul

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
WEIGHT_BLOCK = (128, 128)  # the published weight_block_size [out, in]
ACT_GROUP = 128  # activation columns sharing one scale (the weight block's `in` extent)


# ---------------------------------------------------------------------------------------------
# plain torch: the published convention (and the twins of the kernels below)


def _expand_blocks(scale: torch.Tensor, block: tuple[int, int], n: int, k: int) -> torch.Tensor:
    """[..., nb, kb] per-block values -> [..., n, k] per element."""
    bn, bk = block
    return scale.repeat_interleave(bn, -2).repeat_interleave(bk, -1)[..., :n, :k]


def quantize_block_fp8(w: torch.Tensor, block: tuple[int, int] = WEIGHT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., out, in] (any float dtype) -> (w_fp8 [..., out, in] float8_e4m3fn, scale_inv [..., ceil(out/bn),
    ceil(in/bk)] float32), blocks of `block` = (bn, bk) over the last two dims, edge blocks partial."""
    if w.dim() < 2 or not w.is_floating_point():
        raise ValueError(f"quantize_block_fp8 needs a float tensor of 2 or more dims, got {w.dtype} {tuple(w.shape)}")
    bn, bk = block
    *lead, n, k = w.shape
    w32 = w.float()
    padded = F.pad(w32, (0, -k % bk, 0, -n % bn))  # zeros leave every block's amax as it is
    nb, kb = padded.shape[-2] // bn, padded.shape[-1] // bk
    amax = padded.reshape(*lead, nb, bn, kb, bk).abs().amax(dim=(-3, -1))
    # a tensor divisor: torch on CUDA turns division by a Python scalar into a multiply by its reciprocal, which
    # rounds differently from the kernel's (and the CPU's) correctly rounded division
    scale_inv = amax / torch.full_like(amax, FP8_MAX)
    scale = _expand_blocks(scale_inv, block, n, k)
    scaled = torch.where(scale > 0, w32 / torch.where(scale > 0, scale, 1.0), 0.0)
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale_inv


def dequantize_block_fp8(w_fp8: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = WEIGHT_BLOCK,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """w_fp8 * scale_inv per block (in fp32), as `dtype`."""
    n, k = w_fp8.shape[-2:]
    expected = (*w_fp8.shape[:-2], triton.cdiv(n, block[0]), triton.cdiv(k, block[1]))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"scale_inv {tuple(scale_inv.shape)} does not fit weight {tuple(w_fp8.shape)} in blocks of "
                         f"{block}: expected {expected}")
    return (w_fp8.float() * _expand_blocks(scale_inv.float(), block, n, k)).to(dtype)


def empty_groups_fp8(rows: int, cols: int, group: int, scale_m_major: bool, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(q fp8 [rows, cols], scale fp32 [rows, ceil(cols / group)]) to be filled: what quantize_groups_fp8 returns,
    for a kernel that writes the quantized copy of its own output. `scale_m_major`: the scale's rows adjacent
    (strides (1, rows)), the layout cuBLAS's blockwise scales take."""
    groups = triton.cdiv(cols, group)
    scale = (torch.empty(groups, rows, dtype=torch.float32, device=device).t() if scale_m_major
             else torch.empty(rows, groups, dtype=torch.float32, device=device))
    return torch.empty(rows, cols, dtype=FP8_DTYPE, device=device), scale


def quantize_groups_fp8_ref(x: torch.Tensor, group: int = ACT_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token-group activation quantization in plain torch: x [M, K] -> (q [M, K] fp8, scale [M, ceil(K/group)]
    fp32), scale = amax / 448 per (row, group). The twin of `quantize_groups_fp8`."""
    return quantize_block_fp8(x, (1, group))


def silu_mul_quant_fp8_ref(gu: torch.Tensor, group: int = ACT_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """h = silu(gate) * up in fp32 from gu [M, 2I] = [gate | up], rounded to gu's dtype, quantized per (row,
    group). Twin of `silu_mul_quant_fp8`."""
    inter = gu.shape[1] // 2
    g, u = gu[:, :inter].float(), gu[:, inter:].float()
    return quantize_groups_fp8_ref((F.silu(g) * u).to(gu.dtype), group)


# ---------------------------------------------------------------------------------------------
# Triton


@triton.jit
def rne_e4m3(v):
    """v (fp32, |v| <= 448) rounded to the nearest e4m3 value, ties to even, still fp32: the cast to fp8 after it
    is exact whatever rounding the cast itself does. The ulp of v's binade (2^-9 below the normal range, 2^-6)
    is a power of two, so v / ulp is exact and adding and subtracting 1.5 * 2^23 rounds it to an integer."""
    a = tl.abs(v)
    exp = tl.maximum((a.to(tl.int32, bitcast=True) >> 23) & 0xFF, 127 - 6)  # biased exponent of the binade
    ulp = ((exp - 3) << 23).to(tl.float32, bitcast=True)
    inv_ulp = ((254 - (exp - 3)) << 23).to(tl.float32, bitcast=True)
    r = ((a * inv_ulp + 12582912.0) - 12582912.0) * ulp
    # v's sign bit put back by bits: a negative v that rounds to zero stays -0 as torch's cast keeps it (on the GPU
    # `-r` of a zero came out +0)
    sign = (v.to(tl.int32, bitcast=True) >> 31) << 31
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def quantize_tile_fp8(v, FP8_MAX: tl.constexpr):
    """v [ROWS, COLS] fp32, each row one whole scale group -> (e4m3 tile, scale [ROWS] = amax / FP8_MAX)."""
    amax = tl.max(tl.abs(v), 1)
    scale = tl.math.div_rn(amax, tl.full(amax.shape, FP8_MAX, tl.float32))  # correctly rounded, as torch divides
    safe = tl.where(scale > 0, scale, 1.0)
    scaled = tl.math.div_rn(v, safe[:, None])  # (Triton's `/` on the GPU may be the approximate division)
    scaled = tl.minimum(tl.maximum(scaled, -FP8_MAX), FP8_MAX)
    scaled = tl.where(scale[:, None] > 0, scaled, 0.0)
    return rne_e4m3(scaled).to(tl.float8e4nv), scale


@triton.jit
def _scale_columns(b_scale, B_SCALAR: tl.constexpr):
    """The weight scale as it multiplies a [rows, BLOCK_N] tile: one scalar (B_SCALAR), or a row of column scales."""
    if B_SCALAR:
        return b_scale
    else:
        return b_scale[None, :]


@triton.jit
def fp8_scaled_dot(acc, a, b, a_scale, b_scale, ACT_FP8: tl.constexpr, SCALE_PRODUCT: tl.constexpr = False,
                   B_SCALAR: tl.constexpr = False):
    """acc + a @ dequant(b) for one K step that lies inside one scale group along K. b: fp8 [BK, BN] with its
    per-column scale_inv b_scale [BN], or (B_SCALAR: the tile lies inside one scale block along N) one scale_inv
    for all its columns — the same products, without a [BN] vector to spread across the accumulator's layout
    (a shared-memory round trip and a barrier per K step) or a multiply per element.
    ACT_FP8 (W8A8): a fp8 [BM, BK] with per-row scale a_scale [BM]; the fp8 product (fp32 accumulate) is scaled
    by a_scale x b_scale.
    Weight-only (a in bf16 / fp16 / fp32; a_scale unused): SCALE_PRODUCT off dequantizes the B tile (its fp8
    values times the scale, rounded once to a's dtype) and accumulates in the dot; on, the dot takes the fp8
    values themselves (exact in a's dtype) and its [BM, BN] product is scaled in fp32 before it is added: BM x BN
    multiplies per step instead of BK x BN and no weight rounding, for a second accumulator's registers."""
    if ACT_FP8:
        return acc + tl.dot(a, b) * (a_scale[:, None] * _scale_columns(b_scale, B_SCALAR))
    elif SCALE_PRODUCT:
        return acc + tl.dot(a, b.to(a.dtype)) * _scale_columns(b_scale, B_SCALAR)
    else:
        return tl.dot(a, (b.to(tl.float32) * _scale_columns(b_scale, B_SCALAR)).to(a.dtype), acc)


@triton.jit(do_not_specialize=["num_rows"])  # sizes that vary by step: one compile
def _quantize_groups_kernel(
    x_ptr, q_ptr, scale_ptr, h_ptr, K, num_rows, stride_x, stride_q, stride_s, stride_sg, stride_h,
    GROUP: tl.constexpr, ROWS: tl.constexpr, SILU_MUL: tl.constexpr, FP8_MAX: tl.constexpr, USE_PDL: tl.constexpr,
    WRITE_H: tl.constexpr = False,
):
    """One program per (ROWS rows, one group of GROUP columns). SILU_MUL: the quantized value is silu(x[:, c]) *
    x[:, K + c] (x = [gate | up]), computed in fp32 and rounded to x's dtype; WRITE_H: that rounded value also
    stored to h_ptr (x's dtype)."""
    pdl_launch.enter(USE_PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < num_rows
    cols = tl.program_id(1) * GROUP + tl.arange(0, GROUP)
    ok = row_ok[:, None] & (cols < K)[None, :]
    ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_x + cols[None, :]
    v = tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)
    if SILU_MUL:  # h rounded to gu's dtype first, as the WRITE_H copy holds it (see silu_mul_quant_fp8)
        up = tl.load(ptrs + K, mask=ok, other=0.0).to(tl.float32)
        h = silu_mul(v, up).to(x_ptr.dtype.element_ty)
        if WRITE_H:
            tl.store(h_ptr + rows.to(tl.int64)[:, None] * stride_h + cols[None, :], h, mask=ok)
        v = h.to(tl.float32)
    q, scale = quantize_tile_fp8(v, FP8_MAX)
    tl.store(q_ptr + rows.to(tl.int64)[:, None] * stride_q + cols[None, :], q, mask=ok)
    tl.store(scale_ptr + rows.to(tl.int64) * stride_s + tl.program_id(1) * stride_sg, scale, mask=row_ok)


def _quantize_groups(x: torch.Tensor, k: int, group: int, silu_mul: bool, pdl: bool, h: torch.Tensor | None = None,
                     scale_m_major: bool = False):
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"expected a 2-D row-major activation, got {tuple(x.shape)} strides {x.stride()}")
    if group & (group - 1):
        raise ValueError(f"group {group} is not a power of two")
    m = x.shape[0]
    q, scale = empty_groups_fp8(m, k, group, scale_m_major, x.device)
    if m == 0:
        return q, scale
    rows = max(1, min(16, 2048 // group))
    _quantize_groups_kernel[(triton.cdiv(m, rows), scale.shape[1])](
        x, q, scale, q if h is None else h, k, m, x.stride(0), q.stride(0), scale.stride(0), scale.stride(1),
        0 if h is None else h.stride(0),
        GROUP=group, ROWS=rows, SILU_MUL=silu_mul, FP8_MAX=FP8_MAX, USE_PDL=pdl, WRITE_H=h is not None,
        launch_pdl=pdl, num_warps=4)
    return q, scale


def quantize_groups_fp8(x: torch.Tensor, group: int = ACT_GROUP, pdl: bool = False, scale_m_major: bool = False):
    """Dynamic per-token-group quantization: x [M, K] -> (q [M, K] fp8, scale [M, ceil(K/group)] fp32), scale =
    amax / 448 per (row, group of `group` columns). Bitwise `quantize_groups_fp8_ref`. `scale_m_major`: the scale
    stored with its rows adjacent (strides (1, M)), as torch._scaled_mm's blockwise scales want it, instead of copied
    into that layout by another launch."""
    return _quantize_groups(x, x.shape[-1], group, silu_mul=False, pdl=pdl, scale_m_major=scale_m_major)


def silu_mul_quant_fp8(gu: torch.Tensor, group: int = ACT_GROUP, pdl: bool = False, with_h: bool = False):
    """gu [M, 2I] = [gate | up] -> h = silu(gate) * up (in fp32, rounded to gu's dtype) quantized per (row, group):
    (q [M, I] fp8, scale [M, ceil(I/group)]). The down GEMM's A operand of the W8A8 MoE. h is rounded to gu's
    dtype before it is quantized, as fused_moe.silu_mul_rows stores it, so `with_h` below is exactly the h that
    was quantized. Bitwise `silu_mul_quant_fp8_ref` up to
    the exp of silu (Triton's and torch's may differ in the last fp32 bit; that can move a value across a
    rounding boundary, rarely). `with_h`: also h itself in gu's dtype, the exact values quantized -> (q, scale,
    h): what a LoRA shrink of h reads (it must never read the fp8 copy)."""
    if gu.shape[-1] % 2:
        raise ValueError(f"gate_up activation has an odd width {gu.shape[-1]}")
    inter = gu.shape[-1] // 2
    if not with_h:
        return _quantize_groups(gu, inter, group, silu_mul=True, pdl=pdl)
    h = torch.empty(gu.shape[0], inter, dtype=gu.dtype, device=gu.device)
    return (*_quantize_groups(gu, inter, group, silu_mul=True, pdl=pdl, h=h), h)
