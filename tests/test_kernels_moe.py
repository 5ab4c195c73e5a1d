"""MoE kernels (alignment, fused MoE, MoE-LoRA) against plain-torch references.

CPU: tiny fp32 shapes under the Triton interpreter. GPU (marked `gpu`): bf16 at
Qwen3-30B-A3B shapes against the fp32 per-pair reference, and CUDA-graph replay.
"""

import json
import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any module with @triton.jit is imported

from dataclasses import replace  # noqa: E402

import pytest  # noqa: E402

from moeserve.kernels import moe_lora  # noqa: E402
from moeserve.kernels.fused_moe import MoELoRAArgs, fused_moe, fused_moe_ref, tma_readable  # noqa: E402
from moeserve.kernels import moe_plan  # noqa: E402
from moeserve.kernels.moe_plan import GemmTile, MoEPlan, MoEProblem, default_plan  # noqa: E402
from moeserve.layers.batch import LoRABatch  # noqa: E402
from moeserve.layers.moe import ExpertLoRABuffers, moe_experts_torch  # noqa: E402
from moeserve.kernels.moe_align import align_max_blocks, moe_align, moe_align_ref  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# The interpreter's fp32 dots are exact fp32; a GPU's tl.dot on fp32 runs in TF32 (operands rounded to 10 mantissa
# bits, up to 2^-11 relative each), so the tiny fp32 cases, run on a GPU, agree to ~1e-3 of the norm (H200: 2.3e-3
# through gate_up, SiLU and down), and a LoRA delta taken as a difference of two outputs to ~1e-2 of its own norm.
EXACT_DOTS = os.environ.get("TRITON_INTERPRET") == "1"
FP32_TOL = 1e-5 if EXACT_DOTS else 5e-3
FP32_DELTA_TOL = 1e-4 if EXACT_DOTS else 5e-2


def _rel(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def _size_ratio(a, b):
    return (a.float().norm() / b.float().norm()).item()


def _route(num_tokens, num_experts, top_k, gen, device=DEV, empty_expert=None):
    logits = torch.randn(num_tokens, num_experts, generator=gen, device=device)
    if empty_expert is not None:
        logits[:, empty_expert] = -1e9
    weights, ids = torch.softmax(logits, -1).topk(top_k, -1)
    return weights, ids.to(torch.int32)


def _lora_pool(num_slots, num_experts, hidden, inter, max_rank, ranks, gen, std,
               dtype=torch.float32, device=DEV):
    """Slot pool as the LoRA manager keeps it: columns >= each slot's rank are zero."""
    def pool(*shape):
        w = torch.randn(num_slots, num_experts, *shape, generator=gen, device=device) * std
        return w

    ga, gb = pool(max_rank, hidden), pool(2 * inter, max_rank)
    da, db = pool(max_rank, inter), pool(hidden, max_rank)
    for s, r in enumerate(ranks):
        ga[s, :, r:] = 0
        gb[s, ..., r:] = 0
        da[s, :, r:] = 0
        db[s, ..., r:] = 0
    ranks_t = torch.tensor(ranks, dtype=torch.int32, device=device)
    return ranks_t, [w.to(dtype) for w in (ga, gb, da, db)]


# --------------------------------------------------------------------------------------------
# alignment


def _assert_same_alignment(ours, ref, num_pairs):
    """Equal up to the order of pairs inside each group (the kernel claims rows with atomics)."""
    assert torch.equal(ours.num_padded, ref.num_padded)
    assert torch.equal(ours.block_groups, ref.block_groups)
    a, b = ours.sorted_ids.cpu().long(), ref.sorted_ids.cpu().long()
    block_m = a.numel() // ref.block_groups.numel()
    row_group = ref.block_groups.cpu().long().repeat_interleave(block_m)
    assert torch.equal(a == num_pairs, b == num_pairs)  # the same padding rows
    key = num_pairs + 1
    assert torch.equal((row_group * key + a).sort().values, (row_group * key + b).sort().values)


def _check_alignment_invariants(aligned, topk_ids, groups, num_groups, block_m):
    """Independent of both implementations: every valid pair exactly once, blocks of one group,
    padding = sentinel, valid rows first in each group, sizes as counted directly."""
    num_pairs = topk_ids.numel()
    sorted_ids = aligned.sorted_ids.cpu().tolist()
    block_groups = aligned.block_groups.cpu().tolist()
    num_padded = aligned.num_padded.item()
    counts = [0] * num_groups
    for g in groups:
        if g is not None:
            counts[g] += 1
    assert num_padded == sum(-(-c // block_m) * block_m for c in counts)
    assert len(block_groups) == align_max_blocks(num_pairs, num_groups, block_m)
    seen = []
    for b, g in enumerate(block_groups):
        rows = sorted_ids[b * block_m:(b + 1) * block_m]
        if b * block_m >= num_padded:
            assert g == -1 and all(p == num_pairs for p in rows)
            continue
        real = [p for p in rows if p != num_pairs]
        assert real, "a block in use holds at least one pair"
        assert rows[:len(real)] == real, "padding only after a group's pairs"
        assert all(groups[p] == g for p in real)
        seen += real
    assert sorted(seen) == [p for p, g in enumerate(groups) if g is not None]


@pytest.mark.parametrize("num_tokens,top_k,num_experts,block_m,chunk", [
    (7, 2, 8, 4, 4096),    # odd T, small blocks
    (13, 2, 8, 16, 16),    # two chunks: histograms, then placement
    (100, 2, 8, 16, 16),   # 13 chunks (not a power of two)
    (300, 2, 8, 4, 64),    # 156 blocks: three padding programs of 64 blocks
    (40, 4, 5, 64, 32),    # 64-row blocks, 5 chunks
    (1, 2, 4, 16, 4096),   # single token
    (5, 3, 6, 4, 16),      # E not a power of two
])
@pytest.mark.parametrize("self_count", [False, True])  # the count kernel first, or every program counting itself
def test_align_by_expert_matches_reference(num_tokens, top_k, num_experts, block_m, chunk, self_count):
    gen = torch.Generator(DEV).manual_seed(num_tokens)
    _, ids = _route(num_tokens, num_experts, top_k, gen, empty_expert=1)
    ids[0, 0] = -1  # not routed here (e.g. another expert-parallel rank): belongs to no block
    ours = moe_align(ids, num_experts, block_m, chunk=chunk, self_count=self_count)
    ref = moe_align_ref(ids, num_experts, block_m)
    _assert_same_alignment(ours, ref, ids.numel())
    _check_alignment_invariants(ours, ids, [e if 0 <= e < num_experts else None
                                            for e in ids.flatten().tolist()],
                                num_experts, block_m)
    flat = ids.flatten().tolist()
    groups = [e if 0 <= e < num_experts else None for e in flat]
    _check_alignment_invariants(ref, ids, groups, num_experts, block_m)


def _moe_problem(num_tokens, top_k, num_experts, hidden, inter, seed, dtype=torch.float32,
                 std=0.1, device=DEV, empty_expert=None):
    gen = torch.Generator(device).manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen, device=device).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen, device=device) * std).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen, device=device) * std).to(dtype)
    weights, ids = _route(num_tokens, num_experts, top_k, gen, device, empty_expert)
    return gen, x, w13, w2, weights, ids


