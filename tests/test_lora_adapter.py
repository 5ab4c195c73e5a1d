"""PEFT adapter parsing: the ΔW we reconstruct equals the ΔW PEFT applies, in every on-disk form;
unservable adapters are refused with a message that names the problem."""
import hashlib
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from moeserve.lora.adapter import ExpertLoRA, LoRAAdapterError, load_lora_adapter
from moeserve.models.tiny import TINY_FAMILIES
from peft_fixtures import (
    ATTN_TARGETS, MALFORMED_MAX_RANK, make_malformed_adapters, make_peft_adapter, reference_deltas,
    tiny_base_model, tiny_spec,
)

REL_TOL = 1e-5


def parsed_deltas(adapter) -> dict[str, torch.Tensor]:
    """Our ΔW (scaling already in B), by transformers parameter name."""
    out = {}
    for (layer, target), (a, b) in adapter.dense.items():
        module = (f"self_attn.{target}" if target in ATTN_TARGETS else "mlp.gate" if target == "router"
                  else f"mlp.{target}")
        out[f"model.layers.{layer}.{module}.weight"] = b @ a
    for layer, ex in adapter.experts.items():
        if ex.gate_up_a is not None:
            out[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = gate_up_delta(ex)
        if ex.down_a is not None:
            out[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.bmm(ex.down_b, ex.down_a)
    return out


def gate_up_delta(ex) -> torch.Tensor:
    """[E, 2I, H]: gate rows from gate_up_a, up rows from up_a (or gate_up_a where gate and up share it)."""
    inter = ex.gate_up_b.shape[1] // 2
    up_a = ex.gate_up_a if ex.up_a is None else ex.up_a
    return torch.cat([torch.bmm(ex.gate_up_b[:, :inter], ex.gate_up_a),
                      torch.bmm(ex.gate_up_b[:, inter:], up_a)], dim=1)


def assert_deltas_match(ours: dict, ref: dict) -> None:
    assert sorted(ours) == sorted(ref)
    for name, d in ref.items():
        assert ours[name].shape == d.shape, name
        rel = ((ours[name] - d).norm() / d.norm()).item()
        assert rel < REL_TOL, f"{name}: relative error {rel:.2e}"


def load(family, path, max_rank=64, **overrides):
    return load_lora_adapter("test-adapter", path, tiny_spec(family, **overrides), max_rank)


@pytest.mark.parametrize("family", TINY_FAMILIES)
@pytest.mark.parametrize("expert_format,shared_outer", [
    ("target_parameters", False), ("target_parameters", True), ("per-expert", False),
    ("stacked", False), ("stacked", True),
])
def test_attention_and_expert_deltas_match_peft(family, expert_format, shared_outer, tmp_path):
    path, pm = make_peft_adapter(family, tmp_path, expert_format=expert_format, shared_outer=shared_outer, seed=3)
    adapter = load(family, path)
    assert_deltas_match(parsed_deltas(adapter), reference_deltas(pm, tiny_base_model(family)))
    assert adapter.target_modules == frozenset(ATTN_TARGETS + ["experts"])


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_expert_layout_matches_peft_forward(family, tmp_path):
    """PEFT's ParamWrapper forward (its own factor path, not its merge) equals the base model with our ΔW added."""
    path, pm = make_peft_adapter(family, tmp_path, seed=1)
    patched = tiny_base_model(family)
    with torch.no_grad():
        params = dict(patched.named_parameters())
        for name, d in parsed_deltas(load(family, path)).items():
            params[name] += d
    ids = torch.randint(0, patched.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = pm(ids).logits
        got = patched(ids).logits
        base = tiny_base_model(family)(ids).logits
    assert (want - base).abs().max() > 1e-2  # the adapter matters, so a wrong ΔW would show
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("expert_format", ["target_parameters", "per-expert"])
@pytest.mark.parametrize("rslora", [False, True])
def test_rank_pattern_alpha_pattern_and_rslora_match_peft(family, expert_format, rslora, tmp_path):
    rank_pattern = {"q_proj": 2, r"model\.layers\.2\..*v_proj": 6, "layers.0.mlp.experts.down_proj": 3}
    alpha_pattern = {"k_proj": 3, "mlp.experts.gate_up_proj": 20}
    path, pm = make_peft_adapter(family, tmp_path, expert_format=expert_format, seed=5, use_rslora=rslora,
                                 rank_pattern=rank_pattern, alpha_pattern=alpha_pattern)
    adapter = load(family, path)
    assert_deltas_match(parsed_deltas(adapter), reference_deltas(pm, tiny_base_model(family)))
    # the patterns took effect (ranks as configured), so the check above covered them
    assert adapter.dense[(0, "q_proj")][0].shape[0] == 2
    assert adapter.dense[(2, "v_proj")][0].shape[0] == 6
    assert adapter.dense[(0, "v_proj")][0].shape[0] == 4
    assert adapter.experts[0].down_a.shape[1] == 3  # down is not stacked, in either form
    assert adapter.experts[2].down_a.shape[1] == 4


def test_regex_pattern_keys_match_peft(tmp_path):
    """rank_pattern / alpha_pattern keys with alternation, classes, anchors and counted repeats resolve as PEFT
    resolves them (our matcher is not Python's re, so check it against PEFT itself); first key in order wins."""
    rank_pattern = {r"^model\.layers\.[02]\.self_attn\.(q|k)_proj$": 6, r"layers\.\d{1,2}\.self_attn\.v_proj": 2,
                    "q_proj": 3}
    alpha_pattern = {r"(q|o)_proj": 24, r"self_attn\.[^q]_proj": 3, r"experts\.gate_up_proj": 5}
    path, pm = make_peft_adapter("qwen3_moe", tmp_path, seed=13, rank_pattern=rank_pattern, alpha_pattern=alpha_pattern)
    adapter = load("qwen3_moe", path)
    assert_deltas_match(parsed_deltas(adapter), reference_deltas(pm, tiny_base_model("qwen3_moe")))
    ranks = {k: a.shape[0] for k, (a, _) in adapter.dense.items()}
    assert ranks[(0, "q_proj")] == ranks[(2, "k_proj")] == 6 and ranks[(1, "q_proj")] == 3
    assert ranks[(1, "v_proj")] == 2 and ranks[(1, "k_proj")] == 4


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_per_expert_and_target_parameters_forms_give_the_same_deltas(family, tmp_path):
    fused = load(family, make_peft_adapter(family, tmp_path / "fused", seed=7)[0])
    per_expert = load(family, make_peft_adapter(family, tmp_path / "split", seed=7, expert_format="per-expert")[0])
    assert (fused.rank, per_expert.rank) == (4, 4)  # separate gate and up LoRAs of rank 4 cost rank 4
    ours, theirs = parsed_deltas(per_expert), parsed_deltas(fused)
    assert_deltas_match(ours, theirs)


def test_shared_outer_factors_are_broadcast_to_all_experts(tmp_path):
    family, spec = "qwen3_moe", tiny_spec("qwen3_moe")
    E, H, I = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size
    path, _ = make_peft_adapter(family, tmp_path, shared_outer=True, seed=2)
    stored = load_file(str(path / "adapter_model.safetensors"))
    shapes = {tuple(t.shape) for k, t in stored.items() if "layers.0.mlp.experts" in k}
    assert shapes == {(4, H), (2 * I, 4 * E), (4 * E, I), (H, 4)}  # gate_up A and down B stored once
    ex = load(family, path).experts[0]
    for shared in (ex.gate_up_a, ex.down_b):
        assert shared.is_contiguous() and shared.stride(0) != 0
        assert all(torch.equal(shared[e], shared[0]) for e in range(E))
    for per_expert in (ex.gate_up_b, ex.down_a):
        assert not torch.equal(per_expert[1], per_expert[0])


@pytest.mark.parametrize("family", ["olmoe", "mixtral"])
def test_per_expert_adapter_missing_experts_are_zero(family, tmp_path):
    path, pm = make_peft_adapter(family, tmp_path, expert_format="per-expert", drop_experts=(1, 3), seed=4)
    stored = load_file(str(path / "adapter_model.safetensors"))
    assert not any(".experts.1." in k or ".experts.3." in k for k in stored)
    adapter = load(family, path)
    assert_deltas_match(parsed_deltas(adapter), reference_deltas(pm, tiny_base_model(family)))
    for ex in adapter.experts.values():
        for t in (ex.gate_up_a, ex.gate_up_b, ex.down_a, ex.down_b):
            assert not t[1].any() and not t[3].any() and t[0].any()


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_per_expert_gate_and_up_of_rank_r_load_with_max_lora_rank_r(family, tmp_path):
    """Separate gate_proj / up_proj LoRAs of rank r, each with its own A, sit side by side (not stacked into rank
    2r): the adapter fits --max-lora-rank r and its ΔW is PEFT's."""
    path, pm = make_peft_adapter(family, tmp_path, kind="experts", expert_format="per-expert", rank=4, seed=15,
                                 separate_gate_up=True)
    stored = load_file(str(path / "adapter_model.safetensors"))
    gate = next(k for k in stored if ".experts.0.gate_proj.lora_A" in k or ".experts.0.w1.lora_A" in k)
    up = gate.replace("gate_proj", "up_proj").replace(".w1.", ".w3.")
    assert stored[gate].shape == stored[up].shape == (4, tiny_spec(family).hidden_size)
    assert not torch.equal(stored[gate], stored[up])
    adapter = load(family, path, max_rank=4)
    assert adapter.rank == 4 and all(ex.up_a is not None for ex in adapter.experts.values())
    assert_deltas_match(parsed_deltas(adapter), reference_deltas(pm, tiny_base_model(family)))
    with pytest.raises(LoRAAdapterError, match=r"LoRA rank 4 exceeds the engine's max_lora_rank 3 \(--max-lora-rank\)"):
        load(family, path, max_rank=3)


def test_per_expert_gate_and_up_of_different_ranks_sit_side_by_side(tmp_path):
    """Hand-written per-expert adapter: gate rank 2, up rank 3 (rank_pattern), own alphas, one expert missing,
    and a layer with only down_proj. Reference: the per-expert ΔW of each projection, computed directly."""
    spec = tiny_spec("qwen3_moe")
    E, H, I = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size
    g = torch.Generator().manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    tensors, want_gate_up, want_down = {}, torch.zeros(E, 2 * I, H), torch.zeros(E, H, I)
    for e in range(E):
        if e == 2:
            continue
        for proj, r, scale, rows in (("gate_proj", 2, 4 / 2, slice(0, I)), ("up_proj", 3, 9 / 3, slice(I, 2 * I))):
            a, b = rnd(r, H), rnd(I, r)
            tensors[f"base_model.model.model.layers.0.mlp.experts.{e}.{proj}.lora_A.weight"] = a
            tensors[f"base_model.model.model.layers.0.mlp.experts.{e}.{proj}.lora_B.weight"] = b
            want_gate_up[e, rows] = scale * b @ a
        a, b = rnd(2, I), rnd(H, 2)
        tensors[f"base_model.model.model.layers.2.mlp.experts.{e}.down_proj.lora_A.weight"] = a
        tensors[f"base_model.model.model.layers.2.mlp.experts.{e}.down_proj.lora_B.weight"] = b
        want_down[e] = (4 / 2) * b @ a
    save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": 2, "lora_alpha": 4, "rank_pattern": {"up_proj": 3}, "alpha_pattern": {"up_proj": 9},
        "target_modules": ["gate_proj", "up_proj", "down_proj"], "bias": "none"}))
    adapter = load_lora_adapter("stack", tmp_path, spec, max_rank=3)
    assert adapter.rank == 3 and set(adapter.experts) == {0, 2} and not adapter.dense
    l0, l2 = adapter.experts[0], adapter.experts[2]
    assert l0.gate_up_a.shape == l0.up_a.shape == (E, 3, H) and l0.gate_up_b.shape == (E, 2 * I, 3)
    assert l0.down_a is None
    assert l2.gate_up_a is None and l2.down_a.shape == (E, 2, I) and l2.down_b.shape == (E, H, 2)
    torch.testing.assert_close(gate_up_delta(l0), want_gate_up, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.bmm(l2.down_b, l2.down_a), want_down, rtol=1e-5, atol=1e-5)
    with pytest.raises(LoRAAdapterError, match=r"LoRA rank 3 exceeds the engine's max_lora_rank 2 \(--max-lora-rank\)"):
        load_lora_adapter("stack", tmp_path, spec, max_rank=2)


