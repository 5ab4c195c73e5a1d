"""FP8 base weights in the engine (issue 25): block-wise FP8 checkpoints in the published layout, `--quantization fp8`
at load, LoRA on an FP8 base, tensor-parallel scale sharding.

References are independent of the engine's FP8 code: transformers (and PEFT) in float32 on the checkpoint's weights
dequantized by the published rule (fp8 x scale_inv per 128 x 128 block) and saved as a plain checkpoint. The engine
multiplies those same dequantized values (weight-only, fp32 serving dtype), so the bound is the one of the plain fp32
parity tests (tests/test_engine.py): 1e-4 absolute on logits of magnitude ~1, i.e. fp32 summation order only; no
FP8 rounding enters either side.
"""
import json
import shutil

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file, save_file

from moeserve import Engine, EngineConfig, SamplingParams
from moeserve.kernels.fp8 import dequantize_block_fp8
from moeserve.models.tiny import FP8_QUANTIZATION_CONFIG, TINY_FAMILIES, fp8_state, make_tiny

from engine_probe import prompt_ids, prompt_logits, transformers_greedy
from peft_fixtures import INTERPRETED_LAYERS, make_peft_adapter, save_base_checkpoint

GREEDY = dict(temperature=0.0, ignore_eos=True)
TOL = 1e-4


def engine_for(path, **kw) -> Engine:
    kw.setdefault("block_size", 4)
    return Engine(EngineConfig(model=str(path), device="cpu", dtype="float32", **kw))


def hf_model(path):
    return tf.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager").eval()


def _weights_file(folder):
    (weights,) = folder.glob("*.safetensors")
    return weights


def dequantized_copy(src, dst):
    """The FP8 checkpoint `src` as a plain float32 one: every `<name>` with a `<name>_scale_inv` dequantized by the
    published rule (a fused gate_up's scale rows: gate's, then up's), quantization_config dropped."""
    shutil.copytree(src, dst)
    tensors = load_file(_weights_file(dst))
    out = {}
    for name, t in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        s = tensors.get(name + "_scale_inv")
        if s is None:
            out[name] = t
        elif name.endswith("gate_up_proj"):
            half, srows = t.shape[1] // 2, s.shape[1] // 2
            out[name] = torch.cat([dequantize_block_fp8(t[:, :half], s[:, :srows]),
                                   dequantize_block_fp8(t[:, half:], s[:, srows:])], 1)
        else:
            out[name] = dequantize_block_fp8(t, s)
    save_file(out, str(_weights_file(dst)))
    cfg = json.loads((dst / "config.json").read_text())
    del cfg["quantization_config"]
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def fp8_copy(src, dst):
    """A plain checkpoint written as a block-wise FP8 one (tiny.fp8_state: the published layout)."""
    shutil.copytree(src, dst)
    weights = _weights_file(dst)
    save_file(fp8_state(load_file(weights)), str(weights))
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "quantization_config": FP8_QUANTIZATION_CONFIG}))
    return dst


