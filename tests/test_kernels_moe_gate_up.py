"""Separate gate and up A's on routed experts (lora_separate_gate_up): both Triton paths against
the fp32 per-pair reference and the torch MoE backend, in batches that mix slots with one gate_up
A and slots with a gate A and an up A.

CPU: tiny fp32 shapes under the Triton interpreter. GPU (marked `gpu`): bf16 at Qwen3-30B-A3B shapes.
"""

import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any module with @triton.jit is imported


import pytest  # noqa: E402

from moeserve.kernels import moe_lora  # noqa: E402
from moeserve.kernels.fused_moe import MoELoRAArgs, fused_moe, fused_moe_ref  # noqa: E402
from moeserve.kernels.moe_plan import GemmTile, MoEPlan, default_plan  # noqa: E402
from moeserve.kernels.moe_align import moe_align  # noqa: E402
from moeserve.layers.batch import LoRABatch  # noqa: E402
from moeserve.layers.moe import ExpertLoRABuffers, moe_experts_torch  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# a rank-16 pool: separate rank 8 and 16, one-A rank 16 and 8, an empty separate-flagged slot
RANKS = [8, 16, 16, 8, 0]
SEPARATE = [1, 0, 1, 0, 1]
SLOTS = [0, 1, -1, 2, 3, 4, 1, 0]  # cycled over the tokens; -1 and slot 4 (rank 0) have no adapter
# small tiles: several N tiles per half, K steps and shrink splits; I = 40 puts a tile across gate and up
SMALL_TILE = GemmTile(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=1)
SORTED_PLAN = MoEPlan(False, SMALL_TILE, SMALL_TILE, lora_shrink_block_k=16, lora_gate_up_splits=3,
                      lora_down_splits=2, lora_shrink_lanes=2)
DECODE_PLAN = MoEPlan(True, SMALL_TILE, SMALL_TILE)


def _rel(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def _bits(t):
    return t.contiguous().view(torch.int32 if t.element_size() == 4 else torch.int16)


def make_problem(num_tokens, top_k, num_experts, hidden, inter, seed, ranks=RANKS, separate=SEPARATE,
                 max_rank=16, dtype=torch.float32, std=0.3, w_std=None, device=DEV):
    """Returns (x, w13, w2, weights, ids), slots, (clean, dirty) MoELoRAArgs. Clean: zeros beyond each rank and in
    up_a of slots with one A, as the slot pool keeps them. Dirty: NaN there, and in every slot of rank 0."""
    gen = torch.Generator(device).manual_seed(seed)

    def rand(*shape, s):
        return (torch.randn(*shape, generator=gen, device=device) * s)

    x = rand(num_tokens, hidden, s=1.0)
    w13 = rand(num_experts, 2 * inter, hidden, s=w_std or 1.2 / hidden ** 0.5)  # default: activations of size ~1
    w2 = rand(num_experts, hidden, inter, s=w_std or 1.2 / inter ** 0.5)
    weights, ids = torch.softmax(rand(num_tokens, num_experts, s=1.0), -1).topk(top_k, -1)
    n = len(ranks)
    ga, ua, gb = rand(n, num_experts, max_rank, hidden, s=std), rand(n, num_experts, max_rank, hidden, s=std), \
        rand(n, num_experts, 2 * inter, max_rank, s=std)
    da, db = rand(n, num_experts, max_rank, inter, s=std), rand(n, num_experts, hidden, max_rank, s=std)
    clean = [ga, gb, da, db, ua]
    dirty = [w.clone() for w in clean]
    for s, r in enumerate(ranks):
        for w, d in zip(clean, dirty):
            cols = (slice(None), slice(r, None)) if w.shape[-1] in (hidden, inter) else (Ellipsis, slice(r, None))
            w[s][cols] = 0
            d[s][cols] = float("nan")
            if w.shape[-1] not in (hidden, inter):  # a B: its next 16-column step is read, times a shrink of 0
                d[s][..., r:r + -r % 16] = 7.0
            if r == 0:
                d[s] = float("nan")
        if not separate[s]:  # one A: the up half is never written by the pool, never read by the kernels
            ua[s] = 0
            dirty[4][s] = float("nan")
    ranks_t = torch.tensor(ranks, dtype=torch.int32, device=device)
    sep_t = torch.tensor(separate, dtype=torch.int32, device=device)
    slots = torch.tensor([SLOTS[t % len(SLOTS)] for t in range(num_tokens)], dtype=torch.int32, device=device)

    def args(ws):
        ga, gb, da, db, ua = (w.to(dtype) for w in ws)
        return MoELoRAArgs(slots, ranks_t, ga, gb, da, db, ua, sep_t)

    return (x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids.to(torch.int32)), slots, args(clean), args(dirty)


def _one_a(lora):
    """The same pool read as if every slot had one A (up_a ignored): what a kernel that skipped up_a would give."""
    return MoELoRAArgs(lora.token_slots, lora.slot_ranks, lora.gate_up_a, lora.gate_up_b, lora.down_a, lora.down_b)


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "sorted"])
@pytest.mark.parametrize("shape", [(8, 64, 32), (10, 48, 40)], ids=["H64I32", "H48I40"])
def test_separate_and_one_a_slots_in_one_batch_match_references(shape, decode):
    """Ranks 8/16 in a rank-16 pool, separate and one-A slots side by side, tokens without an adapter and on an
    empty slot; NaN wherever the kernels must not read (beyond ranks, the up half of one-A slots, empty slots).
    Against fp32 fused_moe_ref and the torch MoE backend; rows without an adapter bitwise the no-LoRA kernel's."""
    num_tokens, hidden, inter = shape
    problem, slots, clean, dirty = make_problem(num_tokens, 2, 4, hidden, inter, seed=num_tokens)
    plan = DECODE_PLAN if decode else SORTED_PLAN
    out = fused_moe(*problem, dirty, plan=plan)
    ref = fused_moe_ref(*problem, clean)
    assert torch.isfinite(out).all()
    assert _rel(out, ref) < 1e-5
    active = tuple(s for s in sorted(set(slots.tolist())) if s >= 0 and RANKS[s] > 0)
    torch_ref = moe_experts_torch(*problem, LoRABatch(slots, clean.slot_ranks, active), ExpertLoRABuffers(
        clean.gate_up_a, clean.gate_up_b, clean.down_a, clean.down_b, clean.up_a, clean.gate_up_separate))
    assert _rel(out, torch_ref) < 1e-5
    base = fused_moe(*problem, plan=plan)
    ref_base = fused_moe_ref(*problem)
    ignored_up = fused_moe_ref(*problem, _one_a(clean))
    for t, s in enumerate(slots.tolist()):
        if s < 0 or RANKS[s] == 0:
            assert torch.equal(_bits(out[t]), _bits(base[t])), t
            continue
        assert _rel(ref[t] - ref_base[t], ref_base[t]) > 0.1, "the test adapters must matter"
        assert _rel(out[t] - base[t], ref[t] - ref_base[t]) < 1e-4, t
        if SEPARATE[s]:  # the up A matters: a kernel that ignored it would fail here
            assert _rel(ignored_up[t], ref[t]) > 1e-2, t


