"""Multi-LoRA serving against PEFT: per-family adapters, mixed batches, eviction, hot load, bad adapters."""
import logging

import pytest
import torch

from moeserve import Engine, EngineConfig, SamplingParams
from moeserve.lora.adapter import LoRAAdapterError
from moeserve.errors import AdapterInUseError, UnknownAdapterError
from moeserve.models.tiny import TINY_FAMILIES

from engine_probe import prompt_logits
from peft_fixtures import MALFORMED_MAX_RANK, make_malformed_adapters, make_peft_adapter, save_base_checkpoint

GREEDY = dict(temperature=0.0, ignore_eos=True)


def prompts_for(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]


def make_engine(base, **kw):
    kw.setdefault("max_lora_rank", 16)
    return Engine(EngineConfig(model=str(base), device="cpu", dtype="float32", block_size=4, **kw))


def peft_greedy(pm, prompt, n):
    with torch.no_grad():
        out = pm.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


CASES = [(f, "target_parameters") for f in TINY_FAMILIES] + [("mixtral", "per-expert"), ("qwen3_moe", "per-expert")]


@pytest.mark.parametrize("family,expert_format", CASES)
def test_attention_and_expert_lora_match_peft(tmp_path, family, expert_format):
    base = save_base_checkpoint(family, tmp_path / "base")
    per_expert = expert_format == "per-expert"
    path, pm = make_peft_adapter(family, tmp_path / "ad", kind="attn+experts", rank=4, seed=1, expert_format=expert_format,
                                 separate_gate_up=per_expert)
    # per-expert: gate_proj and up_proj with their own rank-4 A's fit --max-lora-rank 4 (not stacked into rank 8)
    engine = make_engine(base, lora_modules={"ad": str(path)}, max_lora_rank=4 if per_expert else 16)
    prompt = prompts_for([13], seed=2)[0]
    ours = prompt_logits(engine, prompt, "ad")
    with torch.no_grad():
        theirs = pm(input_ids=torch.tensor([prompt])).logits[0].float()
    assert (ours - theirs).abs().max().item() <= 1e-4
    out = engine.generate([prompt], SamplingParams(max_tokens=16, **GREEDY), lora="ad")[0]
    assert out.token_ids == peft_greedy(pm, prompt, 16)


def test_separate_gate_up_is_stacked_or_refused_without_up_a_buffers(tmp_path):
    """lora_separate_gate_up off: separate rank-4 gate and up LoRAs are held as one rank-8 LoRA, so --max-lora-rank 4
    refuses them by name (and names the flag), --max-lora-rank 8 serves them with PEFT's logits; auto (None) turns
    the up A buffers on for them."""
    family = "qwen3_moe"
    base = save_base_checkpoint(family, tmp_path / "base")
    path, pm = make_peft_adapter(family, tmp_path / "ad", kind="experts", rank=4, seed=5, expert_format="per-expert",
                                 separate_gate_up=True)
    with pytest.raises(LoRAAdapterError, match=r"rank 8, above its max_lora_rank 4 .*--lora-separate-gate-up"):
        make_engine(base, lora_modules={"ad": str(path)}, max_lora_rank=4, lora_separate_gate_up=False)
    stacked = make_engine(base, lora_modules={"ad": str(path)}, max_lora_rank=8, lora_separate_gate_up=False)
    auto = make_engine(base, lora_modules={"ad": str(path)}, max_lora_rank=4)
    assert not stacked.lora_manager.pool.separate_gate_up and auto.lora_manager.pool.separate_gate_up
    prompt = prompts_for([11], seed=6)[0]
    with torch.no_grad():
        theirs = pm(input_ids=torch.tensor([prompt])).logits[0].float()
    for engine, rank in ((stacked, 8), (auto, 4)):
        assert (prompt_logits(engine, prompt, "ad") - theirs).abs().max().item() <= 1e-4
        assert engine.lora_manager.pool.slot_ranks.max().item() == rank


