"""MoE routing in one launch: softmax over the experts, top-k, optional renormalisation, cast.

    probs = softmax(logits in fp32);  ids = top-k experts;  w = probs[ids] (/ sum(probs[ids]))

Two kernels:
- `fused_topk(logits, ...)`: routing of logits computed elsewhere (the router GEMM at large T,
  or a LoRA-carrying router's output). One program per BLOCK_T rows.
- `fused_gemm_topk(x, weight, ...)`: the router GEMM too, for decode sizes. At T=1 the GEMM is a
  512 KB read (Qwen3-30B-A3B); one program cannot stream that at bandwidth, so the E logits of a
  row are spread over E / BLOCK_E programs. Each stores its logits in an fp32 scratch row and
  bumps the row's arrival counter; the last program to arrive routes the row and resets the
  counter to 0, so the counters are zero again for the next launch or graph replay. An optional
  `logits_delta` (a router LoRA's delta, computed before) is added before softmax.

All families we serve (qwen3_moe, qwen2_moe, olmoe, mixtral) score with softmax; they differ
only in renormalisation (`norm_topk_prob`; mixtral always) and in the dtype of the weights
(mixtral keeps fp32).

Ties: torch.topk makes no promise about which of equal values comes first (on CPU the order
among ties is arbitrary, e.g. neither lowest nor highest index). These kernels pin one rule:
among equal logits the lowest expert index is taken first. Selection runs on the logits (softmax
is monotone, and distinct logits cannot collapse into equal probabilities by rounding).

Selection: each pick is one max over int64 keys (the logit's bits in float order, then the column
reversed), so the routing tail of a row is TOP_K reductions, not 3 x TOP_K. -inf logits are taken
after every finite one (lowest index first, weight 0); padding columns never. NaN logits are never
taken (NaN gets the lowest key; the three-reduction selection's max skipped NaN); a row with NaN has
NaN weights (its softmax denominator is NaN), and picks beyond its non-NaN logits get id NO_EXPERT
with weight 0 before renormalisation (so does a row of NaN). The previous three-reduction selection
(`packed_topk=False`, kept for the bench) gives the same bits whenever its picks are distinct; once
a row's finite logits ran out it took an already picked expert again, with its weight.

The logits are rounded to x's dtype before softmax in `fused_gemm_topk`, as the plain
`F.linear` router would produce them, so both paths route the same.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moeserve.kernels import pdl as pdl_launch

# Decode sizes at or below this run the router GEMM inside the routing kernel (H200 starting point;
# `python -m benchmarks.kernels.kernels --parts router` times both sides).
GEMM_TOPK_MAX_TOKENS = 8  # H200: above 8 rows the cuBLAS GEMM + fused_topk is faster (same benchmark)


@dataclass(frozen=True)
class RouterTile:
    block_t: int = 1  # rows per program
    block_e: int = 8  # experts per program (fused GEMM only); E / block_e programs share a row
    block_h: int = 256  # hidden columns per GEMM step
    num_warps: int = 4


def default_tile(num_tokens: int) -> RouterTile:
    """One row per program, E spread thin (2 experts per program) and H in one step, so many loads are in flight
    at once: the GEMV is latency-bound at these sizes. Measured on the H200 (`python -m benchmarks.kernels.kernels
    --parts router`): 7.2 us at T=1 and 8.2 us at T=8 against 8.7-8.9 us for the linear layer + fused_topk; more
    rows per program did not pay up to T=8, and the fused GEMM is used only up to GEMM_TOPK_MAX_TOKENS."""
    if num_tokens <= 16:
        return RouterTile(block_t=1, block_e=2, block_h=2048, num_warps=4)
    return RouterTile(block_t=4, block_e=8, block_h=512, num_warps=8)


def counter_slots(max_tokens: int) -> int:
    """Arrival counters `fused_gemm_topk` needs for up to `max_tokens` rows under any tile (one per row block)."""
    return max_tokens


NO_EXPERT = 1 << 30  # the id of a pick with no selectable column left (rows with NaN logits only)
_NO_EXPERT: tl.constexpr = tl.constexpr(NO_EXPERT)
_NO_KEY: tl.constexpr = tl.constexpr(-(2**63))  # below every key of a selectable column; decodes to _NO_EXPERT


@triton.jit
def _selection_keys(logits, cols, selectable):
    """int64 keys ordered as (logit ascending, column descending): the largest key is the best logit at the lowest
    column holding it. High 32 bits: the fp32 bits mapped to a signed int in the order of the floats (negative
    floats get their magnitude bits flipped); low 32 bits: _NO_EXPERT - column. Columns not `selectable` get
    _NO_KEY."""
    logits = tl.where(logits == 0.0, 0.0, logits)  # -0.0 and +0.0 are equal logits: one key
    bits = logits.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    lows = -cols + _NO_EXPERT  # _NO_EXPERT - column (the interpreter wants the tensor on the left)
    keys = (ordered.to(tl.int64) << 32) | lows.to(tl.int64)[None, :]
    return tl.where(selectable, keys, _NO_KEY)


@triton.jit
def _decode_key(key):
    """(column, logit) of a key of `_selection_keys`; _NO_KEY gives column _NO_EXPERT (and a NaN logit)."""
    col = -key.to(tl.int32) + _NO_EXPERT  # the cast keeps the low 32 bits
    ordered = (key >> 32).to(tl.int32)
    logit = (ordered ^ ((ordered >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
    return col, logit


@triton.jit
def _softmax_topk_store(logits, rows, row_ok, cols, col_ok, w_ptr, ids_ptr,
                        TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                        PACKED_TOPK: tl.constexpr):
    """Route a [BLOCK_T, BLOCK_E] fp32 tile of logits; store the weights and int32 ids of its rows.

    PACKED_TOPK: one max over int64 keys per pick (`_selection_keys`); the pick's weight is computed from its
    logit with the operations that make `probs` below, so it is bitwise probs[pick]. Otherwise the previous
    selection: three reductions per pick (best logit, lowest column holding it, its probability); kept for
    `benchmarks.kernels.kernels --parts router`."""
    logits = tl.where(col_ok[None, :], logits, float("-inf"))
    row_max = tl.max(logits, 1)
    p = tl.exp(logits - row_max[:, None])
    denom = tl.sum(p, 1)
    ks = tl.arange(0, BLOCK_K)
    top_w = tl.zeros((logits.shape[0], BLOCK_K), dtype=tl.float32)
    top_i = tl.zeros((logits.shape[0], BLOCK_K), dtype=tl.int32)
    if PACKED_TOPK:
        # NaN logits and the padding columns are never selected; a picked column's key drops below all others
        keys = _selection_keys(logits, cols, col_ok[None, :] & (logits == logits))
        for k in tl.static_range(TOP_K):
            best_key = tl.max(keys, 1)
            pick, best = _decode_key(best_key)
            w = tl.where(pick == _NO_EXPERT, 0.0, tl.exp(best - row_max) / denom)
            top_w = tl.where(ks[None, :] == k, w[:, None], top_w)
            top_i = tl.where(ks[None, :] == k, pick[:, None], top_i)
            keys = tl.where(keys == best_key[:, None], _NO_KEY, keys)
    else:
        probs = p / denom[:, None]
        remaining = logits
        for k in tl.static_range(TOP_K):
            best = tl.max(remaining, 1)
            # the lowest index among the experts holding the best logit
            pick = tl.min(tl.where(remaining == best[:, None], cols[None, :], _NO_EXPERT), 1)
            hit = cols[None, :] == pick[:, None]
            w = tl.sum(tl.where(hit, probs, 0.0), 1)
            top_w = tl.where(ks[None, :] == k, w[:, None], top_w)
            top_i = tl.where(ks[None, :] == k, pick[:, None], top_i)
            remaining = tl.where(hit, float("-inf"), remaining)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, 1)[:, None]
    out = rows[:, None] * TOP_K + ks[None, :]
    mask = row_ok[:, None] & (ks < TOP_K)[None, :]
    tl.store(w_ptr + out, top_w.to(w_ptr.dtype.element_ty), mask=mask)
    tl.store(ids_ptr + out, top_i, mask=mask)


@triton.jit
def _topk_kernel(logits_ptr, w_ptr, ids_ptr, T, E, stride_l,
                 TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                 RENORMALIZE: tl.constexpr, PACKED_TOPK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_launch.enter(USE_PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok, col_ok = rows < T, cols < E
    logits = tl.load(logits_ptr + rows.to(tl.int64)[:, None] * stride_l + cols[None, :],
                     mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    _softmax_topk_store(logits, rows, row_ok, cols, col_ok, w_ptr, ids_ptr, TOP_K, BLOCK_K, RENORMALIZE,
                        PACKED_TOPK)


@triton.jit
def _gemm_topk_kernel(x_ptr, weight_ptr, delta_ptr, scratch_ptr, counters_ptr, w_ptr, ids_ptr,
                      T, E, H, stride_x, stride_w, stride_d,
                      TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                      BLOCK_H: tl.constexpr, BLOCK_E_ALL: tl.constexpr, NUM_E_BLOCKS: tl.constexpr,
                      HAS_DELTA: tl.constexpr, RENORMALIZE: tl.constexpr, PACKED_TOPK: tl.constexpr,
                      USE_PDL: tl.constexpr):
    pdl_launch.enter(USE_PDL)
    pid_t = tl.program_id(0)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    row_ok, expert_ok = rows < T, experts < E
    rows64 = rows.to(tl.int64)
    acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        hs = h0 + tl.arange(0, BLOCK_H)
        h_ok = hs < H
        xs = tl.load(x_ptr + rows64[:, None] * stride_x + hs[None, :],
                     mask=row_ok[:, None] & h_ok[None, :], other=0.0).to(tl.float32)
        ws = tl.load(weight_ptr + experts.to(tl.int64)[:, None] * stride_w + hs[None, :],
                     mask=expert_ok[:, None] & h_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(xs[:, None, :] * ws[None, :, :], 2)
    # the logits as the router's linear layer returns them: in x's dtype (+ the LoRA delta, rounded again)
    logits = acc.to(x_ptr.dtype.element_ty)
    if HAS_DELTA:
        delta = tl.load(delta_ptr + rows64[:, None] * stride_d + experts[None, :],
                        mask=row_ok[:, None] & expert_ok[None, :], other=0.0)
        logits = (logits.to(tl.float32) + delta.to(tl.float32)).to(x_ptr.dtype.element_ty)
    logits = logits.to(tl.float32)
    if NUM_E_BLOCKS == 1:
        _softmax_topk_store(logits, rows, row_ok, experts, expert_ok, w_ptr, ids_ptr, TOP_K, BLOCK_K, RENORMALIZE,
                            PACKED_TOPK)
    else:
        tl.store(scratch_ptr + rows64[:, None] * E + experts[None, :], logits,
                 mask=row_ok[:, None] & expert_ok[None, :])
        tl.debug_barrier()  # every thread's scratch stores precede the release below
        arrived = tl.atomic_add(counters_ptr + pid_t, 1, sem="acq_rel")
        if arrived == NUM_E_BLOCKS - 1:  # the last program of these rows routes them
            tl.debug_barrier()
            cols = tl.arange(0, BLOCK_E_ALL)
            col_ok = cols < E
            full = tl.load(scratch_ptr + rows64[:, None] * E + cols[None, :],
                           mask=row_ok[:, None] & col_ok[None, :], other=0.0, cache_modifier=".cg")
            _softmax_topk_store(full, rows, row_ok, cols, col_ok, w_ptr, ids_ptr, TOP_K, BLOCK_K, RENORMALIZE,
                                PACKED_TOPK)
            tl.atomic_xchg(counters_ptr + pid_t, 0)


def _check(num_experts: int, top_k: int) -> None:
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")


def _outputs(num_tokens: int, top_k: int, out_dtype, device):
    return (torch.empty(num_tokens, top_k, dtype=out_dtype, device=device),
            torch.empty(num_tokens, top_k, dtype=torch.int32, device=device))


def fused_topk(logits: torch.Tensor, top_k: int, renormalize: bool, out_dtype: torch.dtype,
               block_t: int = 1, num_warps: int = 1, packed_topk: bool = True,
               pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, top_k] out_dtype, ids [T, top_k] int32), best first; `block_t` rows per
    program. `packed_topk=False`: the previous three-reduction selection, same result (for the bench)."""
    num_tokens, num_experts = logits.shape
    _check(num_experts, top_k)
    weights, ids = _outputs(num_tokens, top_k, out_dtype, logits.device)
    if num_tokens == 0:
        return weights, ids
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    _topk_kernel[(triton.cdiv(num_tokens, block_t),)](
        logits, weights, ids, num_tokens, num_experts, logits.stride(0),
        TOP_K=top_k, BLOCK_K=triton.next_power_of_2(top_k), BLOCK_T=block_t,
        BLOCK_E=triton.next_power_of_2(num_experts), RENORMALIZE=renormalize, PACKED_TOPK=packed_topk,
        USE_PDL=pdl, launch_pdl=pdl,
        num_warps=num_warps)
    return weights, ids


