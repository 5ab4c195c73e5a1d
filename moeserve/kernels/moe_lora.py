"""LoRA deltas on routed experts, for many adapters at once (one adapter slot per token).

    dGU = gate_up_b[s, e] @ (gate_up_a[s, e] @ x_t)          added to [pair, 2I] before SiLU*up
    dD  = down_b[s, e] @ (down_a[s, e] @ h)                   times w[t, k], before the top-k sum

Ranks differ per slot inside a pool of max rank R: every kernel reads the slot's rank and
masks rank columns beyond it, so a rank-8 adapter in a rank-64 pool reads 8 columns of
each weight (the decode kernels hold a rank tile of R rounded up to a power of two, >= 16
for tl.dot; the sorted-path ones step 16 rank columns at a time up to the rank).

- decode path: `lora_shrink_pairs` runs one program per ((token, k) pair, K split), each
  writing fp32 partial sums [pairs, splits, R] (short programs: a whole-row shrink per
  program was latency-bound, 12 us per launch at T=1 on H200); the matching expands, which
  add the partials up, are fused into the fused_moe GEMV epilogues.
- sorted path: the LoRA rides on the base alignment (expert blocks of block_m pairs).
  `lora_block_shrink` walks the distinct adapter slots of each expert block (no second
  alignment, no sorting) and writes the block's shrink as fp32 partials split along K; the
  expands run in the base gate_up / down GEMM epilogues (`lora_block_expand`), so gu and y
  are written once (`lora_block_epilogue`). The expand walks the block's (slot, rank step)
  items one at a time, the next item's loads in flight during the current dot, each dot
  accumulating into the GEMM accumulator itself; that is the one way it runs, at every size
  and with up halves alike (the alternatives measured against it are listed, with where their
  code can be found, in moe_plan). (A second, (slot, expert) alignment with separate LoRA
  kernels measured slower or equal on the H200 and was removed after cfefc5c; numbers in
  fused_moe.)

Separate gate and up A's (lora_separate_gate_up): a slot flagged in `gate_up_separate` has its
up rows' own A in `up_a` (same shape as gate_up_a); the gate_up shrinks then also write an up
half of the partials for that slot's rows, and the expands read it for the up columns. The
flag is read per slot in-kernel: a slot with one A shrinks once and never reads up_a, and a
pool without up_a compiles none of it (UP_HALF=False).

Pairs without an adapter (slot -1, rank 0) are skipped inside the kernels: their rows of
the shrink buffers are never written and never read, and their outputs are the no-LoRA
kernels' bitwise (up to the sign of a zero, see lora_block_expand).
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from moeserve.kernels import pdl as pdl_launch
from moeserve.kernels.moe_align import AlignedBlocks


def lora_rank_block(lora) -> int:
    return max(16, triton.next_power_of_2(lora.gate_up_a.shape[2]))


SHRINK_TILE = 8192  # elements of the [rank block, K] tile a shrink program holds in registers


def shrink_block_k(block_r: int) -> int:
    """Reduction columns per shrink step."""
    return max(16, SHRINK_TILE // block_r)


@triton.jit
def silu_mul(gate, up):
    return gate / (1.0 + tl.exp(-gate)) * up


# ---------------------------------------------------------------------------------------------
# decode path


@triton.jit
def _lora_shrink_pairs_kernel(
    src_ptr, a_ptr, out_ptr, topk_ids_ptr, slots_ptr, ranks_ptr, up_a_ptr, separate_ptr,
    num_experts, top_k, K,
    stride_src, stride_al, stride_ae, stride_ar, stride_op, stride_os, stride_oh,
    FROM_GATE_UP: tl.constexpr, UP_HALF: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """out[pair, (half,) split, :rank] = A[slot, expert][:rank, split cols] @ v[split cols],
    v = x[token], or silu(g) * u of gu[pair] (fp32 rows [g | u]). UP_HALF: slots flagged
    separate also write half 1 from up_a (same strides as A)."""
    pdl_launch.enter(USE_PDL)
    pair = tl.program_id(0)
    split = tl.program_id(1)
    token = pair // top_k
    expert = tl.load(topk_ids_ptr + pair).to(tl.int32)
    slot = tl.load(slots_ptr + token).to(tl.int32)
    rank = tl.load(ranks_ptr + tl.maximum(slot, 0))
    if (slot < 0) | (rank <= 0) | (expert < 0) | (expert >= num_experts):
        return
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < rank
    offs_k = split * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = offs_k < K
    if FROM_GATE_UP:
        src = src_ptr + pair.to(tl.int64) * stride_src + offs_k
        gate = tl.load(src, mask=k_ok, other=0.0).to(tl.float32)
        up = tl.load(src + K, mask=k_ok, other=0.0).to(tl.float32)
        v = silu_mul(gate, up)
    else:
        v = tl.load(src_ptr + token.to(tl.int64) * stride_src + offs_k, mask=k_ok,
                    other=0.0).to(tl.float32)
    a_offs = (slot.to(tl.int64) * stride_al + expert.to(tl.int64) * stride_ae
              + offs_r[:, None] * stride_ar + offs_k[None, :])
    a_mask = r_ok[:, None] & k_ok[None, :]
    a = tl.load(a_ptr + a_offs, mask=a_mask, other=0.0)
    part = tl.sum(a.to(tl.float32) * v[None, :], 1)
    out_ptrs = out_ptr + pair.to(tl.int64) * stride_op + split * stride_os + offs_r
    tl.store(out_ptrs, part, mask=r_ok)
    if UP_HALF:
        if tl.load(separate_ptr + slot) != 0:
            a = tl.load(up_a_ptr + a_offs, mask=a_mask, other=0.0)
            tl.store(out_ptrs + stride_oh, tl.sum(a.to(tl.float32) * v[None, :], 1), mask=r_ok)


def lora_shrink_pairs(src: torch.Tensor, a: torch.Tensor, topk_ids: torch.Tensor, lora,
                      from_gate_up: bool, up_a: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """Per-pair split shrink for the decode path -> fp32 partials [pairs, splits, rank block], or
    with `up_a` (gate_up of a pool with separate up A's) [pairs, 2, splits, rank block], half 1
    written only for the pairs of slots flagged in lora.gate_up_separate."""
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    block_r = lora_rank_block(lora)
    k = a.shape[3]
    block_k = min(shrink_block_k(block_r), triton.next_power_of_2(k))
    splits = triton.cdiv(k, block_k)
    up_half = up_a is not None
    if up_half and up_a.stride() != a.stride():
        raise ValueError(f"up_a {tuple(up_a.shape)} must have gate_up_a's layout {tuple(a.shape)}")
    out = torch.empty(num_pairs, *((2,) if up_half else ()), splits, block_r, dtype=torch.float32,
                      device=src.device)
    _lora_shrink_pairs_kernel[(num_pairs, splits)](
        src, a, out, topk_ids, lora.token_slots, lora.slot_ranks,
        up_a if up_half else a, lora.gate_up_separate if up_half else lora.slot_ranks,
        a.shape[1], top_k, k,
        src.stride(0), a.stride(0), a.stride(1), a.stride(2), out.stride(0), out.stride(-2),
        out.stride(1) if up_half else 0,
        FROM_GATE_UP=from_gate_up, UP_HALF=up_half, BLOCK_R=block_r, BLOCK_K=block_k, USE_PDL=pdl,
        launch_pdl=pdl, num_warps=4)
    return out


# ---------------------------------------------------------------------------------------------
# sorted path: shrinks grouped by the base expert blocks, expands in the GEMM epilogues

RANK_STEP = 16  # rank columns per step of the sorted-path kernels (tl.dot needs >= 16)
_NO_SLOT = tl.constexpr(1 << 30)  # larger than any slot id


@triton.jit
def block_slots(slots_ptr, ranks_ptr, pairs, pair_ok, top_k):
    """(adapter slot, its rank) of each row of a block; (-1, 0) for padding, rows without an
    adapter and rank-0 slots."""
    slots = tl.load(slots_ptr + pairs // top_k, mask=pair_ok, other=-1).to(tl.int32)
    ranks = tl.load(ranks_ptr + slots, mask=slots >= 0, other=0)
    ranks = tl.where(slots >= 0, ranks, 0)
    return tl.where(ranks > 0, slots, -1), ranks


@triton.jit
def _next_slot(slots, cur):
    """Smallest slot of the block above `cur` (_NO_SLOT when none is left): walks the distinct
    slots of a block in order without sorting."""
    return tl.min(tl.where(slots > cur, slots, _NO_SLOT), 0)


@triton.jit
def _slot_separate(cur, separate_ptr, UP_HALF: tl.constexpr):
    """1 where slot `cur` has separate gate and up A's (UP_HALF pools only), else 0."""
    sep = cur * 0
    if UP_HALF:
        sep = tl.load(separate_ptr + tl.where(cur < _NO_SLOT, cur, 0))
    return sep


@triton.jit
def _expand_step_loads(cur, half, sep, r0, slots, row_ranks, rows, scratch_ptr, b_ptr, expert,
                       offs_n, n_ok, up_col0, stride_sk, stride_sr, stride_sh, stride_bl,
                       stride_be, stride_bn, K_SPLITS: tl.constexpr, RANK_STEP: tl.constexpr,
                       UP_HALF: tl.constexpr):
    """Operands of one (slot, half, rank step) of the expand: the shrink rows of the slot
    (partials summed, other rows 0) and B[slot, expert][offs_n, r0:r0 + RANK_STEP]. A slot with
    separate A's (sep) expands half 0 into the gate columns (< up_col0) and half 1 into the up
    columns; a slot with one A expands half 0 into all. Nothing is read for cur == _NO_SLOT."""
    mine = slots == cur
    rank = tl.max(tl.where(mine, row_ranks, 0), 0)
    r0 = r0 // RANK_STEP * RANK_STEP  # it is a whole step; said so, the compiler can prove B's vector alignment
    r = r0 + tl.arange(0, RANK_STEP)
    r_ok = r < rank
    s_ptrs = scratch_ptr + rows.to(tl.int64)[:, None] * stride_sr + r[None, :]
    if UP_HALF:
        s_ptrs += half * stride_sh
        col_lo = tl.where((sep != 0) & (half == 1), up_col0, 0)
        col_hi = tl.where((sep != 0) & (half == 0), up_col0, 1 << 30)
        n_ok = n_ok & (offs_n >= col_lo) & (offs_n < col_hi)
    # masked at the scratch's row width (stride_sr), not the slot's rank, so a row's step stays 16-byte vector loads
    # (at the rank: four scalar loads a thread per step); its columns past the rank hold what an earlier shrink
    # left, so they are selected away (not multiplied: that could be a NaN) before the dot
    s_mask = mine[:, None] & (r < stride_sr)[None, :]
    s = tl.load(s_ptrs, mask=s_mask, other=0.0)
    for ks in tl.static_range(1, K_SPLITS):
        s += tl.load(s_ptrs + ks * stride_sk, mask=s_mask, other=0.0)
    s = tl.where(r_ok[None, :], s, 0.0)
    b_base = (b_ptr + tl.where(cur < _NO_SLOT, cur, 0).to(tl.int64) * stride_bl
              + expert.to(tl.int64) * stride_be)
    # B's rank columns are masked at the pool's rank (stride_bn: rows packed), not the slot's: past its rank s is 0
    # and the pool holds zeros, so they add nothing, and a step of a row stays 16-byte vector loads (masked at the
    # slot's rank, H200 T=256: 16 scalar loads per thread and tile, a third of the LoRA GEMM's stall samples)
    b = tl.load(b_base + offs_n.to(tl.int64)[None, :] * stride_bn + r[:, None],
                mask=(r < tl.where(cur < _NO_SLOT, stride_bn, 0))[:, None] & n_ok[None, :], other=0.0)
    return rank, s, b


@triton.jit
def lora_block_expand(acc, slots, row_ranks, rows, scratch_ptr, b_ptr, expert, offs_n, N,
                      stride_sk, stride_sr, stride_bl, stride_be, stride_bn,
                      separate_ptr, stride_sh, up_col0,
                      K_SPLITS: tl.constexpr, RANK_STEP: tl.constexpr, UP_HALF: tl.constexpr):
    """GEMM epilogue: acc[rows of slot s] += shrink[rows] @ B[s, expert][offs_n, :rank]^T for every
    slot s of the block, the shrink being the sum of K_SPLITS fp32 partials at scratch rows `rows`.
    Walks (slot, rank step) items, loading the next item's operands before the current dot so one
    memory round trip is in flight while the previous item computes. Each dot accumulates into acc
    itself, as one more K step of the GEMM would: no copy of acc stays live (so every tile can carry
    the epilogue, 128-row prefill tiles included), and a row without an adapter adds exact zeros, so
    its values are the no-LoRA call's (a -0.0 could come back +0.0; a GEMM accumulator that starts
    at +0.0 is never -0.0 unless every product of a row is). UP_HALF (gate_up with separate up A's;
    columns >= up_col0 are the up rows): a separate slot walks the halves its columns need, half 1
    from scratch + stride_sh, so on a tile within one half it costs the same steps as a slot with
    one A."""
    n_ok = offs_n < N
    cur = _next_slot(slots, -1)
    sep = _slot_separate(cur, separate_ptr, UP_HALF)
    half = cur * 0
    if UP_HALF:  # a separate slot starts at the up half on a tile of up columns only
        tile_lo = tl.min(offs_n, 0)
        tile_hi = tl.minimum(tl.max(offs_n, 0) + 1, N)
        half = tl.where((sep != 0) & (tile_lo >= up_col0), 1, 0)
    r0 = cur * 0
    rank, s, b = _expand_step_loads(cur, half, sep, r0, slots, row_ranks, rows, scratch_ptr,
                                    b_ptr, expert, offs_n, n_ok, up_col0, stride_sk,
                                    stride_sr, stride_sh, stride_bl, stride_be, stride_bn,
                                    K_SPLITS, RANK_STEP, UP_HALF)
    while cur < _NO_SLOT:
        more = r0 + RANK_STEP < rank
        nxt_r0 = tl.where(more, r0 + RANK_STEP, 0)
        if UP_HALF:  # after the last rank step: the up half where this slot needs it, else the next slot
            up_next = (r0 + RANK_STEP >= rank) & (sep != 0) & (half == 0) & (tile_hi > up_col0)
            stay = more | up_next
            nxt = tl.where(stay, cur, _next_slot(slots, cur))
            nxt_sep = tl.where(stay, sep, _slot_separate(nxt, separate_ptr, UP_HALF))
            nxt_half = tl.where(more, half, tl.where(up_next, 1, tl.where(
                (nxt_sep != 0) & (tile_lo >= up_col0), 1, 0)))
        else:
            nxt = tl.where(more, cur, _next_slot(slots, cur))
            nxt_sep = sep
            nxt_half = half
        nxt_rank, nxt_s, nxt_b = _expand_step_loads(
            nxt, nxt_half, nxt_sep, nxt_r0, slots, row_ranks, rows, scratch_ptr, b_ptr, expert,
            offs_n, n_ok, up_col0, stride_sk, stride_sr, stride_sh, stride_bl, stride_be,
            stride_bn, K_SPLITS, RANK_STEP, UP_HALF)
        acc = tl.dot(s.to(b.dtype), b, acc)  # in place, as one more K step of the GEMM would
        cur, half, sep, r0, rank, s, b = nxt, nxt_half, nxt_sep, nxt_r0, nxt_rank, nxt_s, nxt_b
    return acc


@triton.jit
def lora_block_epilogue(acc, pid_m, pairs, pair_ok, top_k, slots_ptr, ranks_ptr, scratch_ptr, b_ptr,
                        expert, offs_n, N, stride_sk, stride_sr, stride_bl, stride_be, stride_bn,
                        separate_ptr, stride_sh, up_col0, BLOCK_M: tl.constexpr,
                        K_SPLITS: tl.constexpr, RANK_STEP: tl.constexpr, UP_HALF: tl.constexpr):
    """The LoRA epilogue of a sorted-path GEMM tile (block pid_m, columns offs_n): acc plus every
    row's expand, shrink partials at scratch rows pid_m * BLOCK_M + i, walked by lora_block_expand
    (see there for UP_HALF, separate_ptr, stride_sh, up_col0)."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slots, row_ranks = block_slots(slots_ptr, ranks_ptr, pairs, pair_ok, top_k)
    return lora_block_expand(acc, slots, row_ranks, rows, scratch_ptr, b_ptr, expert, offs_n, N,
                             stride_sk, stride_sr, stride_bl, stride_be, stride_bn, separate_ptr,
                             stride_sh, up_col0, K_SPLITS, RANK_STEP, UP_HALF)


@triton.jit
def _shrink_slot(a_base, out_ptrs, src_rows, mine, rank, k_lo, k_hi, K, stride_ar,
                 FROM_GATE_UP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                 RANK_STEP: tl.constexpr, ACTIVATED: tl.constexpr = False):
    """out[rows of the slot, :rank] = v[rows, k_lo:k_hi] @ A[:rank, k_lo:k_hi]^T, A at a_base."""
    dtype = a_base.dtype.element_ty
    offs_k = tl.arange(0, BLOCK_K)
    for r0 in range(0, rank, RANK_STEP):
        r = r0 + tl.arange(0, RANK_STEP)
        r_ok = r < rank
        acc = tl.zeros((BLOCK_M, RANK_STEP), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            k = k0 + offs_k
            k_ok = k < k_hi
            v_mask = mine[:, None] & k_ok[None, :]
            if FROM_GATE_UP and not ACTIVATED:
                gate = tl.load(src_rows + k[None, :], mask=v_mask, other=0.0)
                up = tl.load(src_rows + K + k[None, :], mask=v_mask, other=0.0)
                v = silu_mul(gate.to(tl.float32), up.to(tl.float32)).to(dtype)
            else:
                v = tl.load(src_rows + k[None, :], mask=v_mask, other=0.0).to(dtype)
            at = tl.load(a_base + r[None, :] * stride_ar + k[:, None],
                         mask=r_ok[None, :] & k_ok[:, None], other=0.0)
            acc = tl.dot(v, at, acc)
        tl.store(out_ptrs + r[None, :], acc, mask=mine[:, None] & r_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs"])  # sizes that vary by step: one compile
def _lora_block_shrink_kernel(
    src_ptr, a_ptr, scratch_ptr, slots_ptr, ranks_ptr, sorted_ids_ptr, block_groups_ptr,
    up_a_ptr, separate_ptr,
    num_pairs, top_k, K, K_PER_SPLIT,
    stride_src, stride_al, stride_ae, stride_ar, stride_sk, stride_sr, stride_sh,
    FROM_GATE_UP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    RANK_STEP: tl.constexpr, LANES: tl.constexpr, UP_HALF: tl.constexpr, USE_PDL: tl.constexpr,
    ACTIVATED: tl.constexpr = False,
):
    """scratch[split, row, :rank] = v[row, split cols] @ A[slot, expert][:rank, split cols]^T for
    the rows of each adapter slot of one expert block. v = x[token], or silu(g) * u of the bf16
    gu row the down GEMM reads (ACTIVATED: the pair's row of h = silu(g) * u itself). The distinct
    slots of a block are dealt round-robin to LANES programs (they own disjoint rows). Only rows with an adapter, rank columns < rank, are
    written. UP_HALF: slots flagged separate also write scratch + stride_sh from up_a (same
    strides as A)."""
    pdl_launch.enter(USE_PDL)
    blk = tl.program_id(0)
    split = tl.program_id(1)
    lane = tl.program_id(2)
    expert = tl.load(block_groups_ptr + blk)
    if expert < 0:
        return
    rows = blk * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ids_ptr + rows)
    pair_ok = pairs < num_pairs
    slots, row_ranks = block_slots(slots_ptr, ranks_ptr, pairs, pair_ok, top_k)
    if FROM_GATE_UP:
        src_rows = src_ptr + pairs.to(tl.int64)[:, None] * stride_src
    else:
        src_rows = src_ptr + (pairs // top_k).to(tl.int64)[:, None] * stride_src
    k_lo = split * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    out_ptrs = scratch_ptr + split * stride_sk + rows.to(tl.int64)[:, None] * stride_sr
    cur = _next_slot(slots, -1)
    for _skip in range(lane):
        cur = _next_slot(slots, cur)
    while cur < _NO_SLOT:
        mine = slots == cur
        rank = tl.max(tl.where(mine, row_ranks, 0), 0)
        a_offs = cur.to(tl.int64) * stride_al + expert.to(tl.int64) * stride_ae
        _shrink_slot(a_ptr + a_offs, out_ptrs, src_rows, mine, rank, k_lo, k_hi, K, stride_ar,
                     FROM_GATE_UP, BLOCK_M, BLOCK_K, RANK_STEP, ACTIVATED)
        if UP_HALF:
            if tl.load(separate_ptr + cur) != 0:
                _shrink_slot(up_a_ptr + a_offs, out_ptrs + stride_sh, src_rows, mine, rank, k_lo,
                             k_hi, K, stride_ar, FROM_GATE_UP, BLOCK_M, BLOCK_K, RANK_STEP)
        for _lane in tl.static_range(LANES):
            cur = _next_slot(slots, cur)


def lora_block_shrink(src: torch.Tensor, a: torch.Tensor, aligned: AlignedBlocks, lora,
                      top_k: int, *, from_gate_up: bool, block_k: int = 128, splits: int = 4,
                      lanes: int = 1, num_warps: int = 4, num_stages: int = 3, up_a: torch.Tensor | None = None,
                      out: torch.Tensor | None = None, pdl: bool = False,
                      activated: bool = False) -> torch.Tensor:
    """Shrink grouped by the base expert blocks -> fp32 partials [splits, aligned rows, R]
    (row = position in `aligned.sorted_ids`), to be summed over splits by `lora_block_expand`;
    with `up_a` (gate_up of a pool with separate up A's) [2, splits, rows, R], half 1 written
    for the rows of slots flagged in lora.gate_up_separate. `src` is x [T, H] or, with
    `from_gate_up`, gu [pairs, 2I] (with `activated`: h [pairs, I], SiLU*up already applied). Grid: (blocks,
    splits, lanes), all from static shapes and config; `out` (tests) lets a caller see which entries were written."""
    num_blocks = aligned.block_groups.numel()
    num_rows = aligned.sorted_ids.numel()
    block_m = num_rows // num_blocks
    k = a.shape[3]
    num_pairs = lora.token_slots.numel() * top_k
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    k_per_split = triton.cdiv(triton.cdiv(k, max(1, splits)), block_k) * block_k
    splits = triton.cdiv(k, k_per_split)
    if a.stride(3) != 1 or src.stride(1) != 1:
        raise ValueError("lora_block_shrink needs LoRA A and its input contiguous along K")
    if activated and (not from_gate_up or up_a is not None):
        raise ValueError("activated input is the down GEMM's h: from_gate_up without up_a")
    up_half = up_a is not None
    if up_half and up_a.stride() != a.stride():
        raise ValueError(f"up_a {tuple(up_a.shape)} must have gate_up_a's layout {tuple(a.shape)}")
    shape = (*((2,) if up_half else ()), splits, num_rows, a.shape[2])
    if out is None:
        out = torch.empty(shape, dtype=torch.float32, device=src.device)
    if out.shape != shape or out.stride(-1) != 1:
        raise ValueError(f"shrink buffer {tuple(out.shape)} is not {shape}")
    lanes = max(1, min(lanes, block_m, lora.slot_ranks.numel()))
    _lora_block_shrink_kernel[(num_blocks, splits, lanes)](
        src, a, out, lora.token_slots, lora.slot_ranks, aligned.sorted_ids, aligned.block_groups,
        up_a if up_half else a, lora.gate_up_separate if up_half else lora.slot_ranks,
        num_pairs, top_k, k, k_per_split,
        src.stride(0), a.stride(0), a.stride(1), a.stride(2), out.stride(-3), out.stride(-2),
        out.stride(0) if up_half else 0,
        FROM_GATE_UP=from_gate_up, BLOCK_M=block_m, BLOCK_K=block_k, RANK_STEP=RANK_STEP,
        LANES=lanes, UP_HALF=up_half, USE_PDL=pdl, ACTIVATED=activated, launch_pdl=pdl, num_warps=num_warps,
        num_stages=num_stages)
    return out


def lora_block_shrink_ref(src: torch.Tensor, a: torch.Tensor, aligned: AlignedBlocks, lora,
                          top_k: int, *, from_gate_up: bool, up_a: torch.Tensor | None = None,
                          activated: bool = False) -> dict[int, torch.Tensor]:
    """Plain-torch twin of `lora_block_shrink`, summed over splits: {aligned row: fp32 shrink
    [rank]} for every row with an adapter (the rows the kernel writes). With `up_a`: the up half,
    {row: shrink} for the rows of slots flagged separate only."""
    num_pairs = lora.token_slots.numel() * top_k
    k = a.shape[3]
    sorted_ids = aligned.sorted_ids.tolist()
    block_m = len(sorted_ids) // aligned.block_groups.numel()
    groups = aligned.block_groups.tolist()
    slots, ranks = lora.token_slots.tolist(), lora.slot_ranks.tolist()
    if up_a is not None:
        separate = lora.gate_up_separate.tolist()
        slots = [s if s >= 0 and separate[s] else -1 for s in slots]
        a = up_a
    out = {}
    for row, pair in enumerate(sorted_ids):
        if pair >= num_pairs or groups[row // block_m] < 0:
            continue
        slot = slots[pair // top_k]
        if slot < 0 or ranks[slot] == 0:
            continue
        if activated:
            v = src[pair].float()
        elif from_gate_up:
            g, u = src[pair, :k].float(), src[pair, k:].float()
            v = (F.silu(g) * u).to(src.dtype).float()
        else:
            v = src[pair // top_k].float()
        out[row] = a[slot, groups[row // block_m], :ranks[slot]].float() @ v
    return out
