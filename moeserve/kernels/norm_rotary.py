"""Fused norms and attention prologue: one launch per region where torch runs 8–28 small kernels.

- `rms_norm` / `fused_add_rms_norm`: RMSNorm of a row (HF convention: fp32 normalisation, cast back,
  then times the weight), optionally after the residual add; one program per row.
- `qk_norm_rotary_write_kv`: splits the fused qkv projection output, applies the q/k RMSNorm (per head
  or over all heads of a token), clip_qkv, rotary (rotate-half) and writes K and V into the paged cache
  at the slot mapping; returns q [T, nh, d]. Grid (T, q head groups + 1): the last program of a token
  does its K and V heads. An fp8 cache (kernels/kv_fp8.py) gets K / k_scale and V / v_scale, clamped to ±448
  and rounded to nearest even: bitwise `quantize_kv` of the activation-dtype values.

Every rounding point of the torch code is reproduced: values are computed in fp32 and rounded to the
activation dtype wherever torch would hold an intermediate in it (the residual sum, the normalised row
before the weight multiply, each product and sum of rotary, the cos/sin table). The plain-torch twins
below spell out the same math; the layers' own torch code is the independent reference.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.kernels import pdl as pdl_launch
from moeserve.kernels.fp8 import FP8_MAX, empty_groups_fp8, quantize_tile_fp8, rne_e4m3
from moeserve.kernels.kv_fp8 import KV_FP8_DTYPE, KV_FP8_MAX, write_kv_slots

NORM_MODES = {"none": 0, "head": 1, "full": 2}


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    """Round an fp32 value to the activation dtype and back (where torch stores an intermediate)."""
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, q_ptr, scale_ptr, x_stride, res_stride, n_cols, eps,
                     stride_sr, stride_sg,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
                     QUANT_GROUP: tl.constexpr = 0, FP8_LIMIT: tl.constexpr = 448.0):
    """One row: out = w * rmsnorm(x (+ residual)); QUANT_GROUP: also out quantized per group of QUANT_GROUP columns
    (q fp8 [T, n_cols], scale [T, groups] at strides (stride_sr, stride_sg)), from the rounded out itself: bitwise
    fp8.quantize_groups_fp8(out)."""
    pdl_launch.enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    act = x_ptr.dtype.element_ty  # the activation dtype
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0).to(tl.float32)
        x = _round(x + r, act)  # the sum torch holds in the activation dtype
        tl.store(res_out_ptr + row * n_cols + cols, x.to(act), mask=mask)
    var = tl.sum(x * x, axis=0) / n_cols
    h = _round(x * tl.rsqrt(var + eps), act)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (w * h).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * n_cols + cols, y, mask=mask)
    if QUANT_GROUP > 0:  # masked columns are 0: a partial last group's amax is its columns' own
        groups = tl.reshape(y.to(tl.float32), (BLOCK // QUANT_GROUP, QUANT_GROUP))
        q, scale = quantize_tile_fp8(groups, FP8_LIMIT)
        g = tl.arange(0, BLOCK // QUANT_GROUP)
        q_cols = g[:, None] * QUANT_GROUP + tl.arange(0, QUANT_GROUP)[None, :]
        tl.store(q_ptr + row * n_cols + q_cols, q, mask=q_cols < n_cols)
        tl.store(scale_ptr + row * stride_sr + g * stride_sg, scale, mask=g < tl.cdiv(n_cols, QUANT_GROUP))


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _launch_norm(x, residual, weight, eps, num_warps, pdl, quant_group=0, scale_m_major=False):
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1] or not weight.is_contiguous():
        raise ValueError(f"norm weight {tuple(weight.shape)} is not a contiguous [{x.shape[-1]}] (x's last dim)")
    rows = _rows(x)
    T, N = rows.shape
    block = triton.next_power_of_2(N)
    if quant_group & (quant_group - 1):
        raise ValueError(f"quant_group {quant_group} must be a power of two")
    out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    res = rows if residual is None else _rows(residual)
    res_out = out if residual is None else torch.empty_like(rows)  # without a residual: never written
    quant = empty_groups_fp8(T, N, quant_group, scale_m_major, x.device) if quant_group else None
    if T > 0:
        q, scale = quant if quant is not None else (out, out)  # unread placeholders
        _rms_norm_kernel[(T,)](rows, res, weight, out, res_out, q, scale, rows.stride(0), res.stride(0), N, eps,
                               scale.stride(0) if quant else 0, scale.stride(1) if quant else 0,
                               HAS_RESIDUAL=residual is not None, BLOCK=block, USE_PDL=pdl,
                               # a group wider than the row's block holds the whole row: one group, one tile
                               QUANT_GROUP=min(quant_group, block), FP8_LIMIT=FP8_MAX, num_warps=num_warps,
                               launch_pdl=pdl)
    return out.view(x.shape), res_out.view(x.shape), quant


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, num_warps: int = 4,
             pdl: bool = False) -> torch.Tensor:
    """weight * rmsnorm(x) over the last dim (fp32 math, normalised row cast to x.dtype first). `pdl`: launch
    with programmatic dependent launch (kernels/pdl.py)."""
    return _launch_norm(x, None, weight, eps, num_warps, pdl)[0]


def rms_norm_fp8(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, group: int,
                 scale_m_major: bool = False, num_warps: int = 4, pdl: bool = False):
    """rms_norm's normed rows (with a residual: fused_add_rms_norm's (normed, sum)), and the normed rows quantized
    per group of `group` columns as the W8A8 kernels read them, (q fp8 [T, N], scale [T, ceil(N / group)], its
    rows adjacent where `scale_m_major`, as cuBLAS's blockwise scales want), bitwise
    fp8.quantize_groups_fp8(normed, group, scale_m_major=...), without a launch of its own. Returns (normed,
    sum or None, (q, scale))."""
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not match x "
                         f"{tuple(x.shape)} {x.dtype}")
    normed, summed, quant = _launch_norm(x, residual, weight, eps, num_warps, pdl, group, scale_m_major)
    return normed, summed if residual is not None else None, quant


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       num_warps: int = 4, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), the sum rounded to x.dtype as torch's add does."""
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not match x "
                         f"{tuple(x.shape)} {x.dtype}")
    return _launch_norm(x, residual, weight, eps, num_warps, pdl)[:2]


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def fused_add_rms_norm_ref(x, residual, weight, eps):
    s = x + residual
    return rms_norm_ref(s, weight, eps), s


