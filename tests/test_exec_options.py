"""The execution options built once from EngineConfig, the rules that derive them, and the backend registry the
layers read them through: every layer of a built model runs the implementation and the PDL setting the options
name (exec_options.py, layers/backends.py)."""
import pytest
import torch

from moeserve.config import EngineConfig
from moeserve.exec_options import ExecOptions, resolve_backend, resolve_linear_backend, resolve_pdl
from moeserve.kernels import fused_moe, gemv, lora_dense, norm_rotary, paged_attention, router
from moeserve.layers.attention import Attention, TorchAttentionBackend, TritonAttentionBackend
from moeserve.layers.backends import kernels
from moeserve.layers.linear import LoRALinear
from moeserve.layers.moe import MoEBlock
from moeserve.layers.norm import RMSNorm
from moeserve.model_spec import ModelSpec
from moeserve.models.moe_decoder import MoEForCausalLM

SPEC = ModelSpec(family="qwen2_moe", num_layers=2, sparse_layers=(True, False), vocab_size=64, hidden_size=32,
                 num_heads=4, num_kv_heads=2, head_dim=8, num_experts=4, top_k=2, moe_intermediate_size=16,
                 intermediate_size=24, shared_expert_intermediate_size=16, norm_topk_prob=False,
                 max_position_embeddings=64)


def test_cpu_config_builds_torch_options():
    opts = EngineConfig(device="cpu").resolve().exec_options()
    assert opts == ExecOptions(device=torch.device("cpu"), dtype=torch.float32, attention_backend="torch",
                               moe_backend="torch", linear_backend="torch", norm_backend="torch",
                               lora_backend="torch", pdl=False)


def test_derived_backends_follow_their_rules():
    # linear "auto" and the norms follow attention; dense LoRA follows the MoE backend
    opts = EngineConfig(device="cpu", attention_backend="triton", moe_backend="triton").resolve().exec_options()
    assert (opts.linear_backend, opts.norm_backend, opts.lora_backend) == ("triton", "triton", "triton")
    opts = EngineConfig(device="cpu", attention_backend="triton", linear_backend="torch").resolve().exec_options()
    assert (opts.linear_backend, opts.norm_backend, opts.lora_backend) == ("torch", "triton", "torch")
    # "auto" is Triton on CUDA, torch elsewhere; PDL unset is on exactly where the device has it
    assert [resolve_backend("auto", c) for c in (True, False)] == ["triton", "torch"]
    assert resolve_backend("torch", True) == "torch" and resolve_linear_backend("auto", "triton") == "triton"
    assert [resolve_pdl(None, a) for a in (True, False)] == [True, False]
    assert resolve_pdl(False, True) is False


def test_exec_options_need_a_resolved_config_and_valid_names():
    with pytest.raises(ValueError, match="resolve"):
        EngineConfig(device="cpu").exec_options()
    with pytest.raises(ValueError, match="moe_backend must be one of torch, triton"):
        ExecOptions(moe_backend="auto")
    with pytest.raises(ValueError, match="pdl must be a boolean"):
        ExecOptions(pdl=None)
    assert ExecOptions().on_device("cpu") == ExecOptions()


def test_registry_maps_names_to_implementations():
    assert all(kernels(op, "torch") is None for op in ("attention", "norm", "moe", "routing", "lora", "linear"))
    assert [kernels(op, "triton") for op in ("attention", "norm", "moe", "routing", "lora", "linear")] == \
        [paged_attention, norm_rotary, fused_moe, router, lora_dense, gemv]
    with pytest.raises(ValueError, match="must be one of torch, triton"):
        kernels("norm", "cuda")
    with pytest.raises(KeyError, match="no backend registry entry"):
        kernels("softmax", "triton")


@pytest.mark.parametrize("pdl", [False, True])
def test_model_layers_read_one_options_object(pdl):
    """One options object handed to the model reaches every layer: each runs the implementation and the PDL
    setting it names, and the router and shared-expert gate alone keep cuBLAS."""
    opts = ExecOptions(attention_backend="triton", moe_backend="triton", linear_backend="triton", pdl=pdl)
    model = MoEForCausalLM(SPEC, opts)
    assert model.gemv is gemv and model.pdl is pdl
    attns = [m for m in model.modules() if isinstance(m, Attention)]
    assert len(attns) == 2 and all(isinstance(a.backend, TritonAttentionBackend) and a.backend.pdl is pdl
                                   and a.prologue_kernels is norm_rotary and a.pdl is pdl for a in attns)
    norms = [m for m in model.modules() if isinstance(m, RMSNorm) and m.kernels is not None]
    assert len(norms) == 5 and all(n.kernels is norm_rotary and n.pdl is pdl for n in norms)  # 2 per layer + final
    linears = {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}
    assert all(m.lora_kernels is lora_dense and m.pdl is pdl for m in linears.values())
    assert {n for n, m in linears.items() if m.gemv_kernels is None} == {"layers.0.mlp.router",
                                                                        "layers.0.mlp.shared_expert_gate"}
    moe = model.layers[0].mlp
    assert isinstance(moe, MoEBlock) and moe._fused is fused_moe and moe._routing is router and moe.pdl is pdl

    ref = MoEForCausalLM(SPEC)  # the default: the torch reference everywhere
    assert ref.gemv is None and not ref.pdl
    assert all(isinstance(m.backend, TorchAttentionBackend) and m.prologue_kernels is None
               for m in ref.modules() if isinstance(m, Attention))
    assert all(m.kernels is None for m in ref.modules() if isinstance(m, RMSNorm))
    assert all(m.lora_kernels is None and m.gemv_kernels is None for m in ref.modules() if isinstance(m, LoRALinear))
    assert ref.layers[0].mlp._fused is None and ref.layers[0].mlp._routing is None


def test_weight_format_keeps_the_modules_a_checkpoint_names_unconverted():
    """ExecOptions.weight_format: FP8 for every quantizable weight but the modules named in the checkpoint's
    modules_to_not_convert / ignored_layers (a whole name or a run of its dotted parts); a fused module with any
    part named stays plain; plain options answer plain for all."""
    from moeserve.exec_options import PLAIN_WEIGHTS, WeightFormat

    fp8 = WeightFormat(method="fp8")
    options = ExecOptions(weights=fp8, unquantized_modules=("lm_head", "layers.0.self_attn.k_proj",
                                                            "block_sparse_moe.experts"))
    assert options.weight_format("model.layers.1.self_attn.o_proj") == fp8
    qkv = ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj")
    assert options.weight_format(*qkv) == PLAIN_WEIGHTS
    assert options.weight_format("model.layers.0.self_attn.o_proj") == fp8
    assert options.weight_format("model.layers.10.self_attn.k_proj") == fp8  # layers.0 is not layers.10
    assert options.weight_format("model.layers.2.mlp.experts", "model.layers.2.block_sparse_moe.experts") == PLAIN_WEIGHTS
    assert ExecOptions().weight_format("model.layers.0.self_attn.o_proj") == PLAIN_WEIGHTS
    with pytest.raises(ValueError, match="weight format 'int4' is not implemented"):
        ExecOptions(weights=WeightFormat(method="int4"))
