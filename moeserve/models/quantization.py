"""Quantized checkpoints: which `quantization_config` methods moeserve implements, and the `--quantization` choice.

A quantized checkpoint (block-wise FP8, GPTQ, AWQ, ...) stores its weights in a narrow dtype with scales beside
them. Read as plain weights, they would be cast to the serving dtype with their scales dropped: every shape
matches and every output is wrong. So a config.json that declares a method not in SUPPORTED_METHODS is refused
by name before any weight file is opened, and a tensor of a quantized or integer dtype in a checkpoint that
declares no method is refused by its name.

Implemented: "fp8", block-wise as Qwen and DeepSeek publish it, and only that variant ({"quant_method": "fp8",
"fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}): each quantized weight
float8_e4m3fn with a float32 `<name>_scale_inv` per 128 x 128 block; `modules_to_not_convert` /
`ignored_layers` name modules stored unquantized. Another fmt, block size or activation scheme is refused by name.
How such a weight is loaded, sharded and multiplied: layers/weight_formats.py; which weights are quantized:
ExecOptions.weight_format.

Errors are plain ValueError, as every config error is: the engine-core process reports a ValueError to the
frontend by that type, and the command line prints its message.
"""
from __future__ import annotations

import json
from pathlib import Path

from moeserve.exec_options import PLAIN_WEIGHTS, WeightFormat

SUPPORTED_METHODS: tuple[str, ...] = ("fp8",)
# what moeserve implements of an fp8 config (the published block-wise variant); anything else is refused by name
FP8_FMT, FP8_ACTIVATION_SCHEME, FP8_BLOCK = "e4m3", "dynamic", (128, 128)
# config keys naming modules a quantized checkpoint stores unquantized (HF's name, then vLLM's / llm-compressor's)
UNQUANTIZED_KEYS = ("modules_to_not_convert", "ignored_layers")
# where config.json declares a method (`compression_config`: the name older compressed-tensors checkpoints use)
CONFIG_KEYS = ("quantization_config", "compression_config")
# safetensors' names of the float dtypes an unquantized checkpoint holds; the loader casts them to the serving dtype
PLAIN_DTYPES = ("F64", "F32", "F16", "BF16")


def quantization_method(hf_config: dict) -> str | None:
    """The quantization method `hf_config` (a parsed config.json) declares, None for plain weights; a method
    moeserve does not implement raises ValueError naming it."""
    for key in CONFIG_KEYS:
        qc = hf_config.get(key)
        if qc is None:
            continue
        method = qc.get("quant_method") if isinstance(qc, dict) else None
        if method not in SUPPORTED_METHODS:
            shown = repr(method) if method is not None else "(no quant_method given)"
            raise ValueError(f"quantization method {shown} (config.json {key}) is not supported; supported: "
                             f"{', '.join(SUPPORTED_METHODS) or 'none'}. Serve the unquantized checkpoint "
                             "(the weights would otherwise load cast, with their scales ignored)")
        if method == "fp8":
            _check_fp8(qc, key)
        return method
    return None


def _check_fp8(qc: dict, key: str) -> None:
    """Refuse an fp8 config moeserve does not implement, naming the setting."""
    where = f"config.json {key}"
    fmt = qc.get("fmt", FP8_FMT)
    if fmt != FP8_FMT:
        raise ValueError(f"fp8 checkpoint with fmt {fmt!r} ({where}) is not supported: only {FP8_FMT!r} "
                         "(float8_e4m3fn weights)")
    scheme = qc.get("activation_scheme", FP8_ACTIVATION_SCHEME)
    if scheme != FP8_ACTIVATION_SCHEME:
        raise ValueError(f"fp8 checkpoint with activation_scheme {scheme!r} ({where}) is not supported: only "
                         f"{FP8_ACTIVATION_SCHEME!r} (activation scales computed at run time)")
    block = qc.get("weight_block_size")
    if block is None or list(block) != list(FP8_BLOCK):
        shown = "none (per-tensor scales)" if block is None else repr(block)
        raise ValueError(f"fp8 checkpoint with weight_block_size {shown} ({where}) is not supported: only "
                         f"{list(FP8_BLOCK)} (block-wise scale_inv per 128 x 128 weight block)")
    for k in UNQUANTIZED_KEYS:
        names = qc.get(k)
        if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
            raise ValueError(f"fp8 checkpoint's {k} ({where}) must be a list of module names, got {names!r}")


