"""Tensor and expert parallelism: TP=2 and EP=2 (two processes, gloo on CPU) equal TP=1 — the same engine with
the feature off — for every family, with mixed adapter batches, hot loads and evictions; graph replay keys
agree across ranks; a failed adapter load is rolled back on every rank; a killed or hung rank stops the engine
with an error naming it; every rank agrees on the all-reduce backend and falls back together. The `gpu_multi`
tests repeat the graph checks with NCCL and CUDA graphs on two GPUs (skipped with fewer), and compare the
symmetric-memory all-reduce with NCCL's, eager and in graphs, and its shutdown."""
import os
import signal

import pytest
import torch

from moeserve import Engine, EngineConfig, SamplingParams
from moeserve.errors import RankFailure
from moeserve.lora.slot_pool import ALL_TARGETS

from peft_fixtures import INTERPRETED_LAYERS, make_peft_adapter, save_base_checkpoint

LP_TOL = 1e-4  # fp32: logits (so logprobs) within 1e-4 of the single-rank engine
GREEDY = dict(temperature=0.0, ignore_eos=True, logprobs=3, prompt_logprobs=2)

# per-expert gate_proj / up_proj LoRAs with their own A's (a gate half and an up half in the slot)
SEPARATE_GATE_UP = dict(expert_format="per-expert", separate_gate_up=True)
# family -> (config overrides, adapters: name -> (kind, rank[, adapter format])). olmoe runs with one KV head: both
# ranks then hold a replica of it, and its full-width k_norm spans the replicas.
CASES = {
    "qwen3_moe": ({}, {"attn": ("attn", 2), "experts": ("experts", 8, SEPARATE_GATE_UP), "dense": ("dense-mlp", 4)}),
    "qwen2_moe": ({}, {"attn": ("attn", 2), "experts": ("attn+experts", 4), "shared": ("shared-expert", 8)}),
    "mixtral": ({}, {"attn": ("attn", 2), "experts": ("experts", 8), "all": ("all-linear+router", 4)}),
    "olmoe": ({"num_key_value_heads": 1}, {"attn": ("attn", 4), "experts": ("attn+experts", 2),
                                            "late": ("experts", 8)}),
}


def config(base, **kw):
    kw = {**dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=96, max_num_seqs=8, max_lora_rank=8,
                 dist_timeout=60), **kw}
    return EngineConfig(model=str(base), **kw)


@pytest.fixture
def tp_engine():
    """Makes TP=2 engines and shuts every one down (workers stopped, process group left) after the test."""
    made = []

    def make(cfg: EngineConfig) -> Engine:
        engine = Engine(cfg)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.runner.shutdown()


def prompts(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (int(k),), generator=g).tolist() for k in torch.randint(3, 12, (n,), generator=g)]


def assert_same(ours, ref):
    assert len(ours) == len(ref)
    for a, b in zip(ours, ref):
        assert len(a.logprobs) == len(b.logprobs) and len(a.prompt_logprobs) == len(b.prompt_logprobs)
        assert a.token_ids == b.token_ids, (a.lora_name, a.token_ids, b.token_ids)
        for x, y in zip(a.logprobs + a.prompt_logprobs[1:], b.logprobs + b.prompt_logprobs[1:]):
            assert abs(x.logprob - y.logprob) <= LP_TOL
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
            assert max(abs(p - q) for (_, p), (_, q) in zip(x.top, y.top)) <= LP_TOL


