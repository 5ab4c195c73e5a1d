"""`bench decode --profile` cuts a decoder layer into regions and times each; the cut must be the layer:
chaining the regions reproduces DecoderLayer.forward bitwise, for every family's layer shape (q/k norm per
head or over all heads, clip_qkv, shared expert, dense layers) and both backends."""
from __future__ import annotations

import time

import pytest
import torch

from moeserve.bench import layer_profile
from moeserve.bench.decode import DecodeBench
from moeserve.models.spec import ModelSpec

BASE = dict(vocab_size=96, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, num_experts=8, top_k=2,
            moe_intermediate_size=48, intermediate_size=80, norm_topk_prob=True, max_position_embeddings=1024)
SHAPES = {
    "qwen3_moe": dict(qk_norm="head"),
    "olmoe": dict(qk_norm="full", clip_qkv=0.5, norm_topk_prob=False),
    "qwen2_moe": dict(shared_expert_intermediate_size=32, qkv_bias=True, sparse=(True, False)),
    "mixtral": dict(router_weights_fp32=True),
}


def spec_for(family: str) -> ModelSpec:
    extra = dict(SHAPES[family])
    sparse = extra.pop("sparse", (True, True))
    return ModelSpec(family=family, num_layers=len(sparse), sparse_layers=sparse, **{**BASE, **extra})


def cpu_timer(fns) -> float:
    t0 = time.perf_counter()
    for fn in fns:
        fn()
    return (time.perf_counter() - t0) * 1e6 / len(fns)


@pytest.mark.parametrize("family,backend", [(f, "torch") for f in SHAPES] + [("qwen3_moe", "triton")])
@torch.inference_mode()
def test_regions_chained_are_the_layer_forward(family, backend):
    bench = DecodeBench(spec_for(family), max_bs=3, steps=4, device="cpu", dtype=torch.float32, backend=backend)
    B = 3
    from moeserve.runtime.scheduler import ScheduledBatch

    seqs = bench.sequences(B, [-1] * B)
    batch = bench.runner.prepare(ScheduledBatch(seqs, [1] * B, is_decode=True))
    gen = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(B, bench.spec.hidden_size, generator=gen) for _ in range(2))
    for layer, (k_cache, v_cache) in zip(bench.model.layers, bench.model.kv_caches):
        regions, chained = layer_profile.layer_regions(layer, x, residual, batch, k_cache, v_cache, ctx_len=512)
        reference = layer(x, residual, batch, k_cache, v_cache)
        assert all(torch.equal(c, r) for c, r in zip(chained, reference)), (family, layer.layer_idx)
        names = [r.name for r in regions]
        assert names[-1] == ("experts" if layer.is_sparse else "dense_mlp")
        assert all(r.nbytes > 0 for r in regions)


def test_budget_rows_cover_every_region_and_the_whole_layer():
    bench = DecodeBench(spec_for("qwen2_moe"), max_bs=2, steps=4, device="cpu", dtype=torch.float32,
                        backend="torch")
    rows = bench.layer_budget(2, bandwidth=1e11, timer=cpu_timer)
    assert rows[-1]["region"] == "layer (of 1)"  # the one routed-expert layer; the dense one is cut differently
    assert rows[-1]["bytes"] == sum(r["bytes"] for r in rows[:-1])
    for r in rows:
        assert r["us"] > 0 and r["floor_us"] == pytest.approx(r["bytes"] / 1e11 * 1e6)