@pytest.mark.parametrize("family,kind,lora_kw", [
    ("qwen3_moe", "attn+experts", dict(rank_pattern={"v_proj": 2}, alpha_pattern={"q_proj": 3.0})),
    ("mixtral", "attn+experts", dict(use_rslora=True)),
    ("olmoe", "attn+experts", dict(shared_outer=True)),
    ("qwen2_moe", "shared-expert", {}),
    ("qwen3_moe", "dense-mlp", {}),
])
def test_scaling_variants_shared_outer_shared_and_dense_mlp_match_peft(tmp_path, family, kind, lora_kw):
    base = save_base_checkpoint(family, tmp_path / "base")
    path, pm = make_peft_adapter(family, tmp_path / "ad", kind=kind, rank=4, seed=3, **lora_kw)
    engine = make_engine(base, lora_modules={"ad": str(path)})
    prompt = prompts_for([10], seed=4)[0]
    with torch.no_grad():
        theirs = pm(input_ids=torch.tensor([prompt])).logits[0].float()
        base_logits = prompt_logits(engine, prompt)
    ours = prompt_logits(engine, prompt, "ad")
    assert (ours - theirs).abs().max().item() <= 1e-4
    assert (ours - base_logits).abs().max().item() > 1e-3  # the adapter really changes the output


def test_mixed_batch_rows_equal_single_runs_and_base_rows_are_bitwise(tmp_path):
    family = "qwen3_moe"
    base = save_base_checkpoint(family, tmp_path / "base")
    a, _ = make_peft_adapter(family, tmp_path / "a", rank=4, seed=5)
    b, _ = make_peft_adapter(family, tmp_path / "b", rank=8, seed=6)
    engine = make_engine(base, lora_modules={"A": str(a), "B": str(b)})
    plain = make_engine(base)
    loras = [None, "A", "B", "A", None]
    prompts = prompts_for([6, 11, 4, 9, 13], seed=7)
    sp = SamplingParams(max_tokens=10, logprobs=2, **GREEDY)
    mixed = engine.generate(prompts, sp, lora=loras)
    for p, lo, out in zip(prompts, loras, mixed):
        single = engine.generate([p], sp, lora=lo)[0]
        assert out.token_ids == single.token_ids
    base_rows = plain.generate(prompts, sp)  # the same batch shapes with LoRA disabled
    # None rows: identical tokens and bitwise-identical logprobs
    for out, ref in zip([mixed[0], mixed[4]], [base_rows[0], base_rows[4]]):
        assert out.token_ids == ref.token_ids
        assert [x.logprob for x in out.logprobs] == [x.logprob for x in ref.logprobs]
    # and a full batch of base rows through the LoRA engine equals the LoRA-disabled engine bitwise
    lo = prompt_logits(engine, prompts[2])
    assert torch.equal(lo, prompt_logits(plain, prompts[2]))