def unquantized_modules(hf_config: dict) -> tuple[str, ...]:
    """The module names a quantized config keeps unquantized (modules_to_not_convert, ignored_layers)."""
    for key in CONFIG_KEYS:
        qc = hf_config.get(key)
        if isinstance(qc, dict):
            return tuple(n for k in UNQUANTIZED_KEYS for n in (qc.get(k) or ()))
    return ()


def _read_config(model_dir: str | Path | None) -> dict | None:
    if model_dir is None:
        return None
    try:
        hf_config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return hf_config if isinstance(hf_config, dict) else None


def resolve_quantization(requested: str | None, model_dir: str | Path | None) -> str | None:
    """The method the engine serves: `--quantization` (None: unset) against what the checkpoint declares. A
    checkpoint that declares fp8 serves FP8 with the flag unset (as vLLM does); `--quantization fp8` on a plain
    checkpoint quantizes it at load; a flag that contradicts the checkpoint is refused, naming both."""
    if requested not in (None, *SUPPORTED_METHODS):
        raise ValueError(f"quantization (--quantization) {requested!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_METHODS)} (or unset)")
    declared = checkpoint_quantization(model_dir) if model_dir is not None else None
    if requested is not None and declared is not None and requested != declared:
        raise ValueError(f"quantization (--quantization) {requested!r} conflicts with the checkpoint's "
                         f"quantization_config method {declared!r}: leave --quantization unset or set it to "
                         f"{declared!r}")
    return requested if requested is not None else declared


ACT_QUANT = {"auto": None, "dynamic": True, "none": False}  # EngineConfig.fp8_activations -> WeightFormat.act_quant


def weight_format(method: str | None, model_dir: str | Path | None,
                  activations: str = "auto") -> tuple[WeightFormat, tuple[str, ...]]:
    """(how the quantizable weights are stored, the modules the checkpoint keeps unquantized) for ExecOptions;
    `activations`: EngineConfig.fp8_activations."""
    if method is None:
        return PLAIN_WEIGHTS, ()
    hf_config = _read_config(model_dir) or {}
    return (WeightFormat(method="fp8", block=FP8_BLOCK, act_quant=ACT_QUANT[activations]),
            unquantized_modules(hf_config))


def checkpoint_quantization(model_dir: str | Path) -> str | None:
    """`quantization_method` of the model folder's config.json; reads nothing else. A missing or unparsable
    config.json is left to ModelSpec to report (None here)."""
    hf_config = _read_config(model_dir)
    return quantization_method(hf_config) if hf_config is not None else None


def check_tensor_dtype(name: str, dtype: str, method: str | None) -> None:
    """Refuse a tensor of a quantized or integer dtype (safetensors' dtype name, e.g. 'F8_E4M3') in a checkpoint
    that declares no quantization method: cast to the serving dtype it would be silently wrong."""
    if method == "fp8" and dtype in (*PLAIN_DTYPES, "F8_E4M3"):
        return
    if method == "fp8":
        raise ValueError(f"checkpoint tensor {name!r} has dtype {dtype}, but an fp8 checkpoint stores float8_e4m3fn "
                         f"(F8_E4M3) weights and float scales ({', '.join(PLAIN_DTYPES)})")
    if method is None and dtype not in PLAIN_DTYPES:
        raise ValueError(f"checkpoint tensor {name!r} has dtype {dtype}, but config.json declares no "
                         "quantization_config: moeserve loads only float weights "
                         f"({', '.join(PLAIN_DTYPES)}) from an unquantized checkpoint")