@triton.jit
def _quantize_kv(x, scale, FP8_MAX: tl.constexpr):
    """fp32 values -> e4m3: x / scale (correctly rounded, as torch divides), clamped to the finite range (e4m3fn has
    no infinity), rounded to nearest even on the grid first so that the cast is exact (kernels/fp8.py rne_e4m3)."""
    x = tl.math.div_rn(x, tl.full(x.shape, scale, tl.float32))
    x = tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX)
    return rne_e4m3(x).to(tl.float8e4nv)


@triton.jit
def _norm_rotate_heads(src, w_ptr, head0, cos1, sin1, cos2, sin2, eps, clip,
                       NHEADS: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                       NORM: tl.constexpr, CLIP: tl.constexpr, ACT: tl.constexpr):
    """Heads head0 .. head0+BLOCK_H of one token (q or k) -> (first halves, second halves, offsets, mask),
    normed, clipped and rotated, in fp32 holding activation-dtype values."""
    heads = head0 + tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < NHEADS) & (cols < HALF)
    offs = heads * D + cols
    x1 = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + offs + HALF, mask=mask, other=0.0).to(tl.float32)
    if NORM == 2:  # one RMSNorm over all heads of the token (the caller gives this program every head)
        var = (tl.sum(tl.sum(x1 * x1, axis=1), axis=0) + tl.sum(tl.sum(x2 * x2, axis=1), axis=0)) / (NHEADS * D)
        r = tl.rsqrt(var + eps)
        w1 = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + offs + HALF, mask=mask, other=0.0).to(tl.float32)
        x1 = _round(w1 * _round(x1 * r, ACT), ACT)
        x2 = _round(w2 * _round(x2 * r, ACT), ACT)
    if CLIP:
        x1 = tl.minimum(tl.maximum(x1, -clip), clip)
        x2 = tl.minimum(tl.maximum(x2, -clip), clip)
    if NORM == 1:  # RMSNorm over each head's D values
        var = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D
        r = tl.rsqrt(var + eps)[:, None]
        w1 = tl.load(w_ptr + cols, mask=cols < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + cols, mask=cols < HALF, other=0.0).to(tl.float32)
        x1 = _round(w1 * _round(x1 * r, ACT), ACT)
        x2 = _round(w2 * _round(x2 * r, ACT), ACT)
    # rotate-half: [x1, x2] * cos + [-x2, x1] * sin, each product and the sum rounded as in torch
    o1 = _round(_round(x1 * cos1, ACT) - _round(x2 * sin1, ACT), ACT)
    o2 = _round(_round(x2 * cos2, ACT) + _round(x1 * sin2, ACT), ACT)
    return o1, o2, offs, mask


