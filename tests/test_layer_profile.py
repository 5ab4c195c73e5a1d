"""`bench decode --profile` cuts a decoder layer into regions and times each; the cut must be the layer:
chaining the regions reproduces DecoderLayer.forward bitwise, for every family's layer shape (q/k norm per
head or over all heads, clip_qkv, shared expert, dense layers) and both backends."""
from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from moeserve.bench import decode, layer_profile
from moeserve.bench.decode import DecodeBench
from moeserve.model_spec import ModelSpec

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
def test_regions_chained_are_the_layer_forward(family, backend, monkeypatch):
    # a 64-token context in the cache instead of the bench's 512: the cut does not depend on it, and the interpreted
    # decode attention still runs two splits and their merge, as at 512 (its cost grows with the context)
    monkeypatch.setattr(decode, "PROMPT", 64)
    bench = DecodeBench(spec_for(family), max_bs=3, steps=4, device="cpu", dtype=torch.float32, backend=backend)
    B = 3
    from moeserve.worker.sequence import ScheduledBatch

    seqs = bench.sequences(B, [-1] * B)
    batch = bench.runner.prepare(ScheduledBatch(seqs, [1] * B, is_decode=True))
    gen = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(B, bench.spec.hidden_size, generator=gen) for _ in range(2))
    for layer, (k_cache, v_cache) in zip(bench.model.layers, bench.runner.kv_caches):
        regions, chained = layer_profile.layer_regions(layer, x, residual, batch, k_cache, v_cache, ctx_len=512)
        reference = layer(x, residual, batch, k_cache, v_cache)
        assert all(torch.equal(c, r) for c, r in zip(chained, reference)), (family, layer.layer_idx)
        names = [r.name for r in regions]
        assert names[-1] == ("experts" if layer.is_sparse else "dense_mlp")
        assert all(r.nbytes > 0 for r in regions)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@torch.inference_mode()
def test_regions_with_adapters_chained_are_the_layer_forward(backend, monkeypatch):
    """`--profile-modes active`: the rows on adapters (attention and experts), the regions still chain into the
    layer's forward with that batch bitwise, and the adapters change the layer's output (the budget times them)."""
    monkeypatch.setattr(decode, "PROMPT", 64)
    # one layer: what is checked is that layer's cut and the budget's rows on adapters, not the count of layers the
    # budget times (the tests above: every layer; interpreted, each timed layer costs ~2 s)
    spec = dataclasses.replace(spec_for("qwen3_moe"), num_layers=1, sparse_layers=(True,))
    bench = DecodeBench(spec, max_bs=3, steps=4, device="cpu", dtype=torch.float32, backend=backend)
    bench.attach_lora_pool()
    from moeserve.worker.sequence import ScheduledBatch

    B = 3
    batches = {mode: bench.runner.prepare(ScheduledBatch(bench.sequences(B, decode.slots_for(mode, B)), [1] * B,
                                                         is_decode=True)) for mode in ("base", "active")}
    assert batches["active"].lora is not None
    gen = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(B, bench.spec.hidden_size, generator=gen) for _ in range(2))
    layer, (k_cache, v_cache) = bench.model.layers[0], bench.runner.kv_caches[0]
    _, chained = layer_profile.layer_regions(layer, x, residual, batches["active"], k_cache, v_cache, ctx_len=512)
    reference = layer(x, residual, batches["active"], k_cache, v_cache)
    assert all(torch.equal(c, r) for c, r in zip(chained, reference))
    base = layer(x, residual, batches["base"], k_cache, v_cache)
    assert not torch.equal(base[0], reference[0])
    rows = bench.layer_budget(B, bandwidth=1e11, timer=cpu_timer, mode="active")
    assert [r["region"] for r in rows][-1] == "layer (of 1)" and all(r["us"] > 0 for r in rows)


def test_profile_modes_other_than_the_budgets_are_refused_by_name(capsys):
    with pytest.raises(SystemExit) as exc:
        decode.main(["--profile", "--profile-modes", "active,idle-dual"])
    assert exc.value.code == 2 and "--profile-modes idle-dual" in capsys.readouterr().err


def test_budget_rows_cover_every_region_and_the_whole_layer():
    bench = DecodeBench(spec_for("qwen2_moe"), max_bs=2, steps=4, device="cpu", dtype=torch.float32,
                        backend="torch")
    rows = bench.layer_budget(2, bandwidth=1e11, timer=cpu_timer)
    assert rows[-1]["region"] == "layer (of 1)"  # the one routed-expert layer; the dense one is cut differently
    assert rows[-1]["bytes"] == sum(r["bytes"] for r in rows[:-1])
    for r in rows:
        assert r["us"] > 0 and r["floor_us"] == pytest.approx(r["bytes"] / 1e11 * 1e6)


# ---- tensor / expert parallelism: two ranks on gloo ------------------------------------------------------

def model_folder(tmp_path, family: str, **overrides) -> str:
    """A folder with a tiny family's config.json (--load-format dummy draws the weights)."""
    import json

    from moeserve.models.tiny import tiny_hf_config

    folder = tmp_path / family
    folder.mkdir()
    cfg = tiny_hf_config(family, max_position_embeddings=1024, **overrides).to_dict()  # the 512-token context fits
    (folder / "config.json").write_text(json.dumps(cfg))
    return str(folder)