@pytest.mark.parametrize("family,layout", [(f, "per_expert") for f in TINY_FAMILIES] + [("qwen3_moe", "fused")])
def test_fp8_checkpoint_matches_transformers_on_its_dequantized_weights(tmp_path, family, layout):
    fp8 = make_tiny(family, tmp_path / "fp8", quantization="fp8", expert_layout=layout, seed=5)
    tensors = load_file(_weights_file(fp8))
    assert tensors["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert tensors["model.layers.0.self_attn.q_proj.weight_scale_inv"].dtype == torch.float32
    assert tensors["model.embed_tokens.weight"].dtype == torch.float32
    engine = engine_for(fp8)
    assert engine.runner.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    ref = hf_model(dequantized_copy(fp8, tmp_path / "deq"))
    ids = prompt_ids(23, seed=1)
    with torch.no_grad():
        theirs = ref(torch.tensor([ids])).logits[0].float()
    assert (prompt_logits(engine, ids) - theirs).abs().max().item() <= TOL
    prompt = prompt_ids(9, seed=2)
    out = engine.generate([prompt], SamplingParams(max_tokens=16, **GREEDY))[0]
    assert out.token_ids == transformers_greedy(ref, prompt, 16)


def test_modules_to_not_convert_stay_as_stored(tmp_path):
    """A checkpoint's modules_to_not_convert (HF) / ignored_layers (vLLM) are stored plain and served plain: here
    layer 0's attention and layer 1's dense MLP; every other projection is FP8. Logits as transformers' on the
    checkpoint dequantized."""
    plain = make_tiny("qwen3_moe", tmp_path / "plain", seed=4)
    fp8 = fp8_copy(plain, tmp_path / "fp8")
    weights = _weights_file(fp8)
    tensors, originals = load_file(weights), load_file(_weights_file(plain))
    kept = ("model.layers.0.self_attn.", "model.layers.1.mlp.")
    for name in list(tensors):
        if name.startswith(kept):
            tensors.pop(name)
            if not name.endswith("_scale_inv"):
                tensors[name] = originals[name]
    save_file(tensors, str(weights))
    cfg = json.loads((fp8 / "config.json").read_text())
    cfg["quantization_config"]["modules_to_not_convert"] = ["lm_head", "model.layers.0.self_attn"]
    cfg["quantization_config"]["ignored_layers"] = ["model.layers.1.mlp"]
    (fp8 / "config.json").write_text(json.dumps(cfg))
    engine = engine_for(fp8)
    layers = engine.runner.model.layers
    assert layers[0].self_attn.qkv_proj.weight.dtype == torch.float32
    assert layers[1].mlp.gate_up_proj.weight.dtype == torch.float32
    assert layers[1].self_attn.o_proj.weight.dtype == torch.float8_e4m3fn
    assert layers[0].mlp.w13.dtype == torch.float8_e4m3fn
    ref = hf_model(dequantized_copy(fp8, tmp_path / "deq"))
    ids = prompt_ids(19, seed=6)
    with torch.no_grad():
        theirs = ref(torch.tensor([ids])).logits[0].float()
    assert (prompt_logits(engine, ids) - theirs).abs().max().item() <= TOL


def test_make_tiny_command_writes_the_published_fp8_layout(tmp_path):
    from moeserve.cli import main as cli_main

    out = tmp_path / "olmoe-fp8"
    assert cli_main(["make-tiny", "--family", "olmoe", "--out", str(out), "--quantization", "fp8"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                          "weight_block_size": [128, 128]}
    tensors = load_file(_weights_file(out))
    w, s = tensors["model.layers.0.mlp.experts.3.down_proj.weight"], tensors[
        "model.layers.0.mlp.experts.3.down_proj.weight_scale_inv"]
    assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and tuple(s.shape) == (1, 1)  # [64, 48]
    for plain in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", "model.layers.0.mlp.gate.weight"):
        assert tensors[plain].dtype == torch.float32 and plain + "_scale_inv" not in tensors


def test_quantization_at_load_equals_the_fp8_checkpoint_of_the_same_weights(tmp_path):
    """--quantization fp8 on a bf16 checkpoint loads the bytes an FP8 checkpoint written from it holds; the weights
    take half the bytes of the bf16 engine's, and the logits stay near bf16's."""
    plain = make_tiny("qwen2_moe", tmp_path / "bf16", dtype="bfloat16", seed=7)
    fp8 = make_tiny("qwen2_moe", tmp_path / "fp8", dtype="bfloat16", seed=7, quantization="fp8")
    ids = prompt_ids(17, seed=3)
    at_load = engine_for(plain, quantization="fp8")
    from_ckpt = engine_for(fp8)
    assert from_ckpt.config.quantization == "fp8"  # declared by the checkpoint, flag unset
    assert torch.equal(prompt_logits(at_load, ids), prompt_logits(from_ckpt, ids))
    same = engine_for(fp8, quantization="fp8")  # the flag agreeing with the checkpoint
    assert torch.equal(prompt_logits(same, ids), prompt_logits(from_ckpt, ids))
    experts = at_load.runner.model.layers[0].mlp
    assert experts.w13.dtype == torch.float8_e4m3fn and experts.w13_scale_inv.dtype == torch.float32


def test_dummy_load_format_with_quantization_draws_fp8_weights(tmp_path):
    plain = make_tiny("mixtral", tmp_path / "m", seed=1)
    engine = engine_for(plain, quantization="fp8", load_format="dummy")
    moe = engine.runner.model.layers[0].mlp
    assert moe.w13.dtype == torch.float8_e4m3fn and moe.w13_scale_inv.abs().sum() > 0
    out = engine.generate([prompt_ids(5, 0)], SamplingParams(max_tokens=4, **GREEDY))[0]
    assert len(out.token_ids) == 4


@pytest.mark.parametrize("family,kind", [("qwen3_moe", "attn+experts"), ("qwen2_moe", "shared-expert"),
                                         ("mixtral", "all-linear+router")])
def test_lora_on_fp8_base_matches_peft_on_the_dequantized_base(tmp_path, family, kind):
    base = save_base_checkpoint(family, tmp_path / "base")
    fp8 = fp8_copy(base, tmp_path / "fp8")
    path, _ = make_peft_adapter(family, tmp_path / "ad", kind=kind, rank=4, seed=1)
    from peft import PeftModel

    pm = PeftModel.from_pretrained(hf_model(dequantized_copy(fp8, tmp_path / "deq")), str(path)).eval()
    engine = engine_for(fp8, lora_modules={"ad": str(path)}, max_lora_rank=8)
    prompt = prompt_ids(13, seed=2)
    with torch.no_grad():
        theirs = pm(input_ids=torch.tensor([prompt])).logits[0].float()
    assert (prompt_logits(engine, prompt, "ad") - theirs).abs().max().item() <= TOL
    # a mixed batch: the row without an adapter is bitwise the LoRA-disabled FP8 engine's
    plain = engine_for(fp8)
    params = SamplingParams(max_tokens=8, logprobs=2, **GREEDY)
    mixed = engine.generate([prompt, prompt], params, lora=["ad", None])
    alone = plain.generate([prompt], params)[0]
    assert mixed[1].token_ids == alone.token_ids
    assert [lp.logprob for lp in mixed[1].logprobs] == [lp.logprob for lp in alone.logprobs]


# qwen3_moe with every tensor-parallel split on a 128 boundary: q 4 x 128, kv 2 x 128, experts and dense MLP 256
TP_DIMS = dict(hidden_size=128, head_dim=128, moe_intermediate_size=256, intermediate_size=256)


def test_tp2_shards_the_scales_with_the_weights(tmp_path):
    """Two ranks (gloo) each reading their slices of the fp8 weights and of their scale blocks give the single
    rank's tokens and logprobs; so do two ranks quantizing their slices of the plain checkpoint at load, two ranks
    reading the fused expert layout (gate's and up's scale rows apart), and two expert-parallel ranks (whole
    experts each, with their scales)."""
    from test_tensor_parallel import GREEDY as TP_GREEDY, assert_same, config

    plain = make_tiny("qwen3_moe", tmp_path / "plain", seed=2, **TP_DIMS)
    fp8 = make_tiny("qwen3_moe", tmp_path / "fp8", quantization="fp8", seed=2, **TP_DIMS)
    fused = make_tiny("qwen3_moe", tmp_path / "fused", quantization="fp8", seed=2, expert_layout="fused", **TP_DIMS)
    prompts = [prompt_ids(11, seed=4), prompt_ids(5, seed=5)]
    params = SamplingParams(max_tokens=6, **TP_GREEDY)
    one = Engine(config(fp8)).generate(prompts, params)
    for model, kw in ((fp8, {}), (plain, dict(quantization="fp8")), (fused, {}), (fused, dict(enable_expert_parallel=True)),
                      (fp8, dict(enable_expert_parallel=True))):
        two_engine = Engine(config(model, tensor_parallel_size=2, **kw))
        try:
            assert two_engine.runner.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
            two = two_engine.generate(prompts, params)
        finally:
            two_engine.runner.shutdown()
        assert_same(two, one)


def test_tp2_split_off_a_128_boundary_is_refused_naming_the_weight(tmp_path):
    fp8 = make_tiny("qwen3_moe", tmp_path / "fp8", quantization="fp8", seed=2)  # q 64 rows: 32 per rank
    with pytest.raises(ValueError, match=r"FP8 weight 'model\.layers\.0\.self_attn\.q_proj\.weight': "
                                         r"tensor_parallel_size 2 splits its dim 0 .* not on a multiple of the 128"):
        Engine(EngineConfig(model=str(fp8), device="cpu", dtype="float32", tensor_parallel_size=2, num_kv_blocks=32,
                            dist_timeout=60))


# a held text of about 600 tokens: perplexity over a short text moves by percents when one token's probability does
HELD_TEXT = """\
Rivers have shaped the places where people live for as long as there have been settlements. A river brings fresh
water for drinking and for fields, it carries boats and the goods they hold, and its floods leave behind the rich
soil that farmers depend on. Many of the oldest cities in the world grew up on the banks of great rivers, and their
names are still tied to the water that made them possible.

A river begins as rain or melting snow high in the hills. Small streams gather in valleys and join one another,
growing wider and slower as the land flattens out. Along the way the water wears away rock and carries sand, clay
and stones downstream. Where the river finally meets the sea, it drops what it carried and builds a delta, a wide
fan of land crossed by many channels. Deltas are some of the most fertile places on earth, and some of the most
crowded.

People have always tried to control rivers. They built walls of earth to keep floods away from their homes, dug
canals to carry water to dry land, and raised dams to store water for the summer and to turn wheels that ground
grain. In the last century, large dams began to produce electricity for whole regions. These works brought great
benefits, but they also changed the rivers themselves. A dam holds back the sand that would have fed the delta, and
the fish that once swam upstream to lay their eggs may no longer reach the places where they were born.

Today many cities are learning to live with their rivers again. Instead of hiding the water behind concrete, they
open the banks to parks and paths, give floods room to spread across meadows, and clean the water so that fish and
birds return. Children who grow up beside a living river learn that it is more than a line on a map. It is a
neighbour that changes with the seasons, rising in spring and shrinking in late summer, and it asks to be treated
with patience and respect.

Scientists who study rivers measure how fast the water flows, how much sediment it carries and how the shape of the
channel changes from year to year. Their work helps engineers plan bridges that will stand for a century, and it
helps farmers know when to plant. It also reminds everyone that a river is a system: what happens upstream, in a
forest or a town, is felt by everyone who lives further down.
"""


@pytest.mark.slow
def test_demo_model_perplexity_in_fp8_within_one_percent_of_bf16(demo_engine, demo_engine_config):
    """The demo model (SmolLM2 upcycled) quantized at load (--quantization fp8): the perplexity of a held text
    within 1 % of the unquantized engine's (its bf16 checkpoint served in float32 on the CPU; measured: 19.18 ->
    19.33, +0.8 %, over its 504 tokens), weight-only (the CPU's auto). With every activation quantized too
    (--fp8-activations dynamic: the W8A8 the GPU runs for prompts, through the kernels' twins) the bound is 2 %:
    measured +0.9 % (19.35) with the twin's per-expert matmuls, +1.5 % (19.46) with its earlier per-pair matvecs —
    fp32 summation order alone moves activations across e4m3 rounding boundaries, and over 504 tokens that moves
    the perplexity by half a percent (benchmarks/session13/fp8_ppl_split.py). About 100 s on 2 CPU cores with the
    demo model built: marked slow."""
    def engine(**kw):  # the shared demo_engine's settings, quantized
        return Engine(demo_engine_config(**kw))

    plain = demo_engine
    ids = plain.tokenizer.encode(HELD_TEXT)
    assert len(ids) > 400

    def perplexity(e):
        logits = prompt_logits(e, ids)[:-1]
        return torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:])).exp().item()

    base = perplexity(plain)
    fp8 = perplexity(engine(quantization="fp8"))
    assert abs(fp8 - base) / base <= 0.01, (fp8, base)
    w8a8 = perplexity(engine(quantization="fp8", fp8_activations="dynamic"))
    assert w8a8 != fp8 and abs(w8a8 - base) / base <= 0.02, (w8a8, base)