@pytest.mark.parametrize("proj", ["gate_proj", "up_proj"])
def test_per_expert_gate_or_up_alone_is_one_shared_a(proj, tmp_path):
    """Only one of gate_proj / up_proj: its A serves both halves (the other half's B is zero), so the slot
    shrinks once; the ΔW is that projection's alone."""
    spec = tiny_spec("qwen3_moe")
    E, H, I = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size
    g = torch.Generator().manual_seed(1)
    tensors, want = {}, torch.zeros(E, 2 * I, H)
    rows = slice(0, I) if proj == "gate_proj" else slice(I, 2 * I)
    for e in range(E):
        a, b = torch.randn(3, H, generator=g), torch.randn(I, 3, generator=g)
        tensors[f"base_model.model.model.layers.0.mlp.experts.{e}.{proj}.lora_A.weight"] = a
        tensors[f"base_model.model.model.layers.0.mlp.experts.{e}.{proj}.lora_B.weight"] = b
        want[e, rows] = (6 / 3) * b @ a
    save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": 3, "lora_alpha": 6, "target_modules": [proj], "bias": "none"}))
    ex = load_lora_adapter("one", tmp_path, spec, max_rank=3).experts[0]
    assert ex.up_a is None and ex.gate_up_a.shape == (E, 3, H)
    torch.testing.assert_close(gate_up_delta(ex), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family,kind,targets", [
    ("qwen3_moe", "dense-mlp", {"gate_proj", "up_proj", "down_proj"}),
    ("qwen2_moe", "dense-mlp", {"gate_proj", "up_proj", "down_proj"}),
    ("qwen2_moe", "shared-expert", {"shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj"}),
])
def test_dense_mlp_and_shared_expert_deltas_match_peft(family, kind, targets, tmp_path):
    path, pm = make_peft_adapter(family, tmp_path, kind=kind, seed=6, rank=3, alpha=5)
    adapter = load(family, path)
    assert adapter.target_modules == frozenset(targets) and not adapter.experts
    spec = tiny_spec(family)
    layers = {layer for layer, _ in adapter.dense}
    want_layers = {i for i, s in enumerate(spec.sparse_layers) if (s if kind == "shared-expert" else not s)}
    assert layers == want_layers
    assert_deltas_match(parsed_deltas(adapter), reference_deltas(pm, tiny_base_model(family)))


