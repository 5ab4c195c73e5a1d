"""Python-API errors name the CLI flag beside the config field, and start-up notes only what the user asked
for (issue 10.11)."""
import argparse
import logging

import pytest

from moeserve import Engine, EngineConfig
from moeserve.config import flag
from moeserve.engine_args import add_engine_args
from moeserve.lora.adapter import LoRAAdapterError
from peft_fixtures import make_peft_adapter, save_base_checkpoint


def cli_flags() -> set[str]:
    parser = add_engine_args(argparse.ArgumentParser())
    return {s for a in parser._actions for s in a.option_strings}


def test_every_config_field_has_the_flag_errors_name():
    flags = cli_flags()
    for name in EngineConfig.field_names():
        named = flag(name).split("(")[1].rstrip(")")
        assert named in flags, f"{flag(name)} names no command-line flag"


@pytest.mark.parametrize("kw,message", [
    (dict(max_lora_rank=0), "max_lora_rank (--max-lora-rank) must be a positive integer, got 0"),
    (dict(max_loras=True), "max_loras (--max-loras) must be a positive integer, got True"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization (--gpu-memory-utilization) must be a number in (0, 1]"),
    (dict(gpu_memory_utilization="0.9"), "gpu_memory_utilization (--gpu-memory-utilization) must be a number"),
    (dict(block_size=12), "block_size (--block-size) must be a power of two"),
    (dict(max_model_len=-1), "max_model_len (--max-model-len) must be a positive integer"),
    (dict(max_loras=4, max_cpu_loras=2), "max_cpu_loras (--max-cpu-loras) (2) must be >= max_loras (--max-loras) (4)"),
    (dict(lora_target_modules=["q_proj", "lm_head"]),
     "lora_target_modules (--lora-target-modules): unsupported ['lm_head']"),
    (dict(dtype="fp8"), "dtype (--dtype) must be one of auto, float32"),
    (dict(moe_backend="cuda"), "moe_backend (--moe-backend) must be one of"),
    (dict(lora_dir="/nonexistent/adapters"), "lora_dir (--lora-dir) '/nonexistent/adapters' is not a directory"),
    (dict(cuda_graph_bs=[0]), "cuda_graph_bs (--cuda-graph-bs) must be a list of positive integers"),
    (dict(pdl=True), "pdl (--pdl) needs a CUDA device of compute capability 9.0 or later"),
    (dict(pdl="yes"), "pdl (--pdl) must be a boolean"),
    (dict(lora_side_stream=1), "lora_side_stream (--lora-side-stream) must be a boolean, got 1"),
    (dict(fp8_activations="none"), "fp8_activations (--fp8-activations) applies to FP8 base weights"),
    (dict(fp8_activations="static"), "fp8_activations (--fp8-activations) must be one of auto, dynamic, none"),
    (dict(quantization="fp8", fp8_activations="dynamic", enable_lora=True),
     "fp8_activations (--fp8-activations) dynamic on the torch MoE backend takes no expert LoRA"),
])
def test_config_errors_name_the_flag(kw, message):
    with pytest.raises(ValueError) as err:
        EngineConfig(device="cpu", **kw).resolve()
    assert message in str(err.value)


def test_pdl_defaults_to_what_the_device_has():
    assert EngineConfig(device="cpu").resolve().pdl is False  # no CUDA: off, silently
    assert EngineConfig(device="cpu", pdl=False).resolve().pdl is False


def test_adapter_errors_name_the_flag(tmp_path):
    base = save_base_checkpoint("qwen3_moe", tmp_path / "base")
    path, _ = make_peft_adapter("qwen3_moe", tmp_path / "ad", kind="attn+experts", rank=8)
    engine = Engine(EngineConfig(model=str(base), device="cpu", enable_lora=True, max_lora_rank=4, max_loras=1))
    with pytest.raises(LoRAAdapterError, match=r"LoRA rank 8 exceeds the engine's max_lora_rank 4 \(--max-lora-rank\)"):
        engine.load_lora("ad", str(path))
    attn = Engine(EngineConfig(model=str(base), device="cpu", enable_lora=True, max_lora_rank=8, max_loras=1,
                               lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    with pytest.raises(LoRAAdapterError, match=r"--lora-target-modules\) including 'experts'"):
        attn.load_lora("ad", str(path))


def test_record_nolora_graph_is_mentioned_only_when_set(tmp_path, caplog):
    """The flag's default is "on where it takes effect": on CPU (no CUDA graphs) an engine whose user never set
    it says nothing about it; one that asked for it hears that it has no effect."""
    base = save_base_checkpoint("mixtral", tmp_path / "base")
    kw = dict(model=str(base), device="cpu", enable_lora=True, max_loras=1)

    def notes(**extra):
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="moeserve"):
            Engine(EngineConfig(**kw, **extra))
        return [r for r in caplog.records if "record-nolora-graph" in r.getMessage()]

    assert notes() == []
    assert notes(record_nolora_graph=False) == []
    asked = notes(record_nolora_graph=True)
    assert len(asked) == 1 and "has no effect: CUDA graphs are disabled" in asked[0].getMessage()


def test_lora_target_modules_help_lists_every_target():
    from moeserve.lora.slot_pool import ALL_TARGETS

    parser = add_engine_args(argparse.ArgumentParser())
    help_text = next(a.help for a in parser._actions if a.dest == "lora_target_modules")
    assert all(f" {t} " in help_text.replace("(", " ").replace(")", " ") for t in ALL_TARGETS), help_text