@triton.jit
def _qk_norm_rotary_kv_kernel(qkv_ptr, qkv_stride, pos_ptr, cos_ptr, sin_ptr, cos_stride, qw_ptr, kw_ptr,
                              q_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, eps, clip, k_scale, v_scale,
                              NH: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                              BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr,
                              NORM: tl.constexpr, CLIP: tl.constexpr, KV_FP8: tl.constexpr, FP8_MAX: tl.constexpr,
                              USE_PDL: tl.constexpr):
    pdl_launch.enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    act = q_ptr.dtype.element_ty
    row = qkv_ptr + t * qkv_stride
    pos = tl.load(pos_ptr + t)
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    cmask = cols < HALF
    # the table rounded to the activation dtype, as torch casts it before multiplying
    cos1 = _round(tl.load(cos_ptr + pos * cos_stride + cols, mask=cmask, other=0.0).to(tl.float32), act)
    cos2 = _round(tl.load(cos_ptr + pos * cos_stride + HALF + cols, mask=cmask, other=0.0).to(tl.float32), act)
    sin1 = _round(tl.load(sin_ptr + pos * cos_stride + cols, mask=cmask, other=0.0).to(tl.float32), act)
    sin2 = _round(tl.load(sin_ptr + pos * cos_stride + HALF + cols, mask=cmask, other=0.0).to(tl.float32), act)
    num_q_groups = tl.cdiv(NH, BLOCK_QH)
    # the two branches name their tiles apart: Triton merges a name assigned in both, and q and k tiles differ
    if group < num_q_groups:
        q1, q2, q_offs, q_mask = _norm_rotate_heads(row, qw_ptr, group * BLOCK_QH, cos1, sin1, cos2, sin2, eps, clip,
                                                    NH, D, HALF, BLOCK_QH, BLOCK_HALF, NORM, CLIP, act)
        q_row = q_ptr + t * (NH * D)
        tl.store(q_row + q_offs, q1.to(act), mask=q_mask)
        tl.store(q_row + q_offs + HALF, q2.to(act), mask=q_mask)
    else:  # this token's K (normed, rotated) and V into the cache; padded rows go to the dummy slot
        cache_t = k_cache_ptr.dtype.element_ty
        slot = tl.load(slot_ptr + t).to(tl.int64)
        k1, k2, k_offs, k_mask = _norm_rotate_heads(row + NH * D, kw_ptr, 0, cos1, sin1, cos2, sin2, eps, clip,
                                                    NKV, D, HALF, BLOCK_KH, BLOCK_HALF, NORM, CLIP, act)
        k_row = k_cache_ptr + slot * (NKV * D)
        if KV_FP8:  # k1, k2 hold activation-dtype values already
            tl.store(k_row + k_offs, _quantize_kv(k1, k_scale, FP8_MAX), mask=k_mask)
            tl.store(k_row + k_offs + HALF, _quantize_kv(k2, k_scale, FP8_MAX), mask=k_mask)
        else:
            tl.store(k_row + k_offs, k1.to(act).to(cache_t), mask=k_mask)
            tl.store(k_row + k_offs + HALF, k2.to(act).to(cache_t), mask=k_mask)
        v_src = row + (NH + NKV) * D
        v_row = v_cache_ptr + slot * (NKV * D)
        for half in tl.static_range(2):
            v = tl.load(v_src + k_offs + half * HALF, mask=k_mask, other=0.0)
            if CLIP:
                v = tl.minimum(tl.maximum(v.to(tl.float32), -clip), clip).to(act)
            if KV_FP8:
                tl.store(v_row + k_offs + half * HALF, _quantize_kv(v.to(tl.float32), v_scale, FP8_MAX), mask=k_mask)
            else:
                tl.store(v_row + k_offs + half * HALF, v.to(cache_t), mask=k_mask)