@pytest.mark.parametrize("family,overrides", [
    ("olmoe", {"intermediate_size": 32}),  # 2I == H: gate_up's B and down's B have the same out-dim
    ("qwen3_moe", {"moe_intermediate_size": 64}),  # I == H: both A's have the same in-dim
])
def test_expert_pairs_map_by_shape_when_dims_coincide(family, overrides, tmp_path):
    path, pm = make_peft_adapter(family, tmp_path, kind="experts", seed=8, config_overrides=overrides)
    adapter = load(family, path, **overrides)
    assert_deltas_match(parsed_deltas(adapter), reference_deltas(pm, tiny_base_model(family, **overrides)))


@pytest.mark.parametrize("param,present", [("mlp.experts.down_proj", "down"), ("mlp.experts.gate_up_proj", "gate_up")])
def test_one_targeted_expert_parameter_leaves_the_other_none(param, present, tmp_path):
    path, pm = make_peft_adapter("mixtral", tmp_path, kind="experts", target_parameters=[param], seed=12)
    adapter = load("mixtral", path)
    for ex in adapter.experts.values():
        assert (ex.down_a is not None, ex.gate_up_a is not None) == (present == "down", present == "gate_up")
    assert_deltas_match(parsed_deltas(adapter), reference_deltas(pm, tiny_base_model("mixtral")))