def test_fp8_triton_kernels_in_the_engine_match_the_dequantized_torch_path(tmp_path, monkeypatch):
    """The FP8 engine on the Triton backends (kernels/fp8_linear, kernels/fused_moe_fp8 with its LoRA, run by
    Triton's interpreter in fp32), products weight-only (fp8_activations none), against the torch backends on the
    dequantized weights: same tokens, logprobs to fp32 rounding, in one batch with no adapter, a fused gate_up
    expert adapter and one with separate gate_proj / up_proj LoRAs (the up A's); the row without an adapter bitwise
    the LoRA-disabled Triton FP8 engine's. (The default, W8A8 where a call is a GEMM, is bitwise the W8A8 kernels
    on those calls: test_kernels_moe_fp8 / test_kernels_fp8_linear; the GPU engine tests run it.)"""
    family = "qwen3_moe"
    base = save_base_checkpoint(family, tmp_path / "base", **INTERPRETED_LAYERS)
    fp8 = fp8_copy(base, tmp_path / "fp8")
    a, _ = make_peft_adapter(family, tmp_path / "a", rank=4, seed=1, config_overrides=INTERPRETED_LAYERS)
    b, _ = make_peft_adapter(family, tmp_path / "b", rank=4, seed=2, expert_format="per-expert", separate_gate_up=True,
                             config_overrides=INTERPRETED_LAYERS)
    kw = dict(model=str(fp8), device="cpu", dtype="float32", max_lora_rank=4, block_size=16)
    lora = dict(lora_modules={"A": str(a), "B": str(b)}, max_loras=2)
    triton = dict(moe_backend="triton", attention_backend="triton")
    tri = Engine(EngineConfig(**triton, **lora, **kw, fp8_activations="none"))
    ref = Engine(EngineConfig(moe_backend="torch", attention_backend="torch", **lora, **kw))
    plain = Engine(EngineConfig(**triton, **kw, fp8_activations="none"))
    prompts = [torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 19, 7)]
    sp = SamplingParams(max_tokens=2, logprobs=0, **GREEDY)
    loras = [None, "A", "B"]
    got = tri.generate(prompts, sp, lora=loras)
    for g, w in zip(got, ref.generate(prompts, sp, lora=loras)):
        assert g.token_ids == w.token_ids
        assert max(abs(x.logprob - y.logprob) for x, y in zip(g.logprobs, w.logprobs)) < 1e-4
    alone = plain.generate(prompts, sp)[0]  # the same batch shape: the kernels' path depends on the token count
    assert got[0].token_ids == alone.token_ids
    assert [x.logprob for x in got[0].logprobs] == [x.logprob for x in alone.logprobs]
    # decode at 1 and 2 rows: the dense LoRA's expand inside the FP8 product's epilogue (fp8_linear.fuses_lora)
    from moeserve.kernels import fp8_linear as fp8_linear_module
    fused, product = [], fp8_linear_module.fp8_linear

    def recording(*a, lora=None, **k):
        fused.append(lora is not None)
        return product(*a, lora=lora, **k)
    monkeypatch.setattr(fp8_linear_module, "fp8_linear", recording)
    for batch, names in (([prompts[0]], ["A"]), (prompts[1:], ["B", None])):
        for g, w in zip(tri.generate(batch, sp, lora=names), ref.generate(batch, sp, lora=names)):
            assert g.token_ids == w.token_ids
            assert max(abs(x.logprob - y.logprob) for x, y in zip(g.logprobs, w.logprobs)) < 1e-4
    assert any(fused)


