"""A quantized checkpoint is refused by its method before any weight file is opened (Engine, loader and command
line), and a quantized or integer tensor in a checkpoint that declares no quantization is refused by its name:
loaded as plain weights either would be silently wrong (issue 21)."""
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


def quantized_copy(src, dst):
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
    cfg["quantization_config"] = FP8_CONFIG
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture
def fp8_model(tiny_models, tmp_path):
    return quantized_copy(tiny_models["qwen3_moe"], tmp_path / "fp8")


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


def test_fp8_checkpoint_is_refused_by_method_before_any_weight_is_read(fp8_model, opened):
    with pytest.raises(ValueError) as err:
        Engine(EngineConfig(model=str(fp8_model), device="cpu", num_kv_blocks=16))
    message = str(err.value)
    assert "quantization method 'fp8' (config.json quantization_config) is not supported; supported: none" in message
    assert opened == []


def test_loader_refuses_before_opening_a_weight_file(fp8_model, opened):
    """The loader checks on its own too (benchmarks and tensor-parallel workers call it directly)."""
    spec = ModelSpec.from_model_dir(fp8_model)
    with pytest.raises(ValueError, match="quantization method 'fp8'"):
        loader.load_model(fp8_model, spec)
    assert opened == []


@pytest.mark.parametrize("qc,named", [({"quant_method": "gptq", "bits": 4}, "'gptq'"),
                                      ({"bits": 4}, "(no quant_method given)")])
def test_every_quantization_config_is_refused(tiny_models, tmp_path, qc, named):
    model = shutil.copytree(tiny_models["mixtral"], tmp_path / "q")
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    with pytest.raises(ValueError, match=f"quantization method {named}".replace("(", r"\(").replace(")", r"\)")):
        EngineConfig(model=str(model), device="cpu").resolve()


def test_command_line_prints_the_refusal(fp8_model, capsys):
    assert cli_main(["generate", "--model", str(fp8_model), "--device", "cpu", "hello"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: quantization method 'fp8'") and "Traceback" not in err


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


def test_the_server_path_reports_the_refusal_as_a_config_error(fp8_model):
    """`moeserve serve` starts the engine core in its own process: the refusal crosses to the frontend as a
    ValueError with its message, which the command line prints as `error: ...`."""
    import asyncio

    from moeserve.frontend.core_client import EngineClient

    with pytest.raises(ValueError, match="quantization method 'fp8' .config.json quantization_config. is not "
                                         "supported; supported: none"):
        asyncio.run(EngineClient.start(EngineConfig(model=str(fp8_model), device="cpu"), "ERROR"))