@pytest.mark.parametrize("family,kind", [
    ("qwen3_moe", "all-linear"), ("mixtral", "all-linear"), ("olmoe", "all-linear"),
    ("qwen2_moe", "all-linear+router"),  # PEFT's all-linear skips qwen2's router but adapts its shared-expert gate
])
def test_all_linear_router_and_shared_expert_gate_deltas_match_peft(family, kind, tmp_path):
    """PEFT's `all-linear` puts a LoRA on the router (`mlp.gate.weight`, a target parameter on transformers 5);
    rank_pattern / alpha_pattern keys for it name that parameter."""
    spec = tiny_spec(family)
    sparse = [i for i, s in enumerate(spec.sparse_layers) if s]
    path, pm = make_peft_adapter(family, tmp_path, kind=kind, seed=13, rank=4,
                                 rank_pattern={f"layers.{sparse[0]}.mlp.gate.weight": 2},
                                 alpha_pattern={"mlp.gate.weight": 3.0})
    adapter = load(family, path)
    router = {layer: a.shape[0] for (layer, t), (a, _) in adapter.dense.items() if t == "router"}
    assert router == {i: 2 if i == sparse[0] else 4 for i in sparse}
    assert "router" in adapter.target_modules
    assert ("shared_expert_gate" in adapter.target_modules) == (family == "qwen2_moe")
    assert_deltas_match(parsed_deltas(adapter), reference_deltas(pm, tiny_base_model(family)))