def regions_vs_forward(rank, store_port, config, model_dir):
    """Every rank, in lockstep: each layer's regions chained against DecoderLayer.forward on this rank's shard.
    A rank whose chain differs raises (run_ranks names it)."""
    from moeserve.bench import tp_profile

    runner, tp = tp_profile.setup_rank(rank, config, model_dir, store_port)
    try:
        with torch.inference_mode():
            batch, x = tp_profile.decode_inputs(runner, 3)
            residual = x.flip(0).contiguous()
            names = []
            for layer, (k_cache, v_cache) in zip(runner.model.layers, runner.kv_caches):
                regions, chained = layer_profile.layer_regions(layer, x, residual, batch, k_cache, v_cache, 512)
                reference = layer(x, residual, batch, k_cache, v_cache)
                if not all(torch.equal(c, r) for c, r in zip(chained, reference)):
                    raise AssertionError(f"rank {rank} layer {layer.layer_idx}: the regions are not the layer")
                names.append([r.name for r in regions])
            return names
    finally:
        tp_profile.release(runner, tp)


@pytest.mark.parametrize("family,overrides,expert_parallel", [
    ("qwen3_moe", {}, False),  # layer 1 is a dense MLP
    ("qwen3_moe", {}, True),
    ("olmoe", {"num_key_value_heads": 1}, False),  # q/k norms over heads split across ranks (an all-reduce inside)
], ids=["qwen3_moe-tp2", "qwen3_moe-ep2", "olmoe-tp2-kv1"])
def test_regions_chained_are_the_layer_forward_on_every_rank(tmp_path, family, overrides, expert_parallel):
    """Under TP=2 / EP=2 the budget's regions, the two all-reduces among them, still chain into the layer's forward
    bitwise on both ranks; each all-reduce region says what it ran (gloo on CPU)."""
    from moeserve.bench import tp_profile

    model_dir = model_folder(tmp_path, family, **overrides)
    config = tp_profile.engine_config(model_dir, 2, expert_parallel, "symm_mem", [3], "cpu", dist_timeout=60)
    names = tp_profile.run_ranks(regions_vs_forward, 2, config, model_dir)
    for layer_names in names:
        assert layer_names[layer_names.index("o_proj") + 1] == "attn all_reduce gloo"
        assert layer_names[-1] == "mlp all_reduce gloo"
        assert layer_names[-2] in ("experts", "dense_mlp")


def test_tp_budget_has_the_all_reduces_and_half_the_expert_bytes(tmp_path):
    """`bench tp_decode --profile`'s rank-0 budget on gloo: one row per region (the two all-reduces included) and the
    layer; each rank of TP=2 (every expert sliced in half) and of EP=2 (half the experts whole) reads half the expert
    weight bytes of one rank."""
    from moeserve.bench import tp_profile

    model_dir = model_folder(tmp_path, "qwen3_moe")
    B, H = 3, 64
    experts = {}
    for name, (tp, ep) in {"tp1": (1, False), "tp2": (2, False), "ep2": (2, True)}.items():
        out = tp_profile.profile(model_dir, tp, ep, "symm_mem", [B], "cpu", dist_timeout=60)
        rows = {r["region"]: r for r in out["budgets"][B]}
        assert out["all_reduce"] == ("-" if tp == 1 else "gloo")
        assert ("attn all_reduce gloo" in rows) == (tp > 1) and ("mlp all_reduce gloo" in rows) == (tp > 1)
        layer = rows.pop("layer (of 2)")  # the tiny qwen3_moe's two routed-expert layers (layer 1 is dense)
        assert layer["bytes"] == sum(r["bytes"] for r in rows.values())
        assert all(r["us"] > 0 for r in out["budgets"][B])
        experts[name] = rows["experts"]["bytes"] - 2 * B * H * 4  # less the fp32 activations in and out
    assert experts["tp2"] == pytest.approx(experts["tp1"] / 2, abs=1)
    assert experts["ep2"] == pytest.approx(experts["tp1"] / 2, abs=1)


def rank_one_fails(rank, store_port, wait_s):
    if rank == 1:
        raise RuntimeError("rank 1 cannot start")
    time.sleep(wait_s)  # rank 0 stands for a rank waiting in a collective for the failed one
    return "rank 0 finished"


def test_a_failed_profile_rank_is_named_while_rank_0_still_waits():
    from moeserve.bench import tp_profile

    with pytest.raises(RuntimeError, match="rank 1 exited with code 1 while rank 0 was running"):
        tp_profile.run_ranks(rank_one_fails, 2, 60.0)


@pytest.mark.gpu_multi
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("setting", ["tp2", "ep2"])
def test_gpu_tp_decode_profile_child_times_the_symmetric_memory_all_reduces(tmp_path, setting):
    """`bench tp_decode --profile`'s child on two GPUs (a fresh interpreter, as the bench runs it, so its ranks set
    symmetric memory up anew): every region captured and replayed on both ranks in lockstep, the all-reduces
    through symmetric memory, kernels counted."""
    from moeserve.bench import tp_decode

    job = dict(kind="profile", setting=setting, asked="symm_mem", modes=[], batches=[1, 64], device="cuda",
               model_dir=model_folder(tmp_path, "qwen3_moe"))
    result = tp_decode.run_child(job, timeout_s=300)
    assert "error" not in result, result
    prof = result["profile"]
    assert prof["all_reduce"] == "symm_mem"
    for B in ("1", "64"):
        rows = {r["region"]: r for r in prof["budgets"][B]}
        for where in ("attn", "mlp"):
            r = rows[f"{where} all_reduce symm_mem one-shot"]  # [B, 64] bf16 is far below the two-shot size
            assert r["us"] > 0 and r["kernels"], r
        assert all(r["us"] > 0 for r in rows.values())