def fused_gemm_topk(x: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool,
                    out_dtype: torch.dtype, logits_delta: torch.Tensor | None = None,
                    counters: torch.Tensor | None = None,
                    tile: RouterTile | None = None, packed_topk: bool = True,
                    pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] . weight [E, H]^T (+ logits_delta [T, E]) routed as `fused_topk`, in one launch.

    `counters`: int32 zeros, at least `counter_slots(T)` of them, owned by the caller and
    left zero after every launch (allocated here when None, which costs a memset). `tile`: by T when None.
    `packed_topk` as in `fused_topk`."""
    num_tokens, hidden = x.shape
    num_experts = weight.shape[0]
    _check(num_experts, top_k)
    if weight.shape[1] != hidden:
        raise ValueError(f"router weight {tuple(weight.shape)} does not match x {tuple(x.shape)}")
    if logits_delta is not None and logits_delta.shape != (num_tokens, num_experts):
        raise ValueError(f"logits_delta {tuple(logits_delta.shape)} is not [{num_tokens}, {num_experts}]")
    weights, ids = _outputs(num_tokens, top_k, out_dtype, x.device)
    if num_tokens == 0:
        return weights, ids
    x, weight = x.contiguous(), weight.contiguous()
    tile = tile or default_tile(num_tokens)
    row_blocks = triton.cdiv(num_tokens, tile.block_t)
    num_e_blocks = triton.cdiv(num_experts, tile.block_e)
    if num_e_blocks > 1:
        scratch = torch.empty(num_tokens, num_experts, dtype=torch.float32, device=x.device)
        if counters is None:
            counters = torch.zeros(row_blocks, dtype=torch.int32, device=x.device)
        if counters.dtype != torch.int32 or counters.numel() < row_blocks:
            raise ValueError(f"counters: need >= {row_blocks} int32, got {counters.numel()} {counters.dtype}")
    else:
        scratch = counters = weights  # unused
    delta = logits_delta if logits_delta is not None else x  # placeholder when absent
    if delta.stride(-1) != 1:
        delta = delta.contiguous()
    _gemm_topk_kernel[(row_blocks, num_e_blocks)](
        x, weight, delta, scratch, counters, weights, ids,
        num_tokens, num_experts, hidden, x.stride(0), weight.stride(0), delta.stride(0),
        TOP_K=top_k, BLOCK_K=triton.next_power_of_2(top_k), BLOCK_T=tile.block_t, BLOCK_E=tile.block_e,
        BLOCK_H=tile.block_h, BLOCK_E_ALL=triton.next_power_of_2(num_experts), NUM_E_BLOCKS=num_e_blocks,
        HAS_DELTA=logits_delta is not None, RENORMALIZE=renormalize, PACKED_TOPK=packed_topk,
        USE_PDL=pdl, launch_pdl=pdl,
        num_warps=tile.num_warps)
    return weights, ids


# ---------------------------------------------------------------------------------------------
# reference


def fused_topk_ref(logits: torch.Tensor, top_k: int, renormalize: bool,
                   out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain-torch routing (HF's): fp32 softmax, torch.topk, renormalise, cast. Ids int64."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(out_dtype), ids