def test_eviction_with_two_slots_and_five_adapters_staggered(tmp_path):
    family = "mixtral"
    base = save_base_checkpoint(family, tmp_path / "base")
    paths = {f"ad{i}": str(make_peft_adapter(family, tmp_path / f"ad{i}", rank=2 + i % 3, seed=10 + i)[0])
             for i in range(5)}
    engine = make_engine(base, max_loras=2, lora_modules=paths)
    reference = make_engine(base, max_loras=1, lora_modules=paths)
    names = [None] + list(paths)
    prompts = prompts_for([5 + (i * 5) % 17 for i in range(20)], seed=11)
    loras = [names[(i * 7) % 6] for i in range(20)]
    max_tokens = [3 + i % 6 for i in range(20)]
    want = [reference.generate([p], SamplingParams(max_tokens=m, **GREEDY), lora=lo)[0].token_ids
            for p, lo, m in zip(prompts, loras, max_tokens)]
    ids, final, step, pending = {}, {}, 0, list(range(20))
    max_distinct = 0
    while pending or engine.has_unfinished():
        for i in [i for i in pending if i // 2 <= step]:
            ids[i] = engine.add_request(prompts[i], SamplingParams(max_tokens=max_tokens[i], **GREEDY), lora=loras[i])
            pending.remove(i)
        running = {s.lora_name for s in engine.scheduler.running if s.lora_name}
        max_distinct = max(max_distinct, len(running))
        for o in engine.step():
            if o.finished:
                final[o.request_id] = o
        step += 1
    assert [final[ids[i]].token_ids for i in range(20)] == want
    assert max_distinct <= 2
    assert engine.stats().lora_evictions_total > 0


def test_hot_load_unload_while_requests_run(tmp_path):
    family = "olmoe"
    base = save_base_checkpoint(family, tmp_path / "base")
    a, pm_a = make_peft_adapter(family, tmp_path / "a", rank=4, seed=20)
    b, pm_b = make_peft_adapter(family, tmp_path / "b", rank=4, seed=21)
    engine = make_engine(base, enable_lora=True, lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "experts"])
    engine.load_lora("A", str(a))
    prompt = prompts_for([8], seed=22)[0]
    ra = engine.add_request(prompt, SamplingParams(max_tokens=12, **GREEDY), lora="A")
    engine.step()
    engine.load_lora("B", str(b))  # loaded while A's request runs
    rb = engine.add_request(prompt, SamplingParams(max_tokens=12, **GREEDY), lora="B")
    engine.unload_lora("A")  # drains: A's running request finishes on A, new ones are refused
    with pytest.raises(UnknownAdapterError, match="'A' is not loaded"):
        engine.add_request(prompt, SamplingParams(max_tokens=2), lora="A")
    assert "A" not in engine.list_loras() and "A" in engine.lora_manager.slot_name
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] = o
    assert outs[rb].token_ids == peft_greedy(pm_b, prompt, 12)
    assert outs[ra].token_ids == peft_greedy(pm_a, prompt, 12)
    assert "A" not in engine.lora_manager.slot_name  # drained: its slot is free
    with pytest.raises(UnknownAdapterError, match="'A'"):
        engine.unload_lora("A")
    with pytest.raises(UnknownAdapterError, match="'A'"):
        engine.add_request(prompt, SamplingParams(max_tokens=2), lora="A")
    assert "A" not in engine.list_loras() and "B" in engine.list_loras()
    with pytest.raises(LoRAAdapterError, match="already loaded"):
        engine.load_lora("B", str(b))


def test_malformed_adapters_fail_by_name_and_leave_the_engine_unchanged(tmp_path):
    family = "qwen3_moe"
    base = save_base_checkpoint(family, tmp_path / "base")
    good, pm = make_peft_adapter(family, tmp_path / "good", rank=4, seed=30)
    corpus = make_malformed_adapters(good, tmp_path / "bad")
    assert len(corpus) >= 12
    engine = make_engine(base, enable_lora=True, max_lora_rank=MALFORMED_MAX_RANK, max_loras=2)
    engine.load_lora("good", str(good))
    prompt = prompts_for([7], seed=31)[0]
    before = engine.generate([prompt], SamplingParams(max_tokens=8, **GREEDY), lora="good")[0].token_ids
    slots_before = list(engine.lora_manager.slot_name)
    for case, (path, expected) in corpus.items():
        with pytest.raises(LoRAAdapterError) as err:
            engine.load_lora(f"bad-{case}", str(path))
        assert expected in str(err.value), (case, str(err.value))
        assert engine.list_loras() == ["good"]
        assert engine.lora_manager.slot_name == slots_before
    after = engine.generate([prompt], SamplingParams(max_tokens=8, **GREEDY), lora="good")[0].token_ids
    assert after == before == peft_greedy(pm, prompt, 8)


def test_adapter_rank_above_the_engine_limit_and_unsupported_target(tmp_path):
    family = "qwen3_moe"
    base = save_base_checkpoint(family, tmp_path / "base")
    big, _ = make_peft_adapter(family, tmp_path / "big", rank=32, seed=40)
    attn_only_engine = make_engine(base, enable_lora=True, max_lora_rank=64, lora_target_modules=["q_proj", "v_proj"])
    with pytest.raises(LoRAAdapterError, match="experts|k_proj|o_proj"):
        attn_only_engine.load_lora("big", str(big))
    small_engine = make_engine(base, enable_lora=True, max_lora_rank=16)
    with pytest.raises(LoRAAdapterError, match="rank 32"):
        small_engine.load_lora("big", str(big))


