"""The torch experts on the CPU run each expert over its routed rows only: a row's result must not depend on
the other rows of the batch (bitwise), must match a float64 per-row reference, and the oneDNN-packed copies of
the weights (experts, dense linears) must follow the parameters."""
import pytest
import torch
import torch.nn.functional as F

from moeserve.layers.moe import MoEBlock, PackedExperts, moe_experts_torch
from moeserve.model_spec import ModelSpec

# (hidden, intermediate, experts, top-k): the demo model's experts (SmolLM2-135M upcycled), and a tiny shape
SHAPES = [(576, 1536, 4, 2), (64, 96, 8, 2)]
IDS = ["demo", "tiny"]


def problem(num_tokens, hidden, inter, num_experts, top_k, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) * hidden ** -0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) * inter ** -0.5
    weights, ids = torch.softmax(torch.randn(num_tokens, num_experts, generator=g), -1).topk(top_k, -1)
    return x, w13, w2, weights, ids


def reference(x, w13, w2, weights, ids):
    """Row by row in float64: sum over the row's experts of weight * down(silu(gate) * up)."""
    inter = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            if e >= w13.shape[0]:
                continue  # another rank's expert
            gu = w13[e].double() @ x[t].double()
            out[t] += w * (w2[e].double() @ (F.silu(gu[:inter]) * gu[inter:]))
    return out


@pytest.mark.parametrize("packed", [True, False], ids=["onednn", "plain"])
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_a_rows_result_does_not_depend_on_the_other_rows(shape, packed):
    """Every sub-batch (sizes 1..24, rows in any order) gives each of its rows bitwise the row's result in the
    full batch. An expert then sees 0..24 rows at any position; a GEMM whose kernel (and rounding) depends on
    the row count fails here, as does every expert over the whole batch."""
    x, w13, w2, weights, ids = problem(24, *shape)
    pk = PackedExperts.of(w13, w2) if packed else None
    if packed and pk is None:
        pytest.skip("torch without oneDNN")
    full = moe_experts_torch(x, w13, w2, weights, ids, None, None, pk)
    g = torch.Generator().manual_seed(1)
    for n in [1, 2, 3, 4, 5, 6, 7, 9, 11, 13, 17, 23] * 2:
        rows = torch.randperm(24, generator=g)[:n]
        got = moe_experts_torch(x[rows], w13, w2, weights[rows], ids[rows], None, None, pk)
        bad = [r for r, a, b in zip(rows.tolist(), got, full[rows]) if not torch.equal(a, b)]
        assert not bad, f"rows {bad} changed with {n} rows in the batch"


@pytest.mark.parametrize("packed", [True, False], ids=["onednn", "plain"])
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_routed_experts_match_the_per_row_reference(shape, packed):
    """Prefill- and decode-sized batches; an expert with no rows; ids of another rank's experts (E) skipped."""
    hidden, inter, num_experts, top_k = shape
    for num_tokens in (1, 7, 100):
        x, w13, w2, weights, ids = problem(num_tokens, *shape, seed=num_tokens)
        ids[ids == 1] = num_experts  # expert 1 lives on another rank: no rows here
        pk = PackedExperts.of(w13, w2) if packed else None
        out = moe_experts_torch(x, w13, w2, weights, ids, None, None, pk)
        ref = reference(x, w13, w2, weights, ids)
        assert (out.double() - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_moe_block_repacks_when_its_weights_are_written():
    """The packed copy is made at the first forward and made again after the parameters are written."""
    hidden, inter, num_experts, top_k = SHAPES[1]
    spec = ModelSpec(family="mixtral", vocab_size=32, hidden_size=hidden, num_layers=1, num_heads=4, num_kv_heads=2,
                     head_dim=16, num_experts=num_experts, top_k=top_k, moe_intermediate_size=inter,
                     intermediate_size=inter, norm_topk_prob=True, sparse_layers=(True,))
    block = MoEBlock(spec)
    x, w13, w2, weights, ids = problem(9, hidden, inter, num_experts, top_k, seed=3)
    with torch.no_grad():
        block.w13.copy_(w13)
        block.w2.copy_(w2)
        first = block.experts(x, weights, ids, None)
        assert (first.double() - reference(x, w13, w2, weights, ids)).abs().max() <= 1e-5
        block.w13.mul_(2.0)
        block.w2.copy_(w2.flip(0))
        again = block.experts(x, weights, ids, None)
    assert (again.double() - reference(x, 2 * w13, w2.flip(0), weights, ids)).abs().max() <= 1e-5
    if torch.backends.mkldnn.is_available():
        assert block._packed_experts() is not None  # the fast path is the one tested


def test_a_packed_linear_matches_and_follows_its_weight():
    """LoRALinear (with a bias) on its packed weight: equal to a float64 reference, again after the weight is
    written in place."""
    from moeserve.layers import cpu_linear
    from moeserve.layers.linear import LoRALinear

    g = torch.Generator().manual_seed(5)
    layer = LoRALinear(576, (576, 192, 192), True)
    x = torch.randn(8, 576, generator=g)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(960, 576, generator=g) * 0.04)
        layer.bias.copy_(torch.randn(960, generator=g))
        for scale in (1.0, -3.0):
            layer.weight.mul_(scale)
            ref = x.double() @ layer.weight.double().t() + layer.bias.double()
            assert (layer(x, None).double() - ref).abs().max() <= 1e-5
    if cpu_linear.packable(layer.weight):
        assert layer.packed.get(layer.weight) is not None  # the fast path is the one tested