def test_slot_reloaded_from_separate_to_one_a_and_back():
    """The same buffers, changed in place between calls as the slot pool does (a captured graph sees the same
    tensors): slot 0 goes from separate A's to one A (its up half poisoned) and back; both paths follow."""
    problem, slots, clean, dirty = make_problem(10, 2, 4, 48, 40, seed=3)
    gen = torch.Generator(DEV).manual_seed(4)
    for step, separate in enumerate((0, 1)):
        for lora in (clean, dirty):  # a new adapter in slot 0, rank 16
            for w in (lora.gate_up_a, lora.gate_up_b, lora.down_a, lora.down_b):
                w[0].copy_(torch.randn(w[0].shape, generator=torch.Generator(DEV).manual_seed(10 + step)) * 0.3)
            lora.up_a[0].copy_(torch.randn(lora.up_a[0].shape, generator=gen) * 0.3 if separate else
                               torch.full_like(lora.up_a[0], 0.0 if lora is clean else float("nan")))
            lora.slot_ranks[0] = 16
            lora.gate_up_separate[0] = separate
        dirty.up_a[0].copy_(clean.up_a[0]) if separate else None
        ref = fused_moe_ref(*problem, clean)
        for plan in (DECODE_PLAN, SORTED_PLAN):
            out = fused_moe(*problem, dirty, plan=plan)
            assert torch.isfinite(out).all() and _rel(out, ref) < 1e-5, (separate, plan)


def test_up_halves_walked_over_several_rank_steps():
    """The sorted path's epilogue on a pool with up A's and ranks above one rank step: its gate_up GEMM walks each
    separate slot's gate and up halves, step by step up to the slot's rank (lora_block_expand), into the
    accumulator. Ranks 8/16/64 in a rank-64 pool (rank 64: four steps a half), separate and one-A slots, an empty
    separate-flagged slot, rows without an adapter; NaN wherever nothing may be read. Against the fp32 reference."""
    ranks, separate = [8, 16, 64, 8, 0], [1, 0, 1, 0, 1]
    problem, slots, clean, dirty = make_problem(16, 2, 4, 48, 40, seed=21, ranks=ranks, separate=separate,
                                                max_rank=64, std=0.15)
    plan = SORTED_PLAN
    out = fused_moe(*problem, dirty, plan=plan)
    ref = fused_moe_ref(*problem, clean)
    assert torch.isfinite(out).all()
    assert _rel(out, ref) < 1e-5
    assert _rel(ref, fused_moe_ref(*problem, _one_a(clean))) > 1e-2, "the up A's must matter"
    base = fused_moe(*problem, plan=plan)
    ref_base = fused_moe_ref(*problem)
    assert _rel(out - base, ref - ref_base) < 1e-4
    no_adapter = [t for t, s in enumerate(slots.tolist()) if s < 0 or ranks[s] == 0]
    assert no_adapter and torch.equal(_bits(out[no_adapter]), _bits(base[no_adapter]))


