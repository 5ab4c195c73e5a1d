"""The module tree described once (module_tree.py) against the names transformers writes, and the users that read
it: the loader (every tensor of every family's checkpoint read, none left over), the slot pool (each LoRA target
lands in the module and slice that computes it), the sharding rules and the adapter parser's target list."""
import pytest
import torch
from safetensors import safe_open

from moeserve import module_tree
from moeserve.distributed.sharding import COLUMN, ROW
from moeserve.lora.adapter import SUPPORTED_DENSE_TARGETS
from moeserve.lora.slot_pool import ALL_TARGETS, LoRASlotPool
from moeserve.model_spec import ModelSpec
from moeserve.models import loader
from peft_fixtures import save_base_checkpoint, tiny_base_model, tiny_spec

FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")


def _saved_names(folder) -> set[str]:
    names = set()
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as st:
            names |= set(st.keys())
    return names


@pytest.mark.parametrize("family,overrides", [(f, {}) for f in FAMILIES] + [
    ("qwen3_moe", {"tie_word_embeddings": True, "mlp_only_layers": [1]}),
    ("olmoe", {"attention_bias": True})])
def test_checkpoint_names_are_the_ones_transformers_writes(tmp_path, family, overrides):
    """The tree's tensor names for a family are exactly transformers' own: the per-expert layout it saves
    (Mixtral: block_sparse_moe, w1/w3/w2), and the fused layout of its in-memory model; the loader reads every
    saved tensor once."""
    folder = save_base_checkpoint(family, tmp_path / family, **overrides)
    spec = ModelSpec.from_model_dir(folder)
    saved = _saved_names(folder)
    mixtral = family == "mixtral"
    assert module_tree.checkpoint_tensor_names(spec, "per_expert", "block_sparse_moe" if mixtral else "mlp",
                                               mixtral_names=mixtral) == saved
    in_memory = set(tiny_base_model(family, **overrides).state_dict())
    if spec.tie_word_embeddings:
        assert "lm_head.weight" not in saved
        in_memory.discard("lm_head.weight")  # the embedding's own tensor, under a second name
    assert module_tree.checkpoint_tensor_names(spec, "fused") == in_memory
    if overrides.get("mlp_only_layers"):
        assert "model.layers.1.mlp.gate_proj.weight" in saved
    seen = []
    real_get = loader._Tensors.get

    def spy(self, name, shape):
        seen.append(name)
        return real_get(self, name, shape)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loader._Tensors, "get", spy)
        loader.load_model(folder, spec)
    assert sorted(seen) == sorted(saved)  # each read once


def test_per_expert_names_are_the_transformers_4_names():
    assert module_tree.per_expert_names(2, 5) == ("model.layers.2.mlp.experts.5.gate_proj.weight",
                                                  "model.layers.2.mlp.experts.5.up_proj.weight",
                                                  "model.layers.2.mlp.experts.5.down_proj.weight")
    assert module_tree.per_expert_names(0, 7, "block_sparse_moe", mixtral=True) == (
        "model.layers.0.block_sparse_moe.experts.7.w1.weight", "model.layers.0.block_sparse_moe.experts.7.w3.weight",
        "model.layers.0.block_sparse_moe.experts.7.w2.weight")
    spec = tiny_spec("mixtral")
    names = module_tree.checkpoint_tensor_names(spec, "per_expert", "block_sparse_moe", mixtral_names=True)
    assert "model.layers.0.block_sparse_moe.gate.weight" in names
    assert sum(".experts." in n for n in names) == 3 * spec.num_experts * spec.num_layers


def test_slot_pool_sites_and_targets():
    """Each dense LoRA target is the slice of the module that computes it (the layout MoEForCausalLM fuses)."""
    from moeserve.models.moe_decoder import MoEForCausalLM

    spec = tiny_spec("qwen2_moe", mlp_only_layers=[1])
    assert spec.sparse_layers[0] and not spec.sparse_layers[1]
    model = MoEForCausalLM(spec)
    pool = LoRASlotPool(spec, model, 2, 4, set(ALL_TARGETS), torch.device("cpu"), torch.float32)
    sparse, dense = model.layers[0], model.layers[1]
    want = {
        (0, "q_proj"): (sparse.self_attn.qkv_proj, 0), (0, "k_proj"): (sparse.self_attn.qkv_proj, 1),
        (0, "v_proj"): (sparse.self_attn.qkv_proj, 2), (0, "o_proj"): (sparse.self_attn.o_proj, 0),
        (0, "router"): (sparse.mlp.router, 0), (0, "shared_expert_gate"): (sparse.mlp.shared_expert_gate, 0),
        (0, "shared_expert.gate_proj"): (sparse.mlp.shared_expert.gate_up_proj, 0),
        (0, "shared_expert.up_proj"): (sparse.mlp.shared_expert.gate_up_proj, 1),
        (0, "shared_expert.down_proj"): (sparse.mlp.shared_expert.down_proj, 0),
        (1, "gate_proj"): (dense.mlp.gate_up_proj, 0), (1, "up_proj"): (dense.mlp.gate_up_proj, 1),
        (1, "down_proj"): (dense.mlp.down_proj, 0),
    }
    for (layer, target), (linear, index) in want.items():
        got, i = pool._dense_site(layer, target)
        assert got is linear and i == index, (layer, target)
        assert got.lora_a is not None
    assert [len(pool._linears(layer)) for layer in model.layers] == [6, 4, 6]  # qkv, o, router, shared x3 | mlp
    assert sparse.mlp.lora_bufs is not None
    assert set(pool.nbytes_by_target) == {"q_proj/k_proj/v_proj", "o_proj", "router", "experts", "shared_expert",
                                          "shared_expert_gate", "gate_proj/up_proj/down_proj"}


def test_target_lists_and_shard_rules():
    assert ALL_TARGETS == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                           "shared_expert", "shared_expert_gate", "experts", "router")
    assert set(SUPPORTED_DENSE_TARGETS) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                            "down_proj", "shared_expert.gate_proj", "shared_expert.up_proj",
                                            "shared_expert.down_proj", "router", "shared_expert_gate"}
    assert set(COLUMN) == {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "w1", "w3"}
    assert set(ROW) == {"o_proj", "down_proj", "w2"}
    assert set(module_tree.REPLICATED_MODULES) == {"mlp.router", "mlp.shared_expert_gate"}
    assert module_tree.target_module("shared_expert.up_proj") == "shared_expert"
    assert all(module_tree.target_module(t) in ALL_TARGETS for t in SUPPORTED_DENSE_TARGETS)
    with pytest.raises(KeyError, match="no projection is LoRA target 'experts'"):
        module_tree.projection("experts")