def test_w8a8_consumers_read_the_fp8_copy_their_norms_write(tmp_path, monkeypatch):
    """Where the routed experts multiply W8A8 (the default, on their sorted path) and where q|k|v does (64 rows and
    more), the norm before each writes the fp8 copy of its output they read: a quantization launch fewer each, and
    tokens and logprobs bit for bit those of the engine whose consumers quantize x themselves."""
    from moeserve.kernels import fp8_linear, fused_moe_fp8
    from moeserve.layers.linear import LoRALinear
    from moeserve.layers.moe import MoEBlock

    base = save_base_checkpoint("qwen3_moe", tmp_path / "base", **INTERPRETED_LAYERS)
    fp8 = fp8_copy(base, tmp_path / "fp8")
    kw = dict(model=str(fp8), device="cpu", dtype="float32", block_size=16, moe_backend="triton",
              attention_backend="triton")
    prompts = [torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (70, 17)]
    sp = SamplingParams(max_tokens=2, logprobs=0, **GREEDY)
    quantized = {"experts": 0, "linear": 0}
    for name, module in (("experts", fused_moe_fp8), ("linear", fp8_linear)):
        def counting(*a, _name=name, _quantize=module.quantize_groups_fp8, **k):
            quantized[_name] += 1
            return _quantize(*a, **k)
        monkeypatch.setattr(module, "quantize_groups_fp8", counting)
    from_norm = Engine(EngineConfig(**kw)).generate(prompts, sp)
    by_norm = dict(quantized)
    quantized.update(experts=0, linear=0)
    monkeypatch.setattr(MoEBlock, "input_quant", lambda self, x: None)
    monkeypatch.setattr(LoRALinear, "input_quant", lambda self, x: None)
    apart = Engine(EngineConfig(**kw)).generate(prompts, sp)
    # the consumers quantized x themselves where the norms did not (o_proj's input still is, by its own launch)
    assert quantized["experts"] > by_norm["experts"] and quantized["linear"] > by_norm["linear"]
    for a, b in zip(from_norm, apart):
        assert a.token_ids == b.token_ids
        assert [x.logprob for x in a.logprobs] == [x.logprob for x in b.logprobs]