def test_pinned_adapter_is_never_evicted(tmp_path):
    family = "qwen3_moe"
    base = save_base_checkpoint(family, tmp_path / "base")
    paths = {n: str(make_peft_adapter(family, tmp_path / n, rank=2, seed=50 + i)[0]) for i, n in enumerate("PXY")}
    engine = make_engine(base, enable_lora=True, max_loras=2)
    engine.load_lora("P", paths["P"], pinned=True)
    engine.load_lora("X", paths["X"])
    engine.load_lora("Y", paths["Y"])
    pinned_slot = engine.lora_manager.slot_name.index("P")
    prompt = prompts_for([6], seed=51)[0]
    for name in ("X", "Y", "X", "Y"):  # the one free slot churns; P's slot stays
        engine.generate([prompt], SamplingParams(max_tokens=2, **GREEDY), lora=name)
        assert engine.lora_manager.slot_name[pinned_slot] == "P"
    assert engine.stats().lora_evictions_total >= 3


def test_slot_buffers_never_move_and_unloaded_slots_are_zeroed(tmp_path):
    family = "qwen2_moe"
    base = save_base_checkpoint(family, tmp_path / "base")
    # a: separate gate_proj / up_proj A's per expert; b: one fused gate_up A
    a, _ = make_peft_adapter(family, tmp_path / "a", rank=4, seed=60, expert_format="per-expert", separate_gate_up=True)
    b, _ = make_peft_adapter(family, tmp_path / "b", rank=2, seed=61)
    engine = make_engine(base, enable_lora=True, max_loras=1, lora_separate_gate_up=True)
    model = engine.runner.model

    def buffers():
        out = []
        for layer in model.layers:
            for lin in engine.runner.lora_pool._linears(layer):  # attention, dense MLP, shared expert
                out += [lin.lora_a, lin.lora_b]
            bufs = getattr(layer.mlp, "lora_bufs", None)
            if bufs is not None:
                out += [bufs.gate_up_a, bufs.gate_up_b, bufs.down_a, bufs.down_b, bufs.up_a, bufs.gate_up_separate]
        return [t for t in out if t is not None]

    expert_bufs = [layer.mlp.lora_bufs for layer in model.layers if getattr(layer.mlp, "lora_bufs", None)]
    assert expert_bufs

    ptrs = [t.data_ptr() for t in buffers()]
    prompt = prompts_for([5], seed=62)[0]
    engine.load_lora("a", str(a))
    engine.load_lora("b", str(b))
    first_a = prompt_logits(engine, prompt, "a")
    assert engine.lora_manager.pool.slot_ranks.tolist() == [4]
    for bufs in expert_bufs:  # a gate A and an up A, each of rank 4
        assert bufs.gate_up_separate.tolist() == [1] and bufs.up_a[0, :, :4].abs().sum() > 0
    engine.generate([prompt], SamplingParams(max_tokens=2, **GREEDY), lora="b")  # evicts a from the one slot
    assert engine.lora_manager.pool.slot_ranks.tolist() == [2]
    for bufs in expert_bufs:  # one A; a's up A is gone
        assert bufs.gate_up_separate.tolist() == [0] and bufs.up_a[0].abs().sum() == 0
    again_a = prompt_logits(engine, prompt, "a")  # back to separate A's in the same slot
    assert [bufs.gate_up_separate.tolist() for bufs in expert_bufs] == [[1]] * len(expert_bufs)
    assert torch.equal(again_a, first_a)
    engine.generate([prompt], SamplingParams(max_tokens=2, **GREEDY), lora="b")
    q_rows = model.layers[0].self_attn.qkv_proj.lora_a[0, 0]
    assert q_rows[2:].abs().sum() == 0 and q_rows[:2].abs().sum() > 0  # rank columns beyond 2 are zero
    engine.unload_lora("b")
    assert all(t[0].abs().sum() == 0 for t in buffers()) and engine.lora_manager.pool.slot_ranks.tolist() == [0]
    assert [t.data_ptr() for t in buffers()] == ptrs


