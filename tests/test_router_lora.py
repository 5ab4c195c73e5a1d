"""LoRA on the MoE router (PEFT `all-linear`) served against PEFT, with both backends.

The router's ΔW is scaled up so that it changes which experts tokens pick (asserted): a router LoRA applied
after top-k, or not at all, then gives different tokens and logprobs than PEFT.
"""
import pytest
import torch

from moeserve import Engine, EngineConfig, SamplingParams
from peft_fixtures import make_peft_adapter, save_base_checkpoint, tiny_base_model

ROUTER_B_SCALE = 8.0
FAMILIES = {"qwen3_moe": "all-linear", "mixtral": "all-linear", "olmoe": "all-linear",
            "qwen2_moe": "all-linear+router"}  # PEFT's all-linear leaves qwen2's router out; add it
GREEDY = dict(temperature=0.0, ignore_eos=True)


def prompts_for(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]


def routers_changed(pm, family, ids) -> int:
    """Tokens x sparse layers whose top-k experts under PEFT's adapted router differ from the base router's on
    the same hidden states (those PEFT's adapted model feeds the router)."""
    base = tiny_base_model(family).state_dict()
    seen = []

    def hook(module, args, output):
        seen.append((module.layer_name, args[0].reshape(-1, args[0].shape[-1]), output[2]))

    handles = []
    for name, m in pm.named_modules():
        if name.endswith("mlp.gate"):  # the outermost wrapper of the router
            m.layer_name = "layers." + name.split(".layers.")[1].split(".")[0]
            handles.append(m.register_forward_hook(hook))
    try:
        with torch.no_grad():
            pm(input_ids=torch.tensor([ids]))
    finally:
        for h in handles:
            h.remove()
    assert seen, "no router LoRA in the PEFT model"
    changed = 0
    for layer, x, adapted_ids in seen:
        logits = x @ base[f"model.{layer}.mlp.gate.weight"].t()
        base_ids = torch.topk(logits, adapted_ids.shape[-1], dim=-1).indices
        changed += (base_ids.sort(-1).values != adapted_ids.sort(-1).values).any(-1).sum().item()
    return changed


def peft_greedy_with_logprobs(pm, prompt, n):
    with torch.no_grad():
        out = pm.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        logits = pm(input_ids=out).logits[0].float()
    tokens = out[0, len(prompt):].tolist()
    logprobs = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
    return tokens, [logprobs[i, t].item() for i, t in enumerate(tokens)]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """family -> (base checkpoint, adapter folder, PeftModel), built once for both backends."""
    root = tmp_path_factory.mktemp("router_lora")
    out = {}
    for family, kind in FAMILIES.items():
        base = save_base_checkpoint(family, root / family / "base")
        path, pm = make_peft_adapter(family, root / family / "ad", kind=kind, rank=4, seed=5,
                                     router_b_scale=ROUTER_B_SCALE)
        out[family] = (base, path, pm)
    return out


# The triton LoRA kernels run under Triton's interpreter on CPU, ~25 s per family: qwen2_moe takes the router and
# the shared-expert gate through dense_lora (the same kernel for every family); fused_moe without expert LoRA.
@pytest.mark.parametrize("family,backend", [(f, "torch") for f in FAMILIES] + [("qwen2_moe", "triton")])
def test_router_lora_matches_peft(adapters, family, backend):
    base, path, pm = adapters[family]
    prompt = prompts_for([9], seed=6)[0]
    assert routers_changed(pm, family, prompt) > 0  # the router LoRA really moves tokens to other experts
    engine = Engine(EngineConfig(model=str(base), device="cpu", dtype="float32", block_size=16,
                                 moe_backend=backend, max_loras=2,  # LoRA kernels follow moe_backend
                                 lora_modules={"ad": str(path)}))
    assert "router" in engine.lora_manager.pool.targets  # inferred from the adapter
    n = 4
    out = engine.generate([prompt], SamplingParams(max_tokens=n, logprobs=0, **GREEDY), lora="ad")[0]
    tokens, logprobs = peft_greedy_with_logprobs(pm, prompt, n)
    assert out.token_ids == tokens
    assert max(abs(x.logprob - y) for x, y in zip(out.logprobs, logprobs)) <= 1e-4