def test_router_lora_as_a_module_uses_the_module_key_for_patterns(tmp_path):
    """transformers 4 routers are nn.Linear: PEFT adapts `block_sparse_moe.gate` as a module, and its patterns
    match the module name (no `.weight`)."""
    spec = tiny_spec("mixtral")
    path, pm = make_peft_adapter("mixtral", tmp_path, kind="router", seed=14, rank=4, alpha=8)
    t = load_file(str(path / "adapter_model.safetensors"))
    save_file({k.replace("mlp.gate.", "block_sparse_moe.gate."): v for k, v in t.items()},
              str(path / "adapter_model.safetensors"))
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg.update(target_modules=["gate"], target_parameters=None, alpha_pattern={"block_sparse_moe.gate": 2.0})
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    adapter = load("mixtral", path)
    ref = reference_deltas(pm, tiny_base_model("mixtral"))
    for layer in range(spec.num_layers):  # alpha 2 instead of 8: a quarter of PEFT's ΔW (alpha 8)
        a, b = adapter.dense[(layer, "router")]
        assert torch.allclose(b @ a, ref[f"model.layers.{layer}.mlp.gate.weight"] / 4, rtol=1e-5, atol=1e-7)


def test_router_lora_on_a_dense_layer_is_refused(tmp_path):
    assert tuple(tiny_spec("qwen3_moe").sparse_layers[:2]) == (True, False)
    path, _ = make_peft_adapter("qwen3_moe", tmp_path, kind="router")
    t = load_file(str(path / "adapter_model.safetensors"))
    t = {k: v for k, v in t.items() if "layers.0." in k}
    t.update({k.replace("layers.0.", "layers.1."): v.clone() for k, v in t.items()})
    save_file(t, str(path / "adapter_model.safetensors"))
    with pytest.raises(LoRAAdapterError, match="layer 1 is a dense MLP layer in the base model; it has no router"):
        load("qwen3_moe", path)