def default_q_heads_per_program(num_tokens: int, num_heads: int) -> int:
    """Small batches split a token's q heads over several programs (more SMs busy), large ones do not."""
    return min(triton.next_power_of_2(num_heads), 8 if num_tokens <= 32 else 64)


def qk_norm_rotary_write_kv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                            num_heads: int, num_kv_heads: int, head_dim: int, qk_norm: str,
                            q_norm_weight: torch.Tensor | None, k_norm_weight: torch.Tensor | None, eps: float,
                            k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                            clip_qkv: float | None = None, q_heads_per_program: int | None = None,
                            num_warps: int = 4, pdl: bool = False, k_scale: float = 1.0,
                            v_scale: float = 1.0) -> torch.Tensor:
    """qkv [T, (nh + 2 nkv) d] -> q [T, nh, d]; K and V land in k_cache/v_cache [blocks, block_size, nkv, d]
    at slot_mapping [T]. cos/sin: the rotary table [max_pos, d] (rotate-half layout, cos[j] == cos[j + d/2]).
    qk_norm "head": weights [d]; "full": weights [nh d] and [nkv d], one norm over a token's heads.
    float8_e4m3fn caches store K / k_scale and V / v_scale (kernels/kv_fp8.py quantize_kv); other caches ignore
    the scales."""
    T = qkv.shape[0]
    nh, nkv, d = num_heads, num_kv_heads, head_dim
    if qkv.shape[1] != (nh + 2 * nkv) * d or qkv.stride(1) != 1:
        raise ValueError(f"qkv {tuple(qkv.shape)} is not [T, {(nh + 2 * nkv) * d}] with contiguous rows")
    if d % 2:
        raise ValueError(f"rotary needs an even head_dim, got {d}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not cache.is_contiguous() or cache.shape[-2:] != (nkv, d):
            raise ValueError(f"{name} {tuple(cache.shape)} is not a contiguous [blocks, block_size, {nkv}, {d}]")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache {k_cache.dtype} and v_cache {v_cache.dtype} differ")
    if qk_norm not in NORM_MODES:
        raise ValueError(f"qk_norm {qk_norm!r} is not one of {sorted(NORM_MODES)}")
    norm = NORM_MODES[qk_norm]
    if norm and (q_norm_weight is None or k_norm_weight is None):
        raise ValueError(f"qk_norm {qk_norm!r} needs q and k norm weights")
    if norm:
        widths = (d, d) if qk_norm == "head" else (nh * d, nkv * d)
        for name, w, n in (("q_norm_weight", q_norm_weight, widths[0]), ("k_norm_weight", k_norm_weight, widths[1])):
            if w.shape != (n,) or not w.is_contiguous():
                raise ValueError(f"{name} {tuple(w.shape)} is not a contiguous [{n}] for qk_norm {qk_norm!r}")
    for name, t in (("positions", positions), ("slot_mapping", slot_mapping)):
        if t.shape != (T,) or (T > 1 and t.stride(0) != 1):
            raise ValueError(f"{name} {tuple(t.shape)} is not a contiguous [{T}] (one per token of qkv)")
    if cos.shape[-1] != d or sin.shape != cos.shape:
        raise ValueError(f"rotary tables cos {tuple(cos.shape)} / sin {tuple(sin.shape)} are not [max_pos, {d}]")
    if q_heads_per_program is not None and q_heads_per_program & (q_heads_per_program - 1):
        raise ValueError(f"q_heads_per_program must be a power of two, got {q_heads_per_program}")
    if clip_qkv is not None:  # torch's clamp bound is the clip value in the activation dtype
        clip_qkv = float(torch.tensor(clip_qkv, dtype=qkv.dtype))
    if cos.stride() != sin.stride() or cos.stride(1) != 1:
        raise ValueError("cos and sin tables must share a row-major layout")
    q = torch.empty(T, nh, d, dtype=qkv.dtype, device=qkv.device)
    if T == 0:
        return q
    block_q = triton.next_power_of_2(nh)
    if norm != NORM_MODES["full"]:  # a full norm needs all of a token's q heads in one program
        block_q = q_heads_per_program or default_q_heads_per_program(T, nh)
    dummy = qkv  # stands for absent norm weights (never read)
    grid = (T, triton.cdiv(nh, block_q) + 1)
    _qk_norm_rotary_kv_kernel[grid](
        qkv, qkv.stride(0), positions, cos, sin, cos.stride(0),
        q_norm_weight if norm else dummy, k_norm_weight if norm else dummy,
        q, k_cache, v_cache, slot_mapping, eps, float(clip_qkv or 0.0), float(k_scale), float(v_scale),
        NH=nh, NKV=nkv, D=d, HALF=d // 2, BLOCK_QH=block_q, BLOCK_KH=triton.next_power_of_2(nkv),
        BLOCK_HALF=triton.next_power_of_2(d // 2), NORM=norm, CLIP=clip_qkv is not None,
        KV_FP8=k_cache.dtype == KV_FP8_DTYPE, FP8_MAX=KV_FP8_MAX, USE_PDL=pdl, num_warps=num_warps, launch_pdl=pdl)
    return q


def qk_norm_rotary_write_kv_ref(qkv, positions, cos, sin, num_heads, num_kv_heads, head_dim, qk_norm,
                                q_norm_weight, k_norm_weight, eps, k_cache, v_cache, slot_mapping,
                                clip_qkv=None, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """The twin of qk_norm_rotary_write_kv in plain torch, same rounding points."""
    T, nh, nkv, d = qkv.shape[0], num_heads, num_kv_heads, head_dim
    q, k, v = qkv.split((nh * d, nkv * d, nkv * d), dim=-1)
    if qk_norm == "full":
        q, k = rms_norm_ref(q, q_norm_weight, eps), rms_norm_ref(k, k_norm_weight, eps)
    if clip_qkv is not None:
        q, k, v = (t.clamp(-clip_qkv, clip_qkv) for t in (q, k, v))
    q, k, v = q.reshape(T, nh, d), k.reshape(T, nkv, d), v.reshape(T, nkv, d)
    if qk_norm == "head":
        q, k = rms_norm_ref(q, q_norm_weight, eps), rms_norm_ref(k, k_norm_weight, eps)
    c = cos[positions].to(qkv.dtype)[:, None, :]
    s = sin[positions].to(qkv.dtype)[:, None, :]

    def rotate(x):
        x1, x2 = x.chunk(2, dim=-1)
        return x * c + torch.cat((-x2, x1), dim=-1) * s

    q, k = rotate(q), rotate(k)
    write_kv_slots(k_cache, slot_mapping, k, k_scale)
    write_kv_slots(v_cache, slot_mapping, v, v_scale)
    return q