SHAPES = [  # (T, K, E, H, I)
    (5, 2, 8, 64, 32),  # odd T, block-aligned H and I
    (3, 2, 4, 48, 40),  # H and I not multiples of the K block: masked tails
]


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "sorted"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}K{}E{}H{}I{}".format(*s))
def test_fused_moe_matches_reference(shape, decode):
    num_tokens, top_k, num_experts, hidden, inter = shape
    _, x, w13, w2, weights, ids = _moe_problem(*shape, seed=1, empty_expert=2)
    out = fused_moe(x, w13, w2, weights, ids, decode=decode)
    ref = fused_moe_ref(x, w13, w2, weights, ids)
    assert out.dtype == x.dtype and out.shape == x.shape
    assert _rel(out, ref) < FP32_TOL


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "sorted"])
def test_fused_moe_skips_pairs_routed_elsewhere(decode):
    _, x, w13, w2, weights, ids = _moe_problem(4, 2, 4, 32, 32, seed=2)
    ids[1, 0] = -1
    ids[3, 1] = 4  # == E: not an expert of this layer
    out = fused_moe(x, w13, w2, weights, ids, decode=decode)
    assert _rel(out, fused_moe_ref(x, w13, w2, weights, ids)) < FP32_TOL


@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "sorted"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}K{}E{}H{}I{}".format(*s))
def test_fused_moe_lora_matches_reference(shape, decode, split, monkeypatch):
    """`split`: shrinks split along H / I into several programs (partial sums) and LoRA
    expands over several N tiles, as they are at real sizes."""
    num_tokens, top_k, num_experts, hidden, inter = shape
    plan = default_plan(num_tokens, top_k, decode)
    if split:
        monkeypatch.setattr(moe_lora, "SHRINK_TILE", 256)  # decode: 16 columns per shrink step
        plan = replace(plan, gate_up=replace(plan.gate_up, block_n=16),
                       down=replace(plan.down, block_n=16), lora_shrink_block_k=16)
    gen, x, w13, w2, weights, ids = _moe_problem(*shape, seed=4)
    # pool of max rank 8: ranks 2 and 4, an empty slot, a full-rank slot; tokens without adapter
    ranks, (ga, gb, da, db) = _lora_pool(4, num_experts, hidden, inter, 8, [2, 4, 0, 8], gen,
                                         std=0.3)
    slots = torch.tensor([0, -1, 1, 2, 3][:num_tokens], dtype=torch.int32, device=DEV)
    lora = MoELoRAArgs(slots, ranks, ga, gb, da, db)
    out = fused_moe(x, w13, w2, weights, ids, lora, plan=plan)
    ref = fused_moe_ref(x, w13, w2, weights, ids, lora)
    assert _rel(out, ref) < FP32_TOL
    # the delta itself, not only the sum: LoRA-on minus LoRA-off against the same in the reference
    base = fused_moe(x, w13, w2, weights, ids, plan=plan)
    ref_base = fused_moe_ref(x, w13, w2, weights, ids)
    assert _size_ratio(ref - ref_base, ref_base) > 0.3, "the test adapters must matter"
    assert _rel(out - base, ref - ref_base) < FP32_DELTA_TOL
    # tokens without an adapter (slot -1, empty slot 2) are bitwise the base output
    for t, s in enumerate(slots.tolist()):
        if s < 0 or ranks[s] == 0:
            assert torch.equal(out[t], base[t])


def test_moe_lora_args_refuse_b_rows_that_are_not_packed():
    """The expands mask B's rank columns at the row stride: a B view of a wider pool (columns between its rows that
    the kernels would read) is refused by name, the packed pool accepted."""
    gen, *_ = _moe_problem(3, 2, 4, 32, 32, seed=5)
    ranks, pool = _lora_pool(2, 4, 32, 32, 16, [8, 16], gen, std=0.1)
    slots = torch.tensor([0, 1, 0], dtype=torch.int32, device=DEV)
    MoELoRAArgs(slots, ranks, *pool)
    ga, gb, da, db = pool
    wide = torch.zeros(*db.shape[:-1], 32, device=DEV)
    wide[..., :16] = db
    with pytest.raises(ValueError, match="down_b .* rows packed"):
        MoELoRAArgs(slots, ranks, ga, gb, da, wide[..., :16])
    with pytest.raises(ValueError, match="gate_up_b"):
        MoELoRAArgs(slots, ranks, ga, gb.transpose(-1, -2).contiguous().transpose(-1, -2), da, db)


