"""A quantization method (or an fp8 variant) moeserve does not implement is refused by name before any weight file is
opened (Engine, loader and command line), and a quantized or integer tensor in a checkpoint that declares no
quantization is refused by its name: loaded as plain weights either would be silently wrong (issue 21). Block-wise
FP8 in the published variant is served (issue 25, tests/test_fp8_engine.py)."""
import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from moeserve import Engine, EngineConfig
from moeserve.cli import main as cli_main
from moeserve.models import loader
from moeserve.model_spec import ModelSpec

FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
BLOCK = 128


def fp8_block_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise FP8 as Qwen3-*-FP8 stores it: e4m3 weights and a float32 weight_scale_inv per 128x128 block
    (dequantized = fp8 * scale_inv of its block)."""
    rows, cols = w.shape
    scale = torch.empty(math.ceil(rows / BLOCK), math.ceil(cols / BLOCK))
    q = torch.empty_like(w, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            blk = w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK]
            s = blk.abs().max().clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
            scale[i, j] = s
            q[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = (blk / s).to(torch.float8_e4m3fn)
    return q, scale


def quantized_copy(src, dst, qc=FP8_CONFIG):
    """The tiny checkpoint `src` as a block-wise FP8 one: projections in e4m3 with their scales; embeddings,
    lm_head, norms and the router stay float, as in the real checkpoints."""
    shutil.copytree(src, dst)
    (weights,) = dst.glob("*.safetensors")
    tensors = load_file(weights)
    out = {}
    for name, t in tensors.items():
        if t.dim() == 2 and name.endswith("proj.weight"):
            out[name], out[name + "_scale_inv"] = fp8_block_quantize(t)
        else:
            out[name] = t
    save_file(out, weights)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def with_quantization_config(src, dst, qc):
    model = shutil.copytree(src, dst)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    return model


# fp8 variants moeserve does not implement, and the setting each refusal names
BAD_FP8 = [({**FP8_CONFIG, "fmt": "e5m2"}, "fmt 'e5m2'"),
           ({**FP8_CONFIG, "activation_scheme": "static"}, "activation_scheme 'static'"),
           ({**FP8_CONFIG, "weight_block_size": [64, 64]}, r"weight_block_size \[64, 64\]"),
           ({k: v for k, v in FP8_CONFIG.items() if k != "weight_block_size"}, r"weight_block_size none \(per-tensor scales\)")]


@pytest.fixture(params=BAD_FP8, ids=["fmt", "activation_scheme", "block", "per-tensor"])
def bad_fp8_model(request, tiny_models, tmp_path):
    qc, named = request.param
    return quantized_copy(tiny_models["qwen3_moe"], tmp_path / "fp8", qc), named


@pytest.fixture
def opened(monkeypatch):
    """Every weight file the loader opens."""
    files = []
    real = loader.safe_open

    def spy(path, *args, **kwargs):
        files.append(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(loader, "safe_open", spy)
    return files


def test_unimplemented_fp8_variant_is_refused_by_its_setting_before_any_weight_is_read(bad_fp8_model, opened):
    model, named = bad_fp8_model
    with pytest.raises(ValueError, match=f"fp8 checkpoint with {named} .config.json quantization_config. is not "
                                         "supported"):
        Engine(EngineConfig(model=str(model), device="cpu", num_kv_blocks=16))
    assert opened == []


def test_loader_refuses_before_opening_a_weight_file(bad_fp8_model, opened):
    """The loader checks on its own too (benchmarks and tensor-parallel workers call it directly)."""
    model, named = bad_fp8_model
    spec = ModelSpec.from_model_dir(model)
    with pytest.raises(ValueError, match=f"fp8 checkpoint with {named}"):
        loader.load_model(model, spec)
    assert opened == []


def test_published_fp8_checkpoint_is_served(tiny_models, tmp_path):
    model = quantized_copy(tiny_models["qwen3_moe"], tmp_path / "fp8")
    engine = Engine(EngineConfig(model=str(model), device="cpu", num_kv_blocks=16))
    assert engine.config.quantization == "fp8"
    assert engine.runner.model.layers[0].self_attn.o_proj.weight.dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("flag,named", [("gptq", "'gptq' is not supported"), ("fp16", "'fp16' is not supported")])
def test_unknown_quantization_flag_is_refused(tiny_models, flag, named):
    with pytest.raises(ValueError, match=f"quantization .--quantization. {named}"):
        EngineConfig(model=str(tiny_models["mixtral"]), device="cpu", quantization=flag).resolve()


def test_quantization_flag_conflicting_with_the_checkpoint_is_refused(tiny_models, tmp_path, opened):
    model = with_quantization_config(tiny_models["mixtral"], tmp_path / "q", {"quant_method": "fp8", **FP8_CONFIG})
    EngineConfig(model=str(model), device="cpu", quantization="fp8").resolve()  # agreeing: fine
    cfg = json.loads((model / "config.json").read_text())
    cfg["quantization_config"]["quant_method"] = "awq"
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="quantization method 'awq'"):
        EngineConfig(model=str(model), device="cpu", quantization="fp8").resolve()
    assert opened == []


def test_an_fp8_checkpoint_holding_another_narrow_dtype_is_refused_by_name(tiny_models, tmp_path):
    model = quantized_copy(tiny_models["qwen3_moe"], tmp_path / "fp8")
    (weights,) = model.glob("*.safetensors")
    tensors = load_file(weights)
    name = "model.layers.0.self_attn.o_proj.weight"
    tensors[name] = tensors[name].to(torch.int8)
    save_file(tensors, weights)
    with pytest.raises(ValueError, match=f"checkpoint tensor '{name}' has dtype I8, but an fp8 checkpoint stores"):
        Engine(EngineConfig(model=str(model), device="cpu", num_kv_blocks=16))


@pytest.mark.parametrize("qc,named", [({"quant_method": "gptq", "bits": 4}, "'gptq'"),
                                      ({"bits": 4}, "(no quant_method given)")])
def test_every_quantization_config_is_refused(tiny_models, tmp_path, qc, named):
    model = shutil.copytree(tiny_models["mixtral"], tmp_path / "q")
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    with pytest.raises(ValueError, match=f"quantization method {named}".replace("(", r"\(").replace(")", r"\)")):
        EngineConfig(model=str(model), device="cpu").resolve()


def test_command_line_prints_the_refusal(bad_fp8_model, capsys):
    model, _ = bad_fp8_model
    assert cli_main(["generate", "--model", str(model), "--device", "cpu", "hello"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: fp8 checkpoint with") and "Traceback" not in err


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8])
def test_narrow_tensor_without_a_quantization_config_is_refused_by_name(tiny_models, tmp_path, dtype):
    model = shutil.copytree(tiny_models["qwen3_moe"], tmp_path / "m")
    (weights,) = model.glob("*.safetensors")
    tensors = load_file(weights)
    name = "model.layers.0.self_attn.o_proj.weight"
    tensors[name] = tensors[name].to(dtype)
    save_file(tensors, weights)
    with pytest.raises(ValueError, match=f"checkpoint tensor '{name}' has dtype (F8_E4M3|I8), but config.json "
                                         "declares no quantization_config"):
        Engine(EngineConfig(model=str(model), device="cpu", num_kv_blocks=16))


def test_the_server_path_reports_the_refusal_as_a_config_error(tiny_models, tmp_path):
    """`moeserve serve` starts the engine core in its own process: the refusal crosses to the frontend as a
    ValueError with its message, which the command line prints as `error: ...`. One variant: the crossing does
    not depend on which refusal it carries (each variant's message: the tests above, in process)."""
    import asyncio

    from moeserve.frontend.core_client import EngineClient

    qc, named = BAD_FP8[0]
    model = quantized_copy(tiny_models["qwen3_moe"], tmp_path / "fp8", qc)
    with pytest.raises(ValueError, match=f"fp8 checkpoint with {named} .config.json quantization_config. is not "
                                         "supported"):
        asyncio.run(EngineClient.start(EngineConfig(model=str(model), device="cpu"), "ERROR"))
