"""Routing kernels (softmax + top-k + renorm + cast, with and without the router GEMM) against the plain-torch
routing, for every family's flags. CPU: fp32 under the Triton interpreter; GPU (marked `gpu`): bf16 and
CUDA-graph replay. Random logits have no ties, so ids must be identical; one test pins the tie rule, and the
packed-key selection is checked bit for bit against the three-reduction one on logits full of ties (-0.0 and
+0.0 among them), against a stable-sort reference, and on -inf and NaN logits."""
import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any module with @triton.jit is imported

import pytest  # noqa: E402

from moeserve.kernels.router import (  # noqa: E402
    NO_EXPERT,
    RouterTile,
    counter_slots,
    fused_gemm_topk,
    fused_topk,
    fused_topk_ref,
)
from moeserve.exec_options import ExecOptions  # noqa: E402
from moeserve.layers.batch import LoRABatch  # noqa: E402
from moeserve.layers.moe import MoEBlock  # noqa: E402
from moeserve.model_spec import ModelSpec  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu  # skipped without CUDA (conftest); selected by `-m gpu`


def family_flags(family: str, norm_topk_prob: bool) -> tuple[bool, bool]:
    """(renormalize, fp32 weights) as ModelSpec derives them from an HF config of the family."""
    cfg = {"model_type": family, "vocab_size": 32, "hidden_size": 16, "num_hidden_layers": 1,
           "num_attention_heads": 2, "num_experts": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
           "intermediate_size": 16, "norm_topk_prob": norm_topk_prob}
    spec = ModelSpec.from_hf_config(cfg)
    return spec.norm_topk_prob, spec.router_weights_fp32