@pytest.mark.parametrize("lanes", [1, 2])
def test_block_shrink_up_half_matches_twin(lanes):
    """lora_block_shrink with up_a: half 0 as without it, half 1 written for the rows of separate slots only
    (against lora_block_shrink_ref); nothing else of the buffer is written."""
    problem, slots, clean, dirty = make_problem(20, 2, 3, 48, 40, seed=5)
    x, _, _, _, ids = problem
    aligned = moe_align(ids, 3, 16)
    splits = 3
    out = torch.full((2, splits, aligned.sorted_ids.numel(), 16), float("nan"), device=DEV)
    moe_lora.lora_block_shrink(x, dirty.gate_up_a, aligned, dirty, 2, from_gate_up=False, block_k=16,
                               splits=splits, lanes=lanes, up_a=dirty.up_a, out=out)
    written = torch.zeros_like(out, dtype=torch.bool)
    for half, up_a in enumerate((None, clean.up_a)):
        twin = moe_lora.lora_block_shrink_ref(x, clean.gate_up_a, aligned, clean, 2, from_gate_up=False, up_a=up_a)
        assert len(twin) > 4
        for row, want in twin.items():
            r = want.numel()
            torch.testing.assert_close(out[half, :, row, :r].sum(0), want, rtol=1e-5, atol=1e-5)
            written[half, :, row, :r] = True
    assert out[~written].isnan().all()


# --------------------------------------------------------------------------------------------
# GPU: bf16 at Qwen3-30B-A3B shapes

@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("num_tokens", [1, 8, 64, 256, 512])
def test_gpu_separate_gate_up_bf16_qwen3_shapes(num_tokens):
    """8 slots, max rank 16: separate rank 16 and 8, one-A rank 16 and 8, empty slots; NaN where nothing may be
    read; default plans (both paths)."""
    ranks, separate = [16, 8, 16, 8, 0, 16, 0, 16], [1, 1, 0, 0, 1, 1, 0, 0]
    problem, slots, clean, dirty = make_problem(num_tokens, 8, 128, 2048, 768, seed=30 + num_tokens, ranks=ranks,
                                                separate=separate, dtype=torch.bfloat16, std=0.07, w_std=0.02,
                                                device="cuda")
    n = min(num_tokens, 64)  # the per-pair reference is slow: rows are independent
    sub = lambda lora: MoELoRAArgs(lora.token_slots[:n], *[getattr(lora, f) for f in (  # noqa: E731
        "slot_ranks", "gate_up_a", "gate_up_b", "down_a", "down_b", "up_a", "gate_up_separate")])
    x, w13, w2, weights, ids = problem
    ref = fused_moe_ref(x[:n], w13, w2, weights[:n], ids[:n], sub(clean))
    ref_base = fused_moe_ref(x[:n], w13, w2, weights[:n], ids[:n])
    for decode in (None, True, False) if num_tokens <= 8 else (None,):
        plan = default_plan(num_tokens, 8, decode)
        out = fused_moe(*problem, dirty, plan=plan)
        base = fused_moe(*problem, plan=plan)
        assert torch.isfinite(out).all()
        assert _rel(out[:n], ref) < 1e-2, decode
        assert _rel(out[:n] - base[:n], ref - ref_base) < 2e-2, decode
        no_adapter = [t for t, s in enumerate(slots.tolist()) if s < 0 or ranks[s] == 0]
        assert torch.equal(_bits(out[no_adapter]), _bits(base[no_adapter]))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("num_tokens", [4, 64, 256])
def test_gpu_separate_gate_up_cuda_graph_replay_after_slot_reload(num_tokens):
    """Capture once (decode path at 4 tokens, sorted above); then slot 0 is reloaded in place from separate A's to
    one A (its up half poisoned) and back, as the slot pool does after capture; every replay equals eager."""
    ranks, separate = [16, 8, 16, 8, 0, 16, 0, 16], [1, 1, 0, 0, 1, 1, 0, 0]
    problem, slots, clean, dirty = make_problem(num_tokens, 8, 128, 2048, 768, seed=40 + num_tokens, ranks=ranks,
                                                separate=separate, dtype=torch.bfloat16, std=0.07, w_std=0.02,
                                                device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fused_moe(*problem, dirty)  # compile and warm up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(*problem, dirty)
    saved_up = dirty.up_a[0].clone()
    for flag in (1, 0, 1):
        dirty.gate_up_separate[0] = flag
        dirty.up_a[0].copy_(saved_up if flag else torch.full_like(saved_up, float("nan")))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.isfinite(out).all(), flag
        assert torch.equal(out, fused_moe(*problem, dirty)), flag