@pytest.mark.parametrize("family", list(CASES))
def test_tp2_and_ep2_equal_tp1_with_mixed_adapters_hot_load_and_eviction(tmp_path, tp_engine, family):
    """TP=2 and EP=2 give TP=1's tokens and logprobs, each rank holding its shard, over waves that mix adapters with
    rows without one, hot-load and evict, eagerly and through the graph runner; their all-reduces (the default
    config asks for symmetric memory) run on gloo on every rank."""
    overrides, kinds = CASES[family]
    base = save_base_checkpoint(family, tmp_path / "base", **overrides)
    paths = {name: str(make_peft_adapter(family, tmp_path / name, kind=kind, rank=rank, seed=i + 1,
                                         config_overrides=overrides, **(fmt[0] if fmt else {}))[0])
             for i, (name, (kind, rank, *fmt)) in enumerate(kinds.items())}
    first, second, late = list(paths)
    # two slots for three adapters: the later batches evict
    kw = dict(lora_modules={first: paths[first], second: paths[second]}, max_loras=2,
              lora_target_modules=list(ALL_TARGETS))
    one = Engine(config(base, **kw))
    one.load_lora(late, paths[late])
    sp = SamplingParams(max_tokens=5, **GREEDY)
    waves = [[None, first, second, None, first], [late, None, second, late], [first, late, None]]
    waves = [(prompts(len(loras), seed=10 * i + 1), loras) for i, loras in enumerate(waves)]
    refs = [one.generate(ps, sp, lora=loras) for ps, loras in waves]
    graph_wave = (prompts(3, seed=7), [first, None, late])
    graph_ref = one.generate(*graph_wave[:1], sp, lora=graph_wave[1])

    for expert_parallel in (False, True):
        two = tp_engine(config(base, tensor_parallel_size=2, enable_expert_parallel=expert_parallel, **kw))
        # the default config asks for symmetric memory: on CPU every rank falls back to gloo
        assert two.runner.tp.all_reduce_backend == "gloo"
        assert two.runner.worker_all_reduce_backends() == {1: "gloo"}
        moe = next(layer.mlp for layer in two.runner.model.layers if layer.is_sparse)
        spec = two.spec
        # expert-parallel ranks hold half the experts whole, tensor-parallel ones half of every expert
        held = (spec.num_experts // 2, spec.moe_intermediate_size) if expert_parallel \
            else (spec.num_experts, spec.moe_intermediate_size // 2)
        assert (moe.w2.shape[0], moe.w2.shape[2]) == held
        two.load_lora(late, paths[late])  # hot load, after start
        for (ps, loras), ref in zip(waves, refs):
            assert_same(two.generate(ps, sp, lora=loras), ref)
        assert two.stats().lora_evictions_total > 0

        # decode through the graph runner (on CPU its graphs re-run the forward on the static buffers,
        # collectives included): both ranks replay the keys rank 0 picks, also for a batch padded to a bucket
        two.runner.capture_graphs()
        assert_same(two.generate(*graph_wave[:1], sp, lora=graph_wave[1]), graph_ref)
        counts = two.runner.graph_runner.replay_counts()
        assert sum(counts.values()) > 0
        assert two.runner.worker_replay_counts() == {1: counts}
        two.runner.shutdown()


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "ep2"])
def test_triton_kernels_on_sharded_shapes_equal_tp1(tmp_path, tp_engine, expert_parallel):
    """The Triton kernels (interpreted on CPU) at a rank's shapes: half the intermediate dim, or half the
    experts with the other rank's pairs skipped; expert adapters ride along, a fused gate_up one and one with
    separate gate and up A's."""
    family = "qwen2_moe"
    base = save_base_checkpoint(family, tmp_path / "base", **INTERPRETED_LAYERS)
    path = str(make_peft_adapter(family, tmp_path / "ad", kind="attn+experts", rank=4, seed=1,
                                 config_overrides=INTERPRETED_LAYERS)[0])
    sep = str(make_peft_adapter(family, tmp_path / "sep", kind="experts", rank=4, seed=2,
                                config_overrides=INTERPRETED_LAYERS, **SEPARATE_GATE_UP)[0])
    kw = dict(lora_modules={"ad": path, "sep": sep}, max_loras=2)
    ps, loras = prompts(3, seed=3), [None, "ad", "sep"]
    sp = SamplingParams(max_tokens=2, **GREEDY)
    ref = Engine(config(base, **kw)).generate(ps, sp, lora=loras)
    two = tp_engine(config(base, tensor_parallel_size=2, enable_expert_parallel=expert_parallel,
                           moe_backend="triton", **kw))
    assert_same(two.generate(ps, sp, lora=loras), ref)