# every (renormalize, fp32 weights) combination the families produce
FLAGS = sorted({family_flags(f, n) for f in ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral") for n in (False, True)})


def test_family_flags_cover_renorm_and_fp32():
    assert FLAGS == [(False, False), (True, False), (True, True)]


def _check(out, ref, atol=1e-6):
    (w, ids), (rw, rids) = out, ref
    assert ids.dtype == torch.int32 and w.dtype == rw.dtype
    assert torch.equal(ids.long(), rids)
    torch.testing.assert_close(w.float(), rw.float(), atol=atol, rtol=1e-5)


# The kernels' paths are set by three independent choices: E (8 and 128 fill their power-of-two tile, 60 leaves masked
# columns; in the GEMM kernel E 8 is one program per row block, 60 and 128 spread a row over 4 and 8 programs and
# meet through the arrival counters), top_k (the unrolled pick loop's length, 1 up to all 8 of E 8) and the family
# flags (RENORMALIZE on/off, fp32 or fp16 stores). No code path depends on two of them together, so every pair of
# values is run once (12 cases: top_k x E, the flags cycling so each flag setting meets each E and each top_k)
# instead of all 36 combinations, which ran each of those paths three times over.
PAIRWISE = [(e, k, *FLAGS[(i + j) % len(FLAGS)]) for i, e in enumerate((8, 60, 128)) for j, k in enumerate((1, 2, 4, 8))]


def test_pairwise_cases_cover_every_pair():
    assert len(PAIRWISE) == 12
    assert {(e, k) for e, k, _, _ in PAIRWISE} == {(e, k) for e in (8, 60, 128) for k in (1, 2, 4, 8)}
    assert {(e, (r, f)) for e, _, r, f in PAIRWISE} == {(e, f) for e in (8, 60, 128) for f in FLAGS}
    assert {(k, (r, f)) for _, k, r, f in PAIRWISE} == {(k, f) for k in (1, 2, 4, 8) for f in FLAGS}


@pytest.mark.parametrize("num_experts,top_k,renorm,fp32", PAIRWISE)
def test_fused_topk_matches_torch(num_experts, top_k, renorm, fp32):
    gen = torch.Generator().manual_seed(num_experts * 10 + top_k)
    out_dtype = torch.float32 if fp32 else torch.float16  # "cast to the activation dtype" (fp16: exact on CPU)
    for num_tokens, block_t in ((1, 1), (5, 1), (33, 4)):
        logits = (torch.randn(num_tokens, num_experts, generator=gen) * 3).to(DEV)
        out = fused_topk(logits, top_k, renorm, out_dtype, block_t=block_t)
        _check(out, fused_topk_ref(logits, top_k, renorm, out_dtype), atol=1e-3 if not fp32 else 1e-6)


# E 8 runs as one program per row block (no counters); E 60 and 128 spread a row over 4 and 8 programs. The
# stores are fp32 here whatever the flag (the full product ran the fp32/fp16 flag cases twice alike).
@pytest.mark.parametrize("num_experts,top_k,renorm,fp32", PAIRWISE)
def test_fused_gemm_topk_matches_torch(num_experts, top_k, renorm, fp32):
    gen = torch.Generator().manual_seed(1000 + num_experts * 10 + top_k)
    hidden = 48  # not a multiple of block_h: masked tail
    weight = (torch.randn(num_experts, hidden, generator=gen) * 0.2).to(DEV)
    tile = RouterTile(block_t=4, block_e=16, block_h=32)
    counters = torch.zeros(counter_slots(33), dtype=torch.int32, device=DEV)
    for num_tokens in (1, 5, 33):
        x = torch.randn(num_tokens, hidden, generator=gen).to(DEV)
        out = fused_gemm_topk(x, weight, top_k, renorm, torch.float32, counters=counters, tile=tile)
        _check(out, fused_topk_ref(x @ weight.t(), top_k, renorm, torch.float32), atol=2e-6)
        assert not counters.any()  # left zero for the next launch


def test_default_tiles():
    gen = torch.Generator().manual_seed(11)
    weight = torch.randn(60, 40, generator=gen) * 0.2
    for num_tokens in (5, 33):  # one row per program; four rows per program
        x = torch.randn(num_tokens, 40, generator=gen)
        _check(fused_gemm_topk(x, weight, 4, False, torch.float32),
               fused_topk_ref(x @ weight.t(), 4, False, torch.float32), atol=2e-6)


def test_fused_gemm_topk_adds_the_logits_delta():
    """A router LoRA's delta moves experts: the kernel routes x W^T + delta, not x W^T."""
    gen = torch.Generator().manual_seed(7)
    x, weight = torch.randn(5, 40, generator=gen), torch.randn(60, 40, generator=gen) * 0.2
    delta = torch.randn(5, 60, generator=gen) * 3
    out = fused_gemm_topk(x, weight, 4, True, torch.float32, logits_delta=delta, tile=RouterTile(block_h=16))
    _check(out, fused_topk_ref(x @ weight.t() + delta, 4, True, torch.float32), atol=2e-6)
    assert not torch.equal(out[1].long(), fused_topk_ref(x @ weight.t(), 4, True, torch.float32)[1])


def test_ties_go_to_the_lowest_index():
    """The rule the kernels pin (torch.topk promises none): equal logits are taken lowest expert first."""
    logits = torch.tensor([[0.5, 2.0, 2.0, -1.0, 2.0, 1.0, 1.0, 0.0],
                           [3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0]])
    w, ids = fused_topk(logits, 4, False, torch.float32)
    assert ids.tolist() == [[1, 2, 4, 5], [0, 1, 2, 3]]
    torch.testing.assert_close(w, torch.softmax(logits, -1).gather(1, ids.long()))
    # equal router rows give exactly equal logits through the GEMM too, also split across programs
    gen = torch.Generator().manual_seed(3)
    x = torch.rand(2, 16, generator=gen) + 0.5
    weight = torch.randn(16, 16, generator=gen) * 0.1
    weight[14] = weight[9] = weight[2] = torch.rand(16, generator=gen) + 1  # the largest logit, three times
    _, ids = fused_gemm_topk(x, weight, 3, True, torch.float32, tile=RouterTile(block_e=4, block_h=16))
    assert ids.tolist() == [[2, 9, 14]] * 2


def lowest_first_ref(logits, top_k, renorm, out_dtype):
    """The routing with the tie rule made explicit: a stable descending sort takes equal logits (-0.0 and +0.0
    included) lowest index first, and -inf after every finite logit; weights from torch's fp32 softmax."""
    ids = torch.sort(logits.float(), dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = torch.softmax(logits.float(), dim=-1).gather(1, ids)
    if renorm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(out_dtype), ids


def tied_logits(num_tokens, num_experts, gen, zero_on_top=False):
    """Logits on a coarse grid (many exact ties), zeros of both signs; `zero_on_top`: zero is the largest logit
    (top-k picks among +0.0 and -0.0)."""
    logits = torch.randint(-6, 6, (num_tokens, num_experts), generator=gen) * 0.5
    if zero_on_top:
        logits = logits.clamp(max=0.0)
    negative_zero = torch.rand(num_tokens, num_experts, generator=gen) < 0.5
    return torch.where((logits == 0) & negative_zero, -0.0, logits)


def _same_bits(a, b):
    (w, ids), (w0, ids0) = a, b
    assert torch.equal(ids, ids0)
    assert w.dtype == w0.dtype and torch.equal(w.view(torch.uint8), w0.view(torch.uint8))


# (renormalize, out dtype, rows per program); bf16 only as the output cast (the interpreter's bf16 arithmetic is off)
SELECTION_CASES = [(False, torch.float32, 1), (True, torch.float32, 4), (True, torch.float16, 1),
                   (False, torch.bfloat16, 4), (True, torch.bfloat16, 1)]


# As PAIRWISE: E (its power-of-two tile, masked columns at 60) and top_k (the pick loop's length) set independent
# paths, so each E and each top_k runs at least once: every E, every top_k of 1-8 (k = E at 8), Qwen3's 128 / 8.
@pytest.mark.parametrize("num_experts,top_k", [(8, 8), (60, 4), (60, 6), (64, 2), (128, 1), (128, 8)])
def test_packed_selection_is_bitwise_the_three_reduction_one(num_experts, top_k):
    """One max over packed keys per pick stores the same ids and weight bits as the three-reduction selection, and
    both take ties lowest index first (-0.0 == +0.0)."""
    gen = torch.Generator().manual_seed(num_experts * 10 + top_k)
    logits = torch.cat([tied_logits(5, num_experts, gen), tied_logits(4, num_experts, gen, zero_on_top=True)]).to(DEV)
    for renorm, out_dtype, block_t in SELECTION_CASES:
        out = fused_topk(logits, top_k, renorm, out_dtype, block_t=block_t)
        _same_bits(out, fused_topk(logits, top_k, renorm, out_dtype, block_t=block_t, packed_topk=False))
        _check(out, lowest_first_ref(logits, top_k, renorm, out_dtype), atol=1e-6 if out_dtype == torch.float32
               else 1e-2)


@pytest.mark.parametrize("num_experts,top_k", [(60, 6), (128, 8), (8, 2)])
def test_packed_selection_in_the_gemm_kernel_is_bitwise_the_three_reduction_one(num_experts, top_k):
    """The same through the router GEMM, a row spread over programs (E 60, 128) or in one (E 8): inputs on a grid
    whose products sum exactly, so equal logits happen."""
    gen = torch.Generator().manual_seed(num_experts + top_k)
    hidden = 24
    x = torch.randint(-3, 4, (5, hidden), generator=gen).float().to(DEV)
    weight = (torch.randint(-2, 3, (num_experts, hidden), generator=gen) * 0.125).to(DEV)
    weight[num_experts // 2] = weight[num_experts - 1] = weight[1]  # three experts with equal logits in every row
    tile = RouterTile(block_t=2, block_e=16, block_h=16)
    for renorm, out_dtype in ((True, torch.float32), (False, torch.bfloat16)):
        out = fused_gemm_topk(x, weight, top_k, renorm, out_dtype, tile=tile)
        _same_bits(out, fused_gemm_topk(x, weight, top_k, renorm, out_dtype, tile=tile, packed_topk=False))
        _check(out, lowest_first_ref(x @ weight.t(), top_k, renorm, out_dtype),
               atol=1e-6 if out_dtype == torch.float32 else 1e-2)


def test_packed_keys_order_special_values():
    """The key order is the float order over the whole fp32 range (subnormals, +-FLT_MAX, -0.0 == +0.0, -inf last
    among the selectable): full sorts of permuted rows against a stable sort. A row with fewer finite logits than
    top_k takes its -inf experts next, lowest index first, weight 0: distinct ids, all < E."""
    fmax, tiny = torch.finfo(torch.float32).max, 1e-45  # 1e-45: the smallest subnormal
    values = torch.tensor([0.0, -0.0, 1.0, 1.0, -1.0, 3e38, -3e38, fmax, -fmax, tiny, -tiny, 1e-30, -1e-30,
                           float("-inf"), float("-inf"), 2.5])
    gen = torch.Generator().manual_seed(5)
    logits = torch.stack([values[torch.randperm(16, generator=gen)] for _ in range(4)]).to(DEV)
    _check(fused_topk(logits, 16, False, torch.float32), lowest_first_ref(logits, 16, False, torch.float32))
    sparse = torch.full((2, 60), float("-inf"))
    sparse[0, 7], sparse[0, 3], sparse[1, 59] = 1.0, 2.0, -5.0
    w, ids = fused_topk(sparse.to(DEV), 6, True, torch.float32)
    assert ids.tolist() == [[3, 7, 0, 1, 2, 4], [59, 0, 1, 2, 3, 4]]
    assert w[:, 2:].eq(0).all() and w[1, 0] == 1
    _check((w, ids), lowest_first_ref(sparse.to(DEV), 6, True, torch.float32))


def test_nan_logits_are_never_selected():
    """NaN logits are skipped by both selections; a row with NaN has NaN weights (its softmax denominator is NaN);
    picks beyond a row's non-NaN logits get id NO_EXPERT and weight 0 (NaN after renormalisation), as does a row of
    NaN."""
    nan = float("nan")
    logits = torch.tensor([[1.0, nan, 2.0, -1.0, nan, 0.5, 0.0, -3.0],
                           [nan, nan, 4.0, nan, nan, nan, 1.0, nan],
                           [nan] * 8]).to(DEV)
    for renorm in (False, True):
        w, ids = fused_topk(logits, 3, renorm, torch.float32)
        assert ids.tolist() == [[2, 0, 5], [2, 6, NO_EXPERT], [NO_EXPERT] * 3]
        assert w[:2, :2].isnan().all() and (w[2].isnan().all() if renorm else w[2].eq(0).all())
        assert w[1, 2].isnan() if renorm else w[1, 2] == 0
        old_w, old_ids = fused_topk(logits, 3, renorm, torch.float32, packed_topk=False)
        assert torch.equal(old_ids[0], ids[0]) and torch.equal(old_ids[2], ids[2])  # rows with 3 non-NaN: the same
        assert torch.equal(old_w[[0, 2]].isnan(), w[[0, 2]].isnan())


def _moe_spec(num_experts=60, top_k=4, hidden=32):
    return ModelSpec(family="qwen3_moe", vocab_size=64, hidden_size=hidden, num_layers=1, num_heads=2,
                     num_kv_heads=2, head_dim=16, num_experts=num_experts, top_k=top_k, moe_intermediate_size=8,
                     intermediate_size=16, norm_topk_prob=True, sparse_layers=(True,))


@pytest.mark.parametrize("lora_backend", ["torch", "triton"])
@pytest.mark.parametrize("num_tokens", [7, 70])  # router GEMM in the kernel; linear layer + routing kernel
def test_moe_block_routes_like_torch_with_router_lora(lora_backend, num_tokens):
    """MoEBlock.route with the triton backend against the torch backend, a router LoRA on some rows; rows
    without an adapter route bitwise as in a batch without LoRA."""
    gen = torch.Generator().manual_seed(num_tokens)
    spec = _moe_spec()
    fused = MoEBlock(spec, ExecOptions(moe_backend="triton", lora_backend=lora_backend), gemm_topk_max_tokens=64)
    ref = MoEBlock(spec)
    weight = torch.randn(spec.num_experts, spec.hidden_size, generator=gen) * 0.3
    lora_a = torch.randn(2, 1, 4, spec.hidden_size, generator=gen) * 0.3
    lora_b = torch.randn(2, spec.num_experts, 4, generator=gen) * 0.5
    for block in (fused, ref):
        block.router.weight.data.copy_(weight)
        block.router.lora_a, block.router.lora_b = lora_a, lora_b
    x = torch.randn(num_tokens, spec.hidden_size, generator=gen)
    slots = torch.tensor([-1, 0, 1] * num_tokens, dtype=torch.int32)[:num_tokens]
    lora = LoRABatch(slots, torch.tensor([4, 4], dtype=torch.int32), active_slots=(0, 1))
    w, ids = fused.route(x, lora)
    _check((w, ids), ref.route(x, lora), atol=2e-6)
    base_w, base_ids = fused.route(x, None)
    _check((base_w, base_ids), ref.route(x, None), atol=2e-6)
    plain = slots < 0
    assert torch.equal(w[plain], base_w[plain]) and torch.equal(ids[plain], base_ids[plain])
    assert not torch.equal(ids[~plain], base_ids[~plain])  # the adapter really moves experts


def test_bad_top_k_is_refused():
    with pytest.raises(ValueError, match="top_k=9"):
        fused_topk(torch.zeros(2, 8), 9, False, torch.float32)
    with pytest.raises(ValueError, match="counters"):
        fused_gemm_topk(torch.zeros(3, 8), torch.zeros(16, 8), 2, False, torch.float32,
                        counters=torch.zeros(1, dtype=torch.int32), tile=RouterTile(block_e=8))


# --------------------------------------------------------------------------------------------
# GPU: bf16 at Qwen3-30B-A3B / Qwen1.5-MoE router shapes, and graph replays


def _topk_logit_values(logits, ids):
    """The selected experts' logits, sorted: equal under any tie order."""
    return logits.float().gather(1, ids.long()).sort(-1, descending=True).values


@gpu
@pytest.mark.parametrize("num_experts,top_k,renorm", [(128, 8, True), (60, 4, False), (8, 2, True)])
@pytest.mark.parametrize("num_tokens", [1, 8, 64, 256, 512])
def test_gpu_bf16_routing(num_experts, top_k, renorm, num_tokens):
    gen = torch.Generator("cuda").manual_seed(num_tokens)
    hidden = 2048
    x = torch.randn(num_tokens, hidden, generator=gen, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(num_experts, hidden, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02
    # routing alone on bf16 logits (ties possible in bf16: compare selected values, not ids)
    logits = x @ weight.t()
    w, ids = fused_topk(logits, top_k, renorm, torch.bfloat16)
    rw, rids = fused_topk_ref(logits, top_k, renorm, torch.bfloat16)
    torch.testing.assert_close(_topk_logit_values(logits, ids), _topk_logit_values(logits, rids), atol=0, rtol=0)
    torch.testing.assert_close(w.float(), rw.float(), atol=1e-2, rtol=1e-2)
    # with the GEMM: against the fp32 logits of the same bf16 inputs, rounded to bf16 as the kernel rounds them
    ref_logits = (x.float() @ weight.float().t()).to(torch.bfloat16)
    counters = torch.zeros(counter_slots(num_tokens), dtype=torch.int32, device="cuda")
    w, ids = fused_gemm_topk(x, weight, top_k, renorm, torch.float32, counters=counters)
    rw, rids = fused_topk_ref(ref_logits, top_k, renorm, torch.float32)
    torch.testing.assert_close(_topk_logit_values(ref_logits, ids), _topk_logit_values(ref_logits, rids),
                               atol=1e-2, rtol=0)  # a near-tie may flip by one bf16 rounding of the logits
    torch.testing.assert_close(w.sort(-1).values, rw.sort(-1).values, atol=1e-2, rtol=1e-2)
    assert not counters.any()


@gpu
def test_gpu_graph_replays_route_each_input():
    """Captured once, replayed on new inputs: the counters come back to zero after every replay."""
    hidden, num_experts, top_k, num_tokens = 2048, 128, 8, 8
    gen = torch.Generator("cuda").manual_seed(0)
    weight = torch.randn(num_experts, hidden, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.empty(num_tokens, hidden, device="cuda", dtype=torch.bfloat16)
    counters = torch.zeros(counter_slots(num_tokens), dtype=torch.int32, device="cuda")
    x.normal_(generator=gen)
    fused_gemm_topk(x, weight, top_k, True, torch.bfloat16, counters=counters)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w, ids = fused_gemm_topk(x, weight, top_k, True, torch.bfloat16, counters=counters)
    for _ in range(3):
        x.normal_(generator=gen)
        graph.replay()
        eager_w, eager_ids = fused_gemm_topk(x, weight, top_k, True, torch.bfloat16, counters=counters)
        assert torch.equal(ids, eager_ids) and torch.equal(w, eager_w)
        assert not counters.any()


@gpu
@pytest.mark.parametrize("num_experts,top_k", [(128, 8), (60, 4), (64, 8), (8, 2)])
@pytest.mark.parametrize("num_tokens", [1, 8, 64, 256])
def test_gpu_packed_selection_is_bitwise_the_three_reduction_one(num_experts, top_k, num_tokens):
    """On the device, bf16 logits (ties are common) and fp32 logits on a grid (ties, -0.0 and +0.0): the packed
    selection stores the bits of the three-reduction one (behind the router GEMM: the same ids, weights within 2 ulp),
    and its ids are the lowest-first reference's. Rows with a few NaN logits (still top_k others) route the same ids on
    both, with NaN weights."""
    gen = torch.Generator("cuda").manual_seed(num_tokens * 1000 + num_experts)
    hidden = 2048
    x = torch.randn(num_tokens, hidden, generator=gen, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(num_experts, hidden, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02
    logits = x @ weight.t()
    counters = torch.zeros(counter_slots(num_tokens), dtype=torch.int32, device="cuda")
    for renorm, out_dtype in ((True, torch.bfloat16), (False, torch.bfloat16), (True, torch.float32)):
        out = fused_topk(logits, top_k, renorm, out_dtype)
        _same_bits(out, fused_topk(logits, top_k, renorm, out_dtype, packed_topk=False))
        assert torch.equal(out[1].long(), lowest_first_ref(logits, top_k, renorm, out_dtype)[1])
        # behind the router GEMM the compiler may contract exp(logit - max) differently in the two selections (E=8,
        # 4 rows per program: 1 ulp of fp32 seen on the H200): the same experts, weights within 2 ulp
        (w, ids), (w0, ids0) = (fused_gemm_topk(x, weight, top_k, renorm, out_dtype, counters=counters),
                                fused_gemm_topk(x, weight, top_k, renorm, out_dtype, counters=counters,
                                                packed_topk=False))
        assert torch.equal(ids, ids0)
        ulp = torch.finfo(out_dtype).eps
        torch.testing.assert_close(w.float(), w0.float(), rtol=2 * ulp, atol=0)
    # fp32 logits on a grid: many exact ties, -0.0 against +0.0 (the keys must not order them)
    for zero_on_top, block_t in ((False, 1), (True, 1), (True, 4)):
        grid = tied_logits(num_tokens, num_experts, torch.Generator().manual_seed(num_tokens), zero_on_top).cuda()
        out = fused_topk(grid, top_k, False, torch.float32, block_t=block_t)
        _same_bits(out, fused_topk(grid, top_k, False, torch.float32, block_t=block_t, packed_topk=False))
        assert torch.equal(out[1].long(), lowest_first_ref(grid, top_k, False, torch.float32)[1])
    poisoned = logits.clone()
    poisoned[:, torch.randperm(num_experts, generator=gen, device="cuda")[:min(3, num_experts - top_k)]] = float("nan")
    w, ids = fused_topk(poisoned, top_k, True, torch.bfloat16)
    old_w, old_ids = fused_topk(poisoned, top_k, True, torch.bfloat16, packed_topk=False)
    assert torch.equal(ids, old_ids) and w.isnan().all() and old_w.isnan().all()
    assert not poisoned.gather(1, ids.long()).isnan().any()