def test_mixtral_per_expert_spellings_agree(tmp_path):
    a = load("mixtral", make_peft_adapter("mixtral", tmp_path / "a", expert_format="per-expert")[0])
    b = load("mixtral", make_peft_adapter("mixtral", tmp_path / "b", expert_format="per-expert",
                                          mixtral_prefix="mlp")[0])
    for layer in a.experts:
        for field in ("gate_up_a", "gate_up_b", "down_a", "down_b"):
            assert torch.equal(getattr(a.experts[layer], field), getattr(b.experts[layer], field))


def test_output_layout_dtype_and_rank_limit(tmp_path):
    """bf16 on disk -> fp32, CPU, contiguous; shapes as the contract says; loading changes no file or global."""
    family, spec = "qwen2_moe", tiny_spec("qwen2_moe")
    E, H, I = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size
    path, _ = make_peft_adapter(family, tmp_path, rank=4, seed=9)
    weights = path / "adapter_model.safetensors"
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(str(weights)).items()}, str(weights))
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    dtype_before = torch.get_default_dtype()

    adapter = load_lora_adapter("bf16", path, spec, max_rank=4)
    assert (adapter.name, adapter.path, adapter.rank) == ("bf16", str(path), 4)
    tensors = [t for pair in adapter.dense.values() for t in pair]
    for ex in adapter.experts.values():
        assert isinstance(ex, ExpertLoRA)
        assert ex.gate_up_a.shape == (E, 4, H) and ex.gate_up_b.shape == (E, 2 * I, 4)
        assert ex.down_a.shape == (E, 4, I) and ex.down_b.shape == (E, H, 4)
        tensors += [ex.gate_up_a, ex.gate_up_b, ex.down_a, ex.down_b]
    assert all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() for t in tensors)
    assert set(adapter.experts) == {i for i, s in enumerate(spec.sparse_layers) if s}

    again = load_lora_adapter("bf16", path, spec, max_rank=4)
    assert all(torch.equal(again.dense[k][1], v[1]) for k, v in adapter.dense.items())
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == digest
    assert torch.get_default_dtype() == dtype_before
    with pytest.raises(LoRAAdapterError, match="LoRA rank 4 exceeds the engine's max_lora_rank 3"):
        load_lora_adapter("bf16", path, spec, max_rank=3)


@pytest.fixture(scope="module")
def malformed(tmp_path_factory):
    root = tmp_path_factory.mktemp("malformed")
    base, _ = make_peft_adapter("qwen3_moe", root / "base", rank=4)
    return base, make_malformed_adapters(base, root / "cases")


def test_malformed_corpus_base_is_valid(malformed):
    base, cases = malformed
    assert len(cases) >= 12
    assert load_lora_adapter("base", base, tiny_spec("qwen3_moe"), MALFORMED_MAX_RANK).rank == 4


def test_every_malformed_adapter_is_refused_by_name(malformed):
    _, cases = malformed
    spec = tiny_spec("qwen3_moe")
    wrong = []
    for case, (path, expected) in sorted(cases.items()):
        try:
            load_lora_adapter(f"bad-{case}", path, spec, MALFORMED_MAX_RANK)
        except LoRAAdapterError as e:
            if expected not in str(e) or f"bad-{case}" not in str(e):
                wrong.append(f"{case}: message {str(e)!r} lacks {expected!r}")
        else:
            wrong.append(f"{case}: loaded without error")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe"])
def test_per_expert_adapter_matches_peft_own_transformers4_conversion(family, tmp_path):
    """On transformers 5, PEFT converts a transformers-4 per-expert adapter into fused expert LoRA itself when
    loading it: an oracle that shares no code with the fixture's writer or with our parser."""
    pytest.importorskip("peft.utils.transformers_weight_conversion")
    import peft

    path, _ = make_peft_adapter(family, tmp_path, expert_format="per-expert", seed=11)
    loaded = peft.PeftModel.from_pretrained(tiny_base_model(family), str(path))
    assert_deltas_match(parsed_deltas(load(family, path)), reference_deltas(loaded, tiny_base_model(family)))