def test_triton_attention_and_fused_norms_on_sharded_shapes_equal_tp1(tmp_path, tp_engine):
    """The Triton attention backend's fused norms (interpreted on CPU) under TP: the residual add + norm follows
    the all-reduce, and olmoe's full-width q/k norm (spanning the ranks, one KV head replicated) keeps the torch
    path with its all-reduce while the rest of the layer runs the kernels."""
    overrides = CASES["olmoe"][0]
    base = save_base_checkpoint("olmoe", tmp_path / "base", **overrides)
    ps, sp = prompts(2, seed=5), SamplingParams(max_tokens=2, **GREEDY)
    ref = Engine(config(base)).generate(ps, sp)
    two = tp_engine(config(base, tensor_parallel_size=2, attention_backend="triton"))
    layer = two.runner.model.layers[0]
    assert layer.self_attn.prologue_kernels is None and layer.input_layernorm.kernels is not None
    assert_same(two.generate(ps, sp), ref)


@pytest.mark.parametrize("family,overrides", [("qwen2_moe", {}), ("olmoe", {"num_key_value_heads": 1})])
def test_a_rank_loads_exactly_its_slices_through_get_slice(tmp_path, monkeypatch, family, overrides):
    """Rank 1 of 2, loaded in-process (building a shard runs no collective): every parameter is the slice of the
    single-rank model that sharding.py describes, and no tensor was read whole with get_tensor (get_slice reads
    only the rank's rows; replicated norms and routers are the only whole reads)."""
    from moeserve.distributed.parallel_state import ParallelState
    from moeserve.models import loader
    from moeserve.model_spec import ModelSpec

    base = save_base_checkpoint(family, tmp_path / "base", **overrides)
    spec = ModelSpec.from_model_dir(base)
    full = loader.load_model(base, spec)
    real_open = loader.safe_open
    whole_reads, opened = [], []

    class Spy:  # a safe_open handle that records which tensors were read whole
        def __init__(self, *args, **kwargs):
            self.h = real_open(*args, **kwargs)
            opened.append(self)

        def get_tensor(self, name):
            whole_reads.append(name)
            return self.h.get_tensor(name)

        def __getattr__(self, name):
            return getattr(self.h, name)

    monkeypatch.setattr(loader, "safe_open", Spy)
    shard = loader.load_model(base, spec, tp=ParallelState(1, 2, None))
    assert opened and whole_reads == []

    d, H, V = spec.head_dim, spec.hidden_size, spec.vocab_size
    q = slice(spec.q_size // 2, spec.q_size)  # rank 1: the second half of the query heads
    kv = slice(0, d) if spec.num_kv_heads == 1 else slice(spec.kv_size // 2, spec.kv_size)  # replica / its half
    assert torch.equal(shard.embed_tokens, full.embed_tokens[V // 2:])
    assert torch.equal(shard.lm_head, full.lm_head[V // 2:])
    for a, b in zip(shard.layers, full.layers):
        qkv = b.self_attn.qkv_proj.weight
        k0 = spec.q_size
        want = torch.cat([qkv[q], qkv[k0:][kv], qkv[k0 + spec.kv_size:][kv]])
        assert torch.equal(a.self_attn.qkv_proj.weight, want)
        assert torch.equal(a.self_attn.o_proj.weight, b.self_attn.o_proj.weight[:, q])
        if spec.qk_norm == "full":
            assert torch.equal(a.self_attn.q_norm.weight, b.self_attn.q_norm.weight[q])
            assert torch.equal(a.self_attn.k_norm.weight, b.self_attn.k_norm.weight[kv])
        mlp, ref = a.mlp, b.mlp
        if not a.is_sparse:
            i = ref.down_proj.weight.shape[1]
            assert torch.equal(mlp.down_proj.weight, ref.down_proj.weight[:, i // 2:])
            continue
        i = spec.moe_intermediate_size
        assert torch.equal(mlp.router.weight, ref.router.weight)
        assert torch.equal(mlp.w13, torch.cat([ref.w13[:, i // 2:i], ref.w13[:, i + i // 2:]], dim=1))
        assert torch.equal(mlp.w2, ref.w2[:, :, i // 2:])
        if ref.shared_expert is not None:
            s = spec.shared_expert_intermediate_size
            gu = ref.shared_expert.gate_up_proj.weight
            assert torch.equal(mlp.shared_expert.gate_up_proj.weight, torch.cat([gu[s // 2:s], gu[s + s // 2:]]))
            assert torch.equal(mlp.shared_expert_gate.weight, ref.shared_expert_gate.weight)


def test_killed_worker_stops_the_engine_naming_the_rank(tmp_path, tp_engine):
    base = save_base_checkpoint("qwen3_moe", tmp_path / "base")
    engine = tp_engine(config(base, tensor_parallel_size=2))
    sp = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    assert len(engine.generate([[5, 6, 7]], sp)[0].token_ids) == 3
    worker = engine.runner.workers[0].proc
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(10)
    with pytest.raises(RankFailure, match=r"tensor-parallel rank 1 \(pid \d+\) was killed by signal 9"):
        engine.generate([[5, 6, 7]], sp)
    with pytest.raises(RankFailure, match="rank 1"):  # and it stays down
        engine.generate([[8, 9]], sp)


def test_hung_worker_times_out_naming_the_rank(tmp_path, tp_engine):
    base = save_base_checkpoint("mixtral", tmp_path / "base")
    # the stopped rank is named after dist_timeout: short, yet far above a step of this model on a busy machine
    engine = tp_engine(config(base, tensor_parallel_size=2, dist_timeout=5))
    sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    engine.generate([[5, 6, 7]], sp)
    worker = engine.runner.workers[0].proc
    os.kill(worker.pid, signal.SIGSTOP)  # alive, but never reaches the next collective
    try:
        with pytest.raises(RankFailure, match=r"rank\(s\) \[1\] are alive but did not take part"):
            engine.generate([[5, 6, 7]], sp)
    finally:
        if worker.is_alive():
            os.kill(worker.pid, signal.SIGKILL)


# ---- the all-reduce backend -------------------------------------------------------------------------------

BACKEND_SCENARIOS = [  # (CPU stand-in for symmetric memory, (step, rank) that fails), backend every rank must pick
    ((False, None), "gloo"),  # the real check: symmetric memory needs CUDA
    ((True, None), "symm_mem"),
    ((True, ("allocate", 1)), "gloo"),
    ((True, ("rendezvous", 0)), "gloo"),
    ((True, ("check", 1)), "gloo"),  # rank 1's first reduction gives a wrong sum
    ((True, ("earlier-engine", 0)), "gloo"),  # rank 0's process set symmetric memory up before (a fresh worker did not)
    ((True, None), "symm_mem"),  # and the flag is per process: cleared, the next engine takes it again
]


def test_all_reduce_backend_is_agreed_by_every_rank_and_falls_back_together(tmp_path):
    """Two gloo ranks ask for a symmetric buffer, one scenario after another in the same processes: a step that
    fails on either rank sends both to the process group; where symmetric memory is chosen, tensors of its dtype
    that fit its buffer take it (one-shot up to the threshold, two-shot above), the rest take gloo, every sum is
    right; leaving frees the buffer, then the group."""
    import json

    from all_reduce_probe import choose_backends
    from moeserve.distributed.parallel_state import rendezvous_store

    store = rendezvous_store(0, 3, is_master=True)
    torch.multiprocessing.spawn(choose_backends, args=(2, store.port, [s for s, _ in BACKEND_SCENARIOS],
                                                       str(tmp_path)), nprocs=2, join=True)
    for i, (_, backend) in enumerate(BACKEND_SCENARIOS):
        for rank in range(2):
            r = json.loads((tmp_path / f"rank{rank}-{i}.json").read_text())
            assert r["backend"] == backend, (i, rank, r)
            assert r["sums"] == {k: [3.0] for k in ("small", "large", "oversize", "fp64", "ragged")}, (i, rank, r)
            assert all(r["freed"]) and r["group_left"], (i, rank, r)
            # the start-up check runs both kernels once on the whole buffer, then the fitting tensors follow
            want = [["one_shot", 64], ["two_shot", 64], ["one_shot", 16], ["two_shot", 64]]
            assert r["calls"] == (want if backend == "symm_mem" else []), (i, rank, r)


def test_symm_mem_buffer_follows_the_config_and_every_rank_asks_alike():
    from moeserve.distributed.parallel_state import SYMM_MEM_MAX_BYTES
    from moeserve.worker.parallel_runner import symm_mem_buffer

    class Spec:  # the one field of a ModelSpec the buffer's size reads
        hidden_size = 2048

    def cfg(**kw):
        return EngineConfig(device="cpu", dtype="bfloat16", tensor_parallel_size=2, **kw)

    assert symm_mem_buffer(cfg(disable_custom_all_reduce=True), Spec) is None
    assert symm_mem_buffer(EngineConfig(device="cpu", dtype="bfloat16"), Spec) is None  # one rank
    # a prefill chunk of max_num_batched_tokens rows, or a decode batch of max_num_seqs, in the model dtype
    assert symm_mem_buffer(cfg(max_num_batched_tokens=512, max_num_seqs=64), Spec) == (512 * 2048, torch.bfloat16)
    assert symm_mem_buffer(cfg(max_num_batched_tokens=256, max_num_seqs=1024), Spec) == (1024 * 2048, torch.bfloat16)
    # capped: larger messages go through NCCL
    assert symm_mem_buffer(cfg(max_num_batched_tokens=1 << 16), Spec) == (SYMM_MEM_MAX_BYTES // 2, torch.bfloat16)


def test_symm_mem_is_refused_by_name_where_it_cannot_run(monkeypatch):
    from moeserve.distributed.parallel_state import symm_mem_unavailable

    cuda = torch.device("cuda", 0)
    assert "needs CUDA" in symm_mem_unavailable(torch.device("cpu"), 2, torch.bfloat16)
    assert "one rank" in symm_mem_unavailable(cuda, 1, torch.bfloat16)
    assert "torch.int8" in symm_mem_unavailable(cuda, 2, torch.int8)
    monkeypatch.setattr(torch, "__version__", "2.10.1+cu128")
    assert "needs torch >= 2.11" in symm_mem_unavailable(cuda, 2, torch.bfloat16)


def test_bench_tp_decode_runs_each_engine_in_its_own_child_and_reports_failed_ones():
    """`bench tp_decode --all-reduce symm_mem,nccl` on CPU: each engine runs in a child of its own, each multi-rank
    setting once per backend asked, one rank none; every row says what ran (on CPU the symm_mem request falls back
    to gloo). A setting whose engine cannot start (3 ranks for 4 heads) is a FAILED row per child with the child's
    error and stderr tail, and the settings after it still run."""
    from moeserve.bench import tp_decode
    from peft_fixtures import tiny_spec

    spec = tiny_spec("qwen3_moe", max_position_embeddings=1024)  # the bench's 512-token context fits
    rows = tp_decode.run(spec, ["tp1", "tp3", "tp2"], [2], ["base"], steps=2, repeats=1, device="cpu",
                         all_reduce=["symm_mem", "nccl"])
    assert [(r["setting"], r["asked"], r["all_reduce"]) for r in rows] == [
        ("tp1", "-", "-"), ("tp3", "symm_mem", "-"), ("tp3", "nccl", "-"), ("tp2", "symm_mem", "gloo"),
        ("tp2", "nccl", "gloo")]
    for r in rows[1:3]:
        assert "does not divide the model's num_attention_heads" in r["error"] and r["modes"] == ["base"]
        assert any("ValueError" in line for line in r["stderr_tail"])
    assert all(r["tok_s"] > 0 for r in rows if r["setting"] != "tp3")


def test_bench_tp_decode_kills_a_child_past_its_time_bound():
    """A child that runs past --child-timeout is killed and reported as a failed row, its stderr tail kept."""
    from moeserve.bench import tp_decode
    from peft_fixtures import tiny_spec

    spec = tiny_spec("qwen3_moe", max_position_embeddings=1024)
    # a million repeats cannot end within the bound
    rows = tp_decode.run(spec, ["tp1"], [1], ["base"], steps=2, repeats=10**6, device="cpu", child_timeout=3)
    assert len(rows) == 1 and "ran past --child-timeout 3 s" in rows[0]["error"]
    assert isinstance(rows[0]["stderr_tail"], list)


def test_bench_tp_decode_profile_is_refused_without_cuda(capsys, monkeypatch):
    from moeserve.bench import tp_decode

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exc:
        tp_decode.main(["--profile", "--settings", "tp2"])
    assert exc.value.code == 2 and "--profile needs CUDA" in capsys.readouterr().err


# ---- two GPUs ------------------------------------------------------------------------------------------

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")


@pytest.mark.gpu_multi
@two_gpus
@pytest.mark.parametrize("family", list(CASES))
def test_gpu_tp2_and_ep2_equal_tp1_for_every_family_with_mixed_adapters(tmp_path, tp_engine, family):
    """The CPU check above on two GPUs (NCCL, the Triton kernels, CUDA graphs), fp32: TP=2 and EP=2 give the
    tokens and logprobs of one GPU on waves that mix no adapter with each family's adapters."""
    overrides, kinds = CASES[family]
    base = save_base_checkpoint(family, tmp_path / "base", **overrides)
    paths = {name: str(make_peft_adapter(family, tmp_path / name, kind=kind, rank=rank, seed=i + 1,
                                         config_overrides=overrides, **(fmt[0] if fmt else {}))[0])
             for i, (name, (kind, rank, *fmt)) in enumerate(kinds.items())}
    names = list(paths)
    kw = dict(device="cuda", lora_modules=paths, max_loras=3, lora_target_modules=list(ALL_TARGETS),
              cuda_graph_bs=[1, 2, 4, 8])
    sp = SamplingParams(max_tokens=6, **GREEDY)
    waves = [[None, names[0], names[1], None, names[2]], [names[2], None, names[1]], [names[0]]]
    waves = [(prompts(len(loras), seed=10 * i + 3), loras) for i, loras in enumerate(waves)]
    with Engine(config(base, **kw)) as one:
        refs = [one.generate(ps, sp, lora=loras) for ps, loras in waves]
    for expert_parallel in (False, True):
        two = tp_engine(config(base, tensor_parallel_size=2, enable_expert_parallel=expert_parallel, **kw))
        for (ps, loras), ref in zip(waves, refs):
            assert_same(two.generate(ps, sp, lora=loras), ref)
        two.runner.shutdown()


@pytest.mark.gpu_multi
@two_gpus
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "ep2"])
def test_gpu_tp2_graphs_equal_eager_under_alternating_variants(tmp_path, tp_engine, expert_parallel):
    """NCCL + CUDA graphs at TP=2 (and EP=2): decode graphs (both variants, collectives recorded inside) give the
    eager engine's tokens on traffic that alternates base-only and adapter batches; both ranks replay the same
    GraphKeys, each variant at least once."""
    family = "qwen3_moe"
    base = save_base_checkpoint(family, tmp_path / "base")
    path = str(make_peft_adapter(family, tmp_path / "ad", kind="attn+experts", rank=4, seed=1)[0])
    kw = dict(model=str(base), device="cuda", dtype="float32", block_size=16, max_num_seqs=8, max_lora_rank=8,
              lora_modules={"ad": path}, tensor_parallel_size=2, enable_expert_parallel=expert_parallel,
              cuda_graph_bs=[1, 2, 4, 8], num_kv_blocks=256)
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    waves = [[None, None, None], ["ad", None, "ad"], [None], ["ad"], [None, None, None, None, None]]
    graphed = tp_engine(EngineConfig(**kw))
    outs_graph = [graphed.generate(prompts(len(w), seed=i), sp, lora=w) for i, w in enumerate(waves)]
    counts = graphed.runner.graph_runner.replay_counts()
    workers = graphed.runner.worker_replay_counts()
    graphed.runner.shutdown()
    eager = tp_engine(EngineConfig(**kw, enforce_eager=True))
    for i, w in enumerate(waves):
        ref = eager.generate(prompts(len(w), seed=i), sp, lora=w)
        for a, b in zip(outs_graph[i], ref):
            assert a.token_ids == b.token_ids
            assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-3
    assert workers == {1: counts}
    used = {k.split("-")[1] for k, v in counts.items() if v > 0}
    assert used == {"lora", "nolora"}


@pytest.mark.gpu_multi
@two_gpus
def test_gpu_tp2_bf16_triton_matches_tp1(tmp_path, tp_engine):
    """bf16 Triton kernels on sharded shapes: TP=2 greedy tokens equal TP=1's on most rows (bf16 sums in another
    order may flip a near-tie), first tokens all equal."""
    base = save_base_checkpoint("qwen2_moe", tmp_path / "base")
    kw = dict(model=str(base), device="cuda", dtype="bfloat16", block_size=16, max_num_seqs=8,
              cuda_graph_bs=[1, 2, 4, 8], num_kv_blocks=256)
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    ps = prompts(6, seed=3)
    one = Engine(EngineConfig(**kw))
    ref = one.generate(ps, sp)
    del one
    two = tp_engine(EngineConfig(**kw, tensor_parallel_size=2))
    outs = two.generate(ps, sp)
    assert [o.token_ids[0] for o in outs] == [o.token_ids[0] for o in ref]


def run_symm_mem_probe(model, adapter, dtype, expert_parallel, eager, out) -> dict:
    """One TP=2 engine with the symmetric-memory all-reduce, in a fresh interpreter (it serves the first engine
    of a process, and pytest's process has started others)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here.parent), str(here), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(here / "symm_mem_engine_probe.py"), str(model), str(adapter), dtype,
                           str(int(expert_parallel)), str(int(eager)), str(out)],
                          env=env, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(Path(out).read_text())


@pytest.mark.gpu_multi
@two_gpus
@pytest.mark.parametrize("dtype,tol,expert_parallel", [("float32", 1e-4, False), ("bfloat16", 2e-2, True)],
                         ids=["tp2-fp32", "ep2-bf16"])
def test_gpu_symm_mem_all_reduce_equals_nccl_eager_and_in_graphs(tmp_path, tp_engine, dtype, tol, expert_parallel):
    """TP=2 (and EP=2) with the symmetric-memory all-reduce (chosen on both ranks) against --disable-custom-all-reduce
    (NCCL), eager and with decode graphs that record its kernels, on traffic alternating base-only and adapter batches:
    the same greedy tokens, logprobs within the dtype's tolerance (two ranks' sums are one rounded add either
    way). Each symmetric-memory engine also shuts down cleanly: graphs, then the buffer, then the group, within a
    bound, without the teardown's abort, the worker exiting by itself."""
    from symm_mem_engine_probe import WAVES

    family = "qwen3_moe"
    base = save_base_checkpoint(family, tmp_path / "base")
    path = str(make_peft_adapter(family, tmp_path / "ad", kind="attn+experts", rank=4, seed=1)[0])
    kw = dict(model=str(base), device="cuda", dtype=dtype, block_size=16, max_num_seqs=8, max_lora_rank=8,
              lora_modules={"ad": path}, tensor_parallel_size=2, enable_expert_parallel=expert_parallel,
              cuda_graph_bs=[1, 2, 4, 8], num_kv_blocks=256, disable_custom_all_reduce=True)
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    for eager in (False, True):
        got = run_symm_mem_probe(base, path, dtype, expert_parallel, eager, tmp_path / f"symm{int(eager)}.json")
        assert got["backends"] == {"0": "symm_mem", "1": "symm_mem"}
        assert (got["replays"] > 0) != eager
        assert got["shutdown_returned"] and not got["teardown_aborted"]
        assert got["worker_exitcode"] == 0 and got["group_left"]
        engine = tp_engine(EngineConfig(**kw, enforce_eager=eager))
        assert engine.runner.tp.all_reduce_backend == "nccl"
        assert engine.runner.worker_all_reduce_backends() == {1: "nccl"}
        for i, w in enumerate(WAVES):
            ref = engine.generate(prompts(len(w), seed=i), sp, lora=w)
            for a, b in zip(got["waves"][i], ref):
                assert a["tokens"] == b.token_ids, (eager, a["tokens"], b.token_ids)
                assert max(abs(x - y.logprob) for x, y in zip(a["logprobs"], b.logprobs)) <= tol
        engine.runner.shutdown()


@pytest.mark.gpu_multi
@two_gpus
def test_gpu_second_engine_in_a_process_falls_back_to_nccl_together(tmp_path, tp_engine):
    """Symmetric memory serves a process's first TP engine only (a second rendezvous hung in torch 2.11): the
    second engine here — rank 0 in this process, a fresh worker — refuses it on rank 0, and both ranks agree on
    NCCL instead of one waiting in a rendezvous the other skipped."""
    base = save_base_checkpoint("qwen3_moe", tmp_path / "base")
    kw = dict(model=str(base), device="cuda", dtype="bfloat16", block_size=16, max_num_seqs=4,
              cuda_graph_bs=[1, 2, 4], num_kv_blocks=64, tensor_parallel_size=2, dist_timeout=60)
    backends = []
    for _ in range(2):
        engine = tp_engine(EngineConfig(**kw))
        backends.append({0: engine.runner.tp.all_reduce_backend, **engine.runner.worker_all_reduce_backends()})
        engine.generate(prompts(3, seed=2), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        engine.runner.shutdown()
    assert backends[1] == {0: "nccl", 1: "nccl"}
    assert backends[0][0] == backends[0][1]  # symm_mem when this test ran first, nccl after another engine


def test_bad_parallel_settings_are_refused_by_name(tmp_path):
    base = save_base_checkpoint("mixtral", tmp_path / "base")
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(--tensor-parallel-size\) 3 does not divide the model's num_attention_heads"):
        Engine(config(base, tensor_parallel_size=3))
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(--tensor-parallel-size\) must be a positive integer"):
        Engine(config(base, tensor_parallel_size=0))
    six = save_base_checkpoint("mixtral", tmp_path / "six", num_local_experts=6)
    Engine(config(six, tensor_parallel_size=1, enable_expert_parallel=True))  # one rank: nothing to split
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(--tensor-parallel-size\) 4 does not divide the model's num_experts \(6\)"):
        Engine(config(six, tensor_parallel_size=4, enable_expert_parallel=True))


def test_adapter_load_failing_on_one_rank_is_rolled_back_on_every_rank(tmp_path, tp_engine, monkeypatch):
    from moeserve.lora.slot_pool import lora_slot_state

    family = "qwen2_moe"
    base = save_base_checkpoint(family, tmp_path / "base")
    path = str(make_peft_adapter(family, tmp_path / "ad", kind="attn+experts", rank=4, seed=1)[0])
    kw = dict(enable_lora=True, max_loras=2)
    one = Engine(config(base, **kw))
    two = tp_engine(config(base, tensor_parallel_size=2, **kw))
    for engine in (one, two):  # registered after start: its slot load waits for its first request
        engine.load_lora("ad", path)
    pool = two.runner.lora_pool.pool  # rank 0's own slot pool, under the sharded wrapper
    real_load = pool.load

    def load_then_fail(slot, adapter):
        real_load(slot, adapter)
        raise RuntimeError("simulated device fault")

    monkeypatch.setattr(pool, "load", load_then_fail)
    sp = SamplingParams(max_tokens=3, **GREEDY)
    ps = prompts(2, seed=5)
    failed = two.generate(ps[:1], sp, lora="ad")[0]
    assert failed.finish_reason == "error"
    assert "could not be loaded on tensor-parallel rank 0 (RuntimeError: simulated device fault)" in failed.error
    # the worker had loaded its slice: cleared again, like rank 0's slot
    assert two.runner.worker_lora_slots() == {1: [(0, False), (0, False)]}
    assert lora_slot_state(pool) == [(0, False), (0, False)]
    monkeypatch.setattr(pool, "load", real_load)
    loras = ["ad", None]
    assert_same(two.generate(ps, sp, lora=loras), one.generate(ps, sp, lora=loras))
    assert [r for r, used in two.runner.worker_lora_slots()[1]] == [4, 0]


def test_bench_collectives_checks_and_times_each_collective_on_two_ranks(tmp_path):
    """`bench collectives` on gloo: every op it times first gave the right sums (else the row says error), and
    the symmetric-memory rows say why they were skipped on CPU."""
    import json

    from benchmarks.kernels import collectives

    assert collectives.main(["--device", "cpu", "--batches", "1,3", "--hidden", "8", "--iters", "2",
                             "--dtype", "float32", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "collectives.json").read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 3]
    for r in rows:
        for name in ("all_reduce", "all_gather", "reduce_scatter"):
            assert r["ops"][name]["eager_us"] > 0, r["ops"][name]
        for name in ("one_shot", "two_shot", "one_shot_copy", "two_shot_copy"):
            assert "needs CUDA" in r["ops"][name]["skipped"]