def test_fused_moe_lora_ignores_columns_beyond_rank():
    """Ranks are read in the kernels: columns >= rank never contribute, even if nonzero."""
    gen, x, w13, w2, weights, ids = _moe_problem(3, 2, 4, 32, 32, seed=5)
    ranks, pool = _lora_pool(2, 4, 32, 32, 8, [2, 4], gen, std=0.3)
    slots = torch.tensor([0, 1, 0], dtype=torch.int32, device=DEV)
    lora = MoELoRAArgs(slots, ranks, *pool)
    dirty = [w.clone() for w in pool]
    for w in dirty:  # garbage in the unused rank columns of both slots
        if w.shape[2] == 8:
            w[0, :, 2:] = 7.0
            w[1, :, 4:] = 7.0
        else:
            w[0, ..., 2:] = 7.0
            w[1, ..., 4:] = 7.0
    lora_dirty = MoELoRAArgs(slots, ranks, *dirty)
    for decode in (True, False):
        clean = fused_moe(x, w13, w2, weights, ids, lora, decode=decode)
        assert torch.equal(fused_moe(x, w13, w2, weights, ids, lora_dirty, decode=decode), clean)


# --------------------------------------------------------------------------------------------
# sorted path: LoRA shrinks on the base expert blocks, expands in the GEMM epilogues

# Small tiles so that a batch spans several expert blocks, several N tiles and K steps, and the
# shrinks split K over several programs.
SMALL_TILE = GemmTile(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=1)
SMALL_PLAN = MoEPlan(False, SMALL_TILE, SMALL_TILE, lora_shrink_block_k=16, lora_gate_up_splits=3,
                     lora_down_splits=2, lora_shrink_lanes=2)
MIXED_RANKS = [8, 16, 64, 0, 0, 0]  # pool of max rank 64; slot 3 evicted, 4 and 5 never loaded
MIXED_SLOTS = [0, -1, 1, 2, 3, 1, 0, 2]  # cycled over the tokens: -1 and 3 have no adapter


def _mixed_lora_problem(num_tokens, hidden, inter, seed):
    """3 experts for 2T pairs: experts span two blocks of 16 and blocks hold several slots.
    Returns the problem, a clean pool (zeros beyond each rank, as the slot pool keeps it) and a
    dirty one: garbage beyond each rank (_dirty_past_rank) and NaN in every slot no token may read."""
    num_experts, top_k = 3, 2
    gen, x, w13, w2, weights, ids = _moe_problem(num_tokens, top_k, num_experts, hidden, inter, seed)
    ranks, clean = _lora_pool(len(MIXED_RANKS), num_experts, hidden, inter, 64, MIXED_RANKS, gen,
                              std=0.15)
    dirty = [w.clone() for w in clean]
    for which, w in enumerate(dirty):
        for s, r in enumerate(MIXED_RANKS):
            _dirty_past_rank(w, which, s, r)
    slots = torch.tensor([MIXED_SLOTS[t % len(MIXED_SLOTS)] for t in range(num_tokens)],
                         dtype=torch.int32, device=DEV)
    return (x, w13, w2, weights, ids), ranks, slots, clean, dirty


def _dirty_past_rank(w, which, slot, rank):
    """What a pool may hold past a slot's rank and the kernels must not let through: NaN, except in B's columns up to
    the next multiple of 16, which the kernels read (as whole 16-column steps) and multiply by a shrink of 0 there:
    the slot pool keeps zeros, any finite value must add nothing (7.0 here)."""
    cols = _rank_cols(w, which, slot, rank)
    cols.fill_(float("nan"))
    if which % 2 == 1:
        cols[..., :-rank % 16].fill_(7.0)


def _rank_cols(w, which, slot, start):
    """Rank columns >= start of one slot of pool weight `which` (index in (gate_up_a, gate_up_b,
    down_a, down_b)): dim 2 of A [L, E, R, in], dim 3 of B [L, E, out, R]."""
    return w[slot, :, start:] if which % 2 == 0 else w[slot, ..., start:]