def test_default_max_lora_rank_is_16_and_the_pool_logs_its_bytes_per_target(tmp_path, caplog):
    """Issue 10.3: --enable-lora with defaults reserved 8 slots x rank 64 x every target. The default rank is now
    vLLM's 16, and the pool reports what it reserves, per target, at start."""
    assert EngineConfig().max_lora_rank == 16
    base = save_base_checkpoint("qwen2_moe", tmp_path / "base")  # attention, routed experts and a shared expert
    cfg = dict(model=str(base), device="cpu", dtype="float32", block_size=4, enable_lora=True)
    with caplog.at_level(logging.INFO, logger="moeserve"):
        engine = Engine(EngineConfig(**cfg))
    pool, s = engine.lora_manager.pool, engine.spec
    L, R = engine.config.max_loras, 16
    assert pool.max_rank == R
    H, hd, E, inter, shared = s.hidden_size, s.head_dim, s.num_experts, s.moe_intermediate_size, \
        s.shared_expert_intermediate_size
    q, kv = s.num_heads * hd, s.num_kv_heads * hd
    sparse, dense = sum(s.sparse_layers), s.num_layers - sum(s.sparse_layers)
    assert sparse and dense and shared > 0
    elements = {  # per slot and rank: A [slices, R, in] + B [out, R] of every target, over the layers that have it
        "q_proj/k_proj/v_proj": s.num_layers * (3 * H + q + 2 * kv),
        "o_proj": s.num_layers * (q + H),
        "experts": sparse * E * (H + 2 * inter + inter + H),
        "shared_expert": sparse * ((2 * H + 2 * shared) + (shared + H)),
        "shared_expert_gate": sparse * (H + 1),
        "router": sparse * (H + E),
        "gate_proj/up_proj/down_proj": dense * ((2 * H + 2 * s.intermediate_size) + (s.intermediate_size + H)),
    }
    want = {k: 4 * L * R * v for k, v in elements.items()}  # fp32
    assert pool.nbytes_by_target == want and pool.nbytes == sum(want.values())
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("LoRA slot pool"))
    assert f"{L} slots x rank {R}" in line and all(k in line for k in want) and "--max-lora-rank" in line
    rank64 = Engine(EngineConfig(**cfg, max_lora_rank=64)).lora_manager.pool
    assert rank64.nbytes == 4 * pool.nbytes  # the pool scales with max_lora_rank
    # separate gate and up A's: an up A [H] per rank and expert slot, and a per-slot int32 flag per sparse layer
    separate = Engine(EngineConfig(**cfg, lora_separate_gate_up=True)).lora_manager.pool
    assert separate.nbytes_by_target["experts"] == want["experts"] + 4 * L * (R * sparse * E * H + sparse)
    assert not pool.separate_gate_up and separate.separate_gate_up


def test_pinning_the_last_slot_that_queued_requests_need_is_refused(tmp_path):
    """AdapterInUseError is kept for pin conflicts: pinning may not take the last slot queued requests need."""
    family = "qwen3_moe"
    base = save_base_checkpoint(family, tmp_path / "base")
    paths = {n: str(make_peft_adapter(family, tmp_path / n, rank=2, seed=80 + i)[0]) for i, n in enumerate("XY")}
    engine = make_engine(base, enable_lora=True, max_loras=1)
    engine.load_lora("X", paths["X"])
    rid = engine.add_request(prompts_for([5], seed=81)[0], SamplingParams(max_tokens=2, **GREEDY), lora="X")
    with pytest.raises(AdapterInUseError, match="cannot pin 'Y'"):
        engine.load_lora("Y", paths["Y"], pinned=True)
    assert engine.list_loras() == ["X"]
    assert engine.abort(rid)
    engine.load_lora("Y", paths["Y"], pinned=True)
    assert engine.lora_manager.slot_name == ["Y"]