def test_router_lora_rows_in_a_mixed_batch(adapters):
    """Rows with the router adapter equal their single runs; rows without it are bitwise the LoRA-disabled
    engine's (the router's no-adapter path is the plain linear)."""
    base, path, _ = adapters["mixtral"]
    kw = dict(model=str(base), device="cpu", dtype="float32", block_size=16)
    engine = Engine(EngineConfig(**kw, lora_modules={"ad": str(path)}))
    plain = Engine(EngineConfig(**kw))
    prompts = prompts_for([7, 12, 5, 9], seed=8)
    loras = [None, "ad", None, "ad"]
    sp = SamplingParams(max_tokens=5, logprobs=1, **GREEDY)
    mixed = engine.generate(prompts, sp, lora=loras)
    base_rows = plain.generate(prompts, sp)
    for p, lo, got, ref in zip(prompts, loras, mixed, base_rows):
        if lo is None:
            assert got.token_ids == ref.token_ids
            assert [x.logprob for x in got.logprobs] == [x.logprob for x in ref.logprobs]
        else:
            single = engine.generate([p], sp, lora=lo)[0]
            assert got.token_ids == single.token_ids
            assert got.token_ids != ref.token_ids or got.logprobs != ref.logprobs


def test_router_target_can_be_left_out_and_named(adapters):
    base, path, _ = adapters["olmoe"]
    kw = dict(model=str(base), device="cpu", dtype="float32", enable_lora=True, max_loras=1)
    no_router = Engine(EngineConfig(**kw, lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "experts"]))
    assert all(layer.mlp.router.lora_a is None for layer in no_router.runner.model.layers)
    from moeserve.lora.adapter import LoRAAdapterError

    with pytest.raises(LoRAAdapterError, match=r"targets router .*--lora-target-modules\) including 'router'"):
        no_router.load_lora("ad", str(path))
    named = Engine(EngineConfig(**kw, lora_target_modules=["router"]))
    assert named.lora_manager.pool.nbytes_by_target.keys() == {"router"}


@pytest.mark.gpu
def test_router_lora_in_cuda_graphs(adapters):
    """bf16 on the GPU: graphs (both variants) equal eager with router adapters in alternating traffic; the
    nolora graph of a router-LoRA engine is bitwise the LoRA-disabled engine's and records the same kernels."""
    from moeserve.worker.graph_runner import LORA, NOLORA, GraphKey

    base, path, _ = adapters["mixtral"]
    kw = dict(model=str(base), device="cuda", block_size=16, cuda_graph_bs=[1, 2, 4], kv_cache_memory_bytes=256 << 20)
    dual = Engine(EngineConfig(**kw, lora_modules={"ad": str(path)}, max_loras=2))
    eager = Engine(EngineConfig(**kw, lora_modules={"ad": str(path)}, max_loras=2, enforce_eager=True))
    plain = Engine(EngineConfig(**kw))
    assert "router" in dual.lora_manager.pool.targets
    ps = prompts_for([7, 12, 4], seed=9)
    sp = SamplingParams(max_tokens=8, logprobs=2, **GREEDY)
    for loras in ([None] * 3, ["ad"] * 3, [None, "ad", None]):
        for g, w in zip(dual.generate(ps, sp, lora=loras), eager.generate(ps, sp, lora=loras)):
            assert g.token_ids == w.token_ids
            assert max(abs(x.logprob - y.logprob) for x, y in zip(g.logprobs, w.logprobs)) <= 0.05
    gr = dual.runner.graph_runner
    assert gr.replays[GraphKey(4, NOLORA)] > 0 and gr.replays[GraphKey(4, LORA)] > 0
    for g, w in zip(dual.generate(ps, sp), plain.generate(ps, sp)):
        assert g.token_ids == w.token_ids
        assert [(x.logprob, x.top) for x in g.logprobs] == [(x.logprob, x.top) for x in w.logprobs]
    nk_dual = gr.graphs[GraphKey(4, NOLORA)].num_kernels()
    if nk_dual is None:
        pytest.skip("cuda-python not available to count graph nodes")
    assert nk_dual == plain.runner.graph_runner.graphs[GraphKey(4, NOLORA)].num_kernels() \
        < gr.graphs[GraphKey(4, LORA)].num_kernels()