def _assert_blocks_mix_slots(ids, slots, ranks, block_m):
    """The case is meaningful: some expert spans several blocks, some block several adapters."""
    aligned = moe_align_ref(ids, int(ids.max()) + 1, block_m)
    groups = aligned.block_groups.tolist()
    assert max(groups.count(g) for g in set(groups) if g >= 0) > 1
    per_block = []
    for b, g in enumerate(groups):
        rows = [p for p in aligned.sorted_ids[b * block_m:(b + 1) * block_m].tolist() if p < ids.numel()]
        per_block.append({slots[p // ids.shape[1]].item() for p in rows} - {-1, 3})
    assert max(len(s) for s in per_block) >= 3


def _torch_reference(problem, ranks, slots, pool):
    """moeserve.layers.moe.moe_experts_torch (the torch backend), fp32."""
    x, w13, w2, weights, ids = problem
    active = tuple(s for s in sorted(set(slots.tolist())) if s >= 0 and ranks[s] > 0)
    return moe_experts_torch(x, w13, w2, weights, ids, LoRABatch(slots, ranks, active),
                             ExpertLoRABuffers(*pool))


def _bits(t):
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("shape", [(24, 64, 32), (28, 48, 40)], ids=["H64I32", "H48I40"])
def test_sorted_lora_mixed_ranks_matches_references(shape):
    """Ranks 8/16/64 in a rank-64 pool, tokens without adapter, an evicted slot; NaN wherever
    the kernels must not read. Against fp32 fused_moe_ref and the torch MoE backend."""
    num_tokens, hidden, inter = shape
    _check_sorted_lora(*_mixed_lora_problem(num_tokens, hidden, inter, seed=7), SMALL_PLAN)


def _check_sorted_lora(problem, ranks, slots, clean, dirty, plan):
    """`dirty` (NaN where nothing may be read) through `plan` against fp32 fused_moe_ref and the torch backend
    with `clean`; the LoRA delta itself; rows without an adapter bitwise the no-LoRA call's. Returns the latter."""
    x, w13, w2, weights, ids = problem
    _assert_blocks_mix_slots(ids, slots, ranks, SMALL_TILE.block_m)
    out = fused_moe(*problem, MoELoRAArgs(slots, ranks, *dirty), plan=plan)
    ref = fused_moe_ref(*problem, MoELoRAArgs(slots, ranks, *clean))
    assert torch.isfinite(out).all()
    assert _rel(out, ref) < FP32_TOL
    assert _rel(out, _torch_reference(problem, ranks, slots, clean)) < FP32_TOL
    base = fused_moe(*problem, plan=plan)
    ref_base = fused_moe_ref(*problem)
    assert _size_ratio(ref - ref_base, ref_base) > 0.3, "the test adapters must matter"
    assert _rel(out - base, ref - ref_base) < FP32_DELTA_TOL
    no_adapter = [t for t, s in enumerate(slots.tolist()) if s < 0 or ranks[s] == 0]
    assert torch.equal(_bits(out[no_adapter]), _bits(base[no_adapter]))
    return base


def test_sorted_lora_ignores_shrink_scratch_past_each_rank(monkeypatch):
    """The shrinks write each row's partials up to its slot's rank only; the expand epilogue reads whole 16-column
    steps of that scratch, so what lies past the rank (whatever an earlier call left: NaN here) must be dropped, not
    multiplied by B's zeros."""
    from moeserve.kernels import fused_moe as fused_moe_module

    shrink = fused_moe_module.lora_block_shrink

    def poisoned(*args, **kw):  # the same partials, in a scratch that starts as NaN
        out = torch.full(shrink(*args, **kw).shape, float("nan"), device=DEV)
        return shrink(*args, **kw, out=out)

    problem, ranks, slots, clean, dirty = _mixed_lora_problem(24, 48, 40, seed=9)
    want = fused_moe(*problem, MoELoRAArgs(slots, ranks, *dirty), plan=SMALL_PLAN)
    monkeypatch.setattr(fused_moe_module, "lora_block_shrink", poisoned)
    got = fused_moe(*problem, MoELoRAArgs(slots, ranks, *dirty), plan=SMALL_PLAN)
    assert torch.isfinite(got).all() and torch.equal(_bits(got), _bits(want))


@pytest.mark.parametrize("block_m", [16, 32])
def test_sorted_lora_walk_in_place_matches_references(block_m):
    """The epilogue walking every (slot, rank step) item of a block with the next one's loads in flight, each dot
    accumulating into the GEMM's own accumulator, on the mixed-rank case with 40 tokens: blocks of 16 and of 32 rows
    hold several slots of several rank steps; rows without an adapter keep the no-LoRA call's bits (they add exact
    zeros)."""
    tile = replace(SMALL_TILE, block_m=block_m)
    _check_sorted_lora(*_mixed_lora_problem(40, 64, 32, seed=15), replace(SMALL_PLAN, gate_up=tile, down=tile))


def test_sorted_lora_after_hot_load_and_eviction():
    """Slot buffers change in place between two calls (same tensors, as in a captured graph):
    slot 4 is loaded (rank 16) and slot 1 evicted (rank 0, left NaN); tokens move to slot 4."""
    problem, ranks, slots, clean, dirty = _mixed_lora_problem(24, 64, 32, seed=8)
    lora = MoELoRAArgs(slots, ranks, *dirty)
    plan = SMALL_PLAN
    first = fused_moe(*problem, lora, plan=plan)
    assert _rel(first, fused_moe_ref(*problem, MoELoRAArgs(slots, ranks, *clean))) < FP32_TOL

    gen = torch.Generator(DEV).manual_seed(9)
    for which, (w_dirty, w_clean) in enumerate(zip(dirty, clean)):
        new = torch.randn(w_dirty[4:5].shape, generator=gen, device=DEV) * 0.15
        _rank_cols(new, which, 0, 16).zero_()
        w_dirty[4:5].copy_(new)
        w_clean[4:5].copy_(new)
        w_dirty[1].fill_(float("nan"))
        w_clean[1].zero_()  # the pool zeroes an unloaded slot; the kernels must not even read it
    ranks[4], ranks[1] = 16, 0
    slots[::3] = 4
    second = fused_moe(*problem, lora, plan=plan)
    ref = fused_moe_ref(*problem, MoELoRAArgs(slots, ranks, *clean))
    assert torch.isfinite(second).all()
    assert _rel(second, ref) < FP32_TOL
    base = fused_moe(*problem, plan=plan)
    no_adapter = [t for t, s in enumerate(slots.tolist()) if s < 0 or ranks[s] == 0]
    assert any(slots[t] == 1 for t in no_adapter), "tokens still pointing at the evicted slot"
    assert torch.equal(_bits(second[no_adapter]), _bits(base[no_adapter]))


@pytest.mark.parametrize("from_gate_up,lanes,activated", [(False, 1, False), (True, 3, False), (True, 2, True)],
                         ids=["x", "gate_up", "h"])
def test_lora_block_shrink_matches_twin(from_gate_up, lanes, activated):
    """The shrink over the base expert blocks, summed over its K splits, against its torch twin;
    every entry the twin does not name (rows without adapter, padding, columns >= rank) is left
    unwritten."""
    problem, ranks, slots, clean, dirty = _mixed_lora_problem(20, 48, 40, seed=10)
    x, _, _, _, ids = problem
    top_k = ids.shape[1]
    aligned = moe_align(ids, 3, 16)
    lora = MoELoRAArgs(slots, ranks, *dirty)
    if from_gate_up:  # gu [pairs, 2I], or h [pairs, I] with SiLU*up applied
        src = torch.randn(ids.numel(), (1 if activated else 2) * 40, device=DEV)
        a, a_clean, splits = dirty[2], clean[2], 2
    else:
        src, a, a_clean, splits = x, dirty[0], clean[0], 3
    k = a.shape[3]
    out = torch.full((splits, aligned.sorted_ids.numel(), 64), float("nan"), device=DEV)
    moe_lora.lora_block_shrink(src, a, aligned, lora, top_k, from_gate_up=from_gate_up,
                               block_k=16, splits=splits, lanes=lanes, out=out, activated=activated)
    twin = moe_lora.lora_block_shrink_ref(src, a_clean, aligned, lora, top_k,
                                          from_gate_up=from_gate_up, activated=activated)
    assert len(twin) > 10 and k > 16 * (splits - 1)
    written = torch.zeros_like(out, dtype=torch.bool)
    for row, want in twin.items():
        r = want.numel()
        got = out[:, row, :r]
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.sum(0), want, rtol=FP32_TOL, atol=FP32_TOL)
        written[:, row, :r] = True
    assert out[~written].isnan().all()


# --------------------------------------------------------------------------------------------
# GPU: bf16 at Qwen3-30B-A3B decode shapes

QWEN3_MOE = dict(hidden=2048, inter=768, num_experts=128, top_k=8)


def _qwen3_problem(num_tokens, seed, with_lora):
    q = QWEN3_MOE
    gen, x, w13, w2, weights, ids = _moe_problem(
        num_tokens, q["top_k"], q["num_experts"], q["hidden"], q["inter"], seed,
        dtype=torch.bfloat16, std=0.02, device="cuda")
    lora = None
    if with_lora:
        # 8 slots of max rank 64; 4 active rank-16 adapters; the last token has none (T > 1)
        ranks, pool = _lora_pool(8, q["num_experts"], q["hidden"], q["inter"], 64,
                                 [16, 16, 16, 16, 0, 0, 0, 0], gen, std=0.07,
                                 dtype=torch.bfloat16, device="cuda")
        slots = (torch.arange(num_tokens, device="cuda") % 4).to(torch.int32)
        if num_tokens > 1:
            slots[-1] = -1
        lora = MoELoRAArgs(slots, ranks, *pool)
    return x, w13, w2, weights, ids, lora


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("with_lora", [False, True], ids=["base", "lora"])
@pytest.mark.parametrize("num_tokens", [1, 8, 64, 256, 512])
def test_gpu_fused_moe_bf16_qwen3_shapes(num_tokens, with_lora):
    x, w13, w2, weights, ids, lora = _qwen3_problem(num_tokens, 10 + num_tokens, with_lora)
    ref = fused_moe_ref(x, w13, w2, weights, ids, lora)
    for decode in (None, True, False) if num_tokens <= 8 else (None,):
        out = fused_moe(x, w13, w2, weights, ids, lora, decode=decode)
        assert out.dtype == torch.bfloat16
        assert torch.isfinite(out).all()
        assert _rel(out, ref) < 1e-2, decode
        if with_lora:
            base = fused_moe(x, w13, w2, weights, ids, decode=decode)
            ref_base = fused_moe_ref(x, w13, w2, weights, ids)
            assert _size_ratio(ref - ref_base, ref_base) > 0.3
            assert _rel(out - base, ref - ref_base) < 2e-2
            if num_tokens > 1:
                assert torch.equal(out[-1], base[-1])  # the token without an adapter


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("num_tokens", [256, 4096])
def test_gpu_weights_by_tma_match_pointer_loads_bitwise(num_tokens):
    """The shipped table's TMA weight loads at Qwen3-30B-A3B shapes: bitwise the same plan by pointers, without
    and with adapters (the in-place LoRA epilogue on the 128-row tiles at 4,096)."""
    x, w13, w2, weights, ids, lora = _qwen3_problem(num_tokens, 3 + num_tokens, True)
    for adapters in (None, lora):
        plan = default_plan(num_tokens, ids.shape[1], lora=adapters is not None,
                            problem=MoEProblem(w13.shape[0], x.shape[1], w2.shape[2], ids.shape[1], x.dtype,
                                               x.device))
        tma = fused_moe(x, w13, w2, weights, ids, adapters, plan=replace(plan, weights_tma=True))
        assert torch.equal(tma, fused_moe(x, w13, w2, weights, ids, adapters, plan=replace(plan, weights_tma=False)))
        assert _rel(tma, fused_moe_ref(x, w13, w2, weights, ids, adapters)) < 1e-2


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("num_tokens,plan_of", [(t, "lora") for t in (16, 64, 256, 512, 1024)] + [
    (t, "no_lora") for t in (64, 256, 1024)])
def test_gpu_sorted_lora_bf16_mixed_ranks(num_tokens, plan_of):
    """Sorted path at Qwen3-30B-A3B shapes: 7 adapters of ranks 8/16/64 in a rank-64 pool, an
    evicted slot and tokens without adapter; NaN wherever the kernels must not read. The plan a LoRA
    call runs at every T, and the no-LoRA call's plan (its shrinks split along K)."""
    q = QWEN3_MOE
    gen, x, w13, w2, weights, ids = _moe_problem(
        num_tokens, q["top_k"], q["num_experts"], q["hidden"], q["inter"], 20 + num_tokens,
        dtype=torch.bfloat16, std=0.02, device="cuda")
    slot_ranks = [16, 8, 64, 16, 0, 16, 16, 8]
    ranks, clean = _lora_pool(8, q["num_experts"], q["hidden"], q["inter"], 64, slot_ranks, gen,
                              std=0.07, dtype=torch.bfloat16, device="cuda")
    dirty = [w.clone() for w in clean]
    for which, w in enumerate(dirty):
        for slot, r in enumerate(slot_ranks):
            _dirty_past_rank(w, which, slot, r)
    slots = (torch.arange(num_tokens, device="cuda") % 9 - 1).to(torch.int32)  # -1, 0, ..., 7
    plan = default_plan(num_tokens, q["top_k"], decode=False, lora=plan_of == "lora")
    out = fused_moe(x, w13, w2, weights, ids, MoELoRAArgs(slots, ranks, *dirty), plan=plan)
    n = min(num_tokens, 128)  # the per-pair reference is slow: rows are independent
    ref = fused_moe_ref(x[:n], w13, w2, weights[:n], ids[:n],
                        MoELoRAArgs(slots[:n], ranks, *clean))
    assert torch.isfinite(out).all()
    assert _rel(out[:n], ref) < 1e-2
    base = fused_moe(x, w13, w2, weights, ids, plan=plan)
    ref_base = fused_moe_ref(x[:n], w13, w2, weights[:n], ids[:n])
    assert _size_ratio(ref - ref_base, ref_base) > 0.3
    assert _rel(out[:n] - base[:n], ref - ref_base) < 2e-2
    no_adapter = [t for t, s in enumerate(slots.tolist()) if s < 0 or slot_ranks[s] == 0]
    assert torch.equal(_bits16(out[no_adapter]), _bits16(base[no_adapter]))


def _bits16(t):
    return t.contiguous().view(torch.int16)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("num_tokens", [512, 2048])
def test_gpu_align_matches_reference_at_scale(num_tokens):
    gen = torch.Generator("cuda").manual_seed(num_tokens)
    _, ids = _route(num_tokens, 128, 8, gen, device="cuda")
    for chunk in (4096, 1024, 256, 64):
        for block_m in (16, 64):
            for self_count in (False, True):
                ours = moe_align(ids, 128, block_m, chunk=chunk, self_count=self_count)
                _assert_same_alignment(ours, moe_align_ref(ids, 128, block_m), ids.numel())


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("num_tokens", [4, 64, 256])
def test_gpu_fused_moe_cuda_graph_replay(num_tokens):
    """Capture once, replay with new inputs, routing and adapter slots."""
    x, w13, w2, weights, ids, lora = _qwen3_problem(num_tokens, 99, with_lora=True)
    static = dict(x=x.clone(), weights=weights.clone(), ids=ids.clone(),
                  slots=lora.token_slots.clone())
    static_lora = MoELoRAArgs(static["slots"], lora.slot_ranks, lora.gate_up_a, lora.gate_up_b,
                              lora.down_a, lora.down_b)

    def run(with_lora):
        return fused_moe(static["x"], w13, w2, static["weights"], static["ids"],
                         static_lora if with_lora else None)

    graphs = {}
    for with_lora in (False, True):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run(with_lora)  # compile and warm up outside capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run(with_lora)
        graphs[with_lora] = (graph, out)

    for seed in (1, 2):
        x2, _, _, weights2, ids2, lora2 = _qwen3_problem(num_tokens, 1000 + seed, with_lora=True)
        slots2 = lora2.token_slots.roll(seed)
        static["x"].copy_(x2)
        static["weights"].copy_(weights2)
        static["ids"].copy_(ids2)
        static["slots"].copy_(slots2)
        for with_lora in (True, False):  # alternate variants
            graph, out = graphs[with_lora]
            graph.replay()
            lora_now = static_lora if with_lora else None
            eager = fused_moe(x2, w13, w2, weights2, ids2, lora_now)
            torch.testing.assert_close(out, eager, rtol=0, atol=0)
            ref = fused_moe_ref(x2, w13, w2, weights2, ids2, lora_now)
            assert _rel(out, ref) < 1e-2


# --------------------------------------------------------------------------------------------
# plans: grouped block order, tiles fitted to the dtype, the tuned table


@pytest.mark.parametrize("with_lora", [False, True], ids=["base", "lora"])
def test_sorted_grouped_block_order_matches_reference(with_lora):
    """group_m > 1 walks several expert blocks per N tile (3 does not divide the block count: a short last group)."""
    problem, ranks, slots, clean, _ = _mixed_lora_problem(40, 32, 48, seed=7)  # 80 pairs: 6+ blocks of 16
    lora = MoELoRAArgs(slots, ranks, *clean) if with_lora else None
    tile = replace(SMALL_TILE, group_m=3)
    out = fused_moe(*problem, lora, plan=replace(SMALL_PLAN, gate_up=tile, down=tile))
    assert _rel(out, fused_moe_ref(*problem, lora)) < FP32_TOL
    # block order changes which program runs a tile, never its arithmetic
    assert torch.equal(out, fused_moe(*problem, lora, plan=SMALL_PLAN))


def test_sorted_weights_read_by_tma_descriptors_match_pointer_loads():
    """weights_tma reads the same weight tiles through descriptors over [E * N, K]: bitwise the pointer plan, with
    and without LoRA, where N tiles run past an expert's rows (32-column tiles of 2I = 80 and H = 48) and K steps
    past K (I = 40)."""
    problem, ranks, slots, clean, _ = _mixed_lora_problem(28, 48, 40, seed=5)
    tile = replace(SMALL_TILE, block_n=32)
    pointers = replace(SMALL_PLAN, gate_up=tile, down=tile)
    for lora in (None, MoELoRAArgs(slots, ranks, *clean)):
        out = fused_moe(*problem, lora, plan=replace(pointers, weights_tma=True))
        assert torch.equal(out, fused_moe(*problem, lora, plan=pointers))
        assert _rel(out, fused_moe_ref(*problem, lora)) < FP32_TOL
    # weights a descriptor cannot read (not contiguous) take the pointer loads: same result
    x, w13, w2, *rest = problem
    w13_strided = w13.transpose(1, 2).contiguous().transpose(1, 2)
    assert not tma_readable(w13_strided)
    out = fused_moe(x, w13_strided, w2, *rest, plan=replace(pointers, weights_tma=True))
    assert torch.equal(out, fused_moe(*problem, plan=pointers))


H200_SMEM = 232448  # bytes one program may use (opt-in) on the H100 / H200


@pytest.mark.parametrize("num_tokens", [16, 64, 256, 1024, 8192])
def test_every_plan_fits_shared_memory_in_every_dtype(num_tokens):
    for lora in (False, True):
        plan = default_plan(num_tokens, 8, lora=lora)
        for dtype in (torch.float32, torch.bfloat16):
            elt = torch.empty((), dtype=dtype).element_size()
            down_loads = 2 if plan.fused_act else 1
            gate_up = moe_plan.fit_tile(plan.gate_up, elt, 1, H200_SMEM)
            down = moe_plan.fit_tile(plan.down, elt, down_loads, H200_SMEM)
            for tile, loads in ((gate_up, 1), (down, down_loads)):
                assert moe_plan.tile_smem(tile, elt, loads) <= H200_SMEM - moe_plan.SMEM_MARGIN
            if dtype == torch.bfloat16 and not plan.decode:  # the tuned bf16 tiles already fit: unchanged
                assert (gate_up, down) == (plan.gate_up, plan.down)
            assert gate_up.block_m == down.block_m  # one alignment serves both


def test_fp32_down_tile_that_overflowed_the_h200_is_shrunk():
    """The tile whose fp32 down GEMM asked for 262,144 bytes of shared memory (limit 232,448)."""
    tile = GemmTile(block_m=16, block_n=128, block_k=128, num_warps=4, num_stages=3)
    assert moe_plan.tile_smem(tile, 4, 2) + moe_plan.SMEM_MARGIN > H200_SMEM
    fitted = moe_plan.fit_tile(tile, 4, 2, H200_SMEM)
    assert fitted.num_stages == 2 and fitted.block_k == 128 and fitted.block_n == 128


def test_tuned_table_lookup(tmp_path):
    problem = moe_plan.MoEProblem(128, 2048, 768, 8, torch.bfloat16, torch.device("cpu"))
    entry = {"device": "GPU X", "dtype": "bfloat16", "experts": 128, "hidden": 2048, "inter": 768, "top_k": 8,
             "tiles": [{"max_tokens": 512, "gate_up": [64, 128, 64, 4, 3, 1], "down": [64, 128, 64, 4, 3, 1]},
                       {"max_tokens": 64, "gate_up": [16, 128, 128, 4, 3, 1], "down": [16, 64, 128, 4, 3, 1]}]}
    path = tmp_path / "tiles.json"
    path.write_text(json.dumps({"version": 1, "entries": [entry]}))
    table = moe_plan._read_table(path)
    pick = lambda t, name="GPU X": moe_plan.tuned_tiles(t, problem, name, table)  # noqa: E731
    assert pick(10)[1] == GemmTile(16, 64, 128, 4, 3, 1)  # rows sorted by max_tokens
    assert pick(10)[2] == {}
    assert pick(64)[0].block_m == 16 and pick(65)[0].block_m == 64 and pick(9999)[0].block_m == 64
    assert pick(10, "GPU Y") is None and pick(10, None) is None
    other = moe_plan.MoEProblem(64, 2048, 768, 8, torch.bfloat16, torch.device("cpu"))
    assert moe_plan.tuned_tiles(10, other, "GPU X", table) is None


def test_table_rows_carry_lora_shrink_options(tmp_path, monkeypatch):
    """A row's LoRA shrink options reach the plans of LoRA calls at its token counts (integers, over the heuristic's
    unsplit shrinks); a row without them leaves the heuristic's; the tiles stay the no-LoRA call's."""
    problem = moe_plan.MoEProblem(128, 2048, 768, 8, torch.bfloat16, torch.device("cpu"))
    entry = {"device": "GPU X", "dtype": "bfloat16", "experts": 128, "hidden": 2048, "inter": 768, "top_k": 8,
             "tiles": [{"max_tokens": 256, "gate_up": [16, 128, 128, 4, 3, 1], "down": [16, 128, 128, 4, 3, 1]},
                       {"max_tokens": 512, "gate_up": [64, 128, 64, 4, 3, 1], "down": [64, 128, 64, 4, 3, 1],
                        "lora_shrink_lanes": 2, "lora_down_splits": 3, "lora_shrink_stages": 4}]}
    path = tmp_path / "tiles.json"
    path.write_text(json.dumps({"version": 1, "entries": [entry]}))
    monkeypatch.setenv(moe_plan.TABLE_ENV, str(path))
    monkeypatch.setattr(moe_plan, "gpu_name", lambda device_: "GPU X")
    moe_plan.default_plan.cache_clear()
    try:
        plan = lambda t, lora: moe_plan.default_plan(t, 8, problem=problem, lora=lora)  # noqa: E731
        tuned = plan(400, True)
        assert (tuned.lora_shrink_lanes, tuned.lora_down_splits, tuned.lora_shrink_stages) == (2, 3, 4)
        assert tuned.lora_gate_up_splits == 1 and tuned.gate_up == plan(400, False).gate_up
        assert type(tuned.lora_shrink_lanes) is int
        heuristic = moe_plan.heuristic_plan(200, 8, lora=True)
        fields = ("lora_shrink_lanes", "lora_down_splits", "lora_shrink_stages", "lora_shrink_warps")
        assert [getattr(plan(200, True), f) for f in fields] == [getattr(heuristic, f) for f in fields]
    finally:
        moe_plan.default_plan.cache_clear()


def test_heuristic_lora_plans_run_the_no_lora_tiles():
    """Problems the table does not hold (other GPUs, other shapes): a LoRA call's plan is the no-LoRA call's with the
    shrinks unsplit at every sorted size, so a row without an adapter in a mixed batch gets the LoRA-disabled
    engine's bits (the tiles once differed at 513-2,048 pairs, where LoRA calls kept K steps of 128)."""
    for top_k in (8, 2):
        for tokens in range(1, 4097, 7):
            base, lora = (moe_plan.heuristic_plan(tokens, top_k, lora=flag) for flag in (False, True))
            assert (lora.decode, lora.gate_up, lora.down, lora.y_fp32, lora.fused_act) == (
                base.decode, base.gate_up, base.down, base.y_fp32, base.fused_act), (top_k, tokens)
            assert lora == (base if base.decode else replace(base, **moe_plan.LORA_SHRINKS_UNSPLIT)), (top_k, tokens)


def test_lora_calls_run_the_tuned_no_lora_tiles(monkeypatch):
    """Where the table has the problem, a LoRA call runs the no-LoRA call's tiles and options (so its rows without an
    adapter are the no-LoRA call's), the shrinks unsplit, at every size of the sorted path."""
    h200 = moe_plan.tile_table()
    (device, key), rows = next(iter(h200.items()))
    problem = moe_plan.MoEProblem(*key[:4], getattr(torch, key[4]), torch.device("cpu"))
    monkeypatch.setattr(moe_plan, "gpu_name", lambda device_: device)
    moe_plan.default_plan.cache_clear()
    try:
        top_k = key[3]
        for tokens in (moe_plan.DECODE_MAX_PAIRS // top_k + 1, *(row[0] for row in rows), rows[-1][0] * 2):
            base, lora = (moe_plan.default_plan(tokens, top_k, problem=problem, lora=flag) for flag in (False, True))
            if base.decode:
                continue
            row = min((r for r in rows if r[0] >= tokens), key=lambda r: r[0], default=rows[-1])
            splits = (row[3].get("lora_gate_up_splits", 1), row[3].get("lora_down_splits", 1))
            assert not lora.decode and (lora.lora_gate_up_splits, lora.lora_down_splits) == splits, tokens
            assert (lora.gate_up, lora.down, lora.y_fp32, lora.fused_act, lora.weights_tma) == (
                base.gate_up, base.down, base.y_fp32, base.fused_act, base.weights_tma), tokens
    finally:
        moe_plan.default_plan.cache_clear()


FP8_LABELS = {"fp8_w8a8": 1, "fp8_w": 2}  # FP8 rows: the A operand's bytes (fp8 under W8A8, else the activations')


def test_shipped_table_parses_and_fits():
    for (device, key), rows in moe_plan.tile_table().items():
        elt = FP8_LABELS.get(key[-1]) or torch.empty((), dtype=getattr(torch, key[-1])).element_size()
        for _, gate_up, down, options in rows:
            assert set(options) <= set(moe_plan.PLAN_OPTIONS) | set(moe_plan.LORA_OPTIONS)
            assert gate_up.block_m == down.block_m, (device, key)
            down_loads = 2 if options.get("fused_act", True) else 1
            assert moe_plan.tile_smem(gate_up, elt, 1) <= H200_SMEM - moe_plan.SMEM_MARGIN
            assert moe_plan.tile_smem(down, elt, down_loads) <= H200_SMEM - moe_plan.SMEM_MARGIN
            # the plan a call runs is the tuned one: fitting changes nothing
            for tile, loads in ((gate_up, 1), (down, down_loads)):
                assert moe_plan.fit_tile(tile, elt, loads, H200_SMEM) == tile, (device, key)


# fp16: every option pair (y kept in fp16 or fp32, SiLU*up fused or apart). fp32 activations make y_fp32 moot (y is
# fp32 either way) and the fused default runs in every other fp32 test: the act kernel is the one fp32 case left, at
# the fp32 bound.
@pytest.mark.parametrize("y_fp32,fused_act,dtype", [
    pytest.param(False, True, torch.float16, id="False-True-fp16"),
    pytest.param(True, False, torch.float16, id="True-False-fp16"),
    pytest.param(False, False, torch.float16, id="False-False-fp16"),
    pytest.param(False, False, torch.float32, id="False-False-fp32"),
])
def test_sorted_plan_options_match_reference(y_fp32, fused_act, dtype):
    """Top-k partial sums kept in the activations' dtype, SiLU*up by its own kernel: with and without LoRA."""
    problem, ranks, slots, clean, _ = _mixed_lora_problem(24, 64, 32, seed=3)
    problem = [t.to(dtype) if t.is_floating_point() and i < 3 else t for i, t in enumerate(problem)]
    pool = [w.to(dtype) for w in clean]
    plan = replace(SMALL_PLAN, y_fp32=y_fp32, fused_act=fused_act)
    bound = FP32_TOL if dtype == torch.float32 else 5e-3
    for lora in (None, MoELoRAArgs(slots, ranks, *pool)):
        out = fused_moe(*problem, lora, plan=plan)
        assert out.dtype == dtype
        assert _rel(out, fused_moe_ref(*problem, lora)) < bound
