"""Quantized checkpoints: which `quantization_config` methods moeserve implements (today: none).

A quantized checkpoint (block-wise FP8, GPTQ, AWQ, ...) stores its weights in a narrow dtype with scales beside
them. Read as plain weights, they would be cast to the serving dtype with their scales dropped: every shape
matches and every output is wrong. So a config.json that declares a method not in SUPPORTED_METHODS is refused
by name before any weight file is opened, and a tensor of a quantized or integer dtype in a checkpoint that
declares no method is refused by its name.

Implementing a method: add its name to SUPPORTED_METHODS and its dequantizing read to the loader's tensor
access (models/loader.py), which receives the method from `checkpoint_quantization`.

Errors are plain ValueError, as every config error is: the engine-core process reports a ValueError to the
frontend by that type, and the command line prints its message.
"""
from __future__ import annotations

import json
from pathlib import Path

SUPPORTED_METHODS: tuple[str, ...] = ()
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
        return method
    return None


def checkpoint_quantization(model_dir: str | Path) -> str | None:
    """`quantization_method` of the model folder's config.json; reads nothing else. A missing or unparsable
    config.json is left to ModelSpec to report (None here)."""
    path = Path(model_dir) / "config.json"
    try:
        hf_config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return quantization_method(hf_config) if isinstance(hf_config, dict) else None


def check_tensor_dtype(name: str, dtype: str, method: str | None) -> None:
    """Refuse a tensor of a quantized or integer dtype (safetensors' dtype name, e.g. 'F8_E4M3') in a checkpoint
    that declares no quantization method: cast to the serving dtype it would be silently wrong."""
    if method is None and dtype not in PLAIN_DTYPES:
        raise ValueError(f"checkpoint tensor {name!r} has dtype {dtype}, but config.json declares no "
                         "quantization_config: moeserve loads only float weights "
                         f"({', '.join(PLAIN_DTYPES)}) from an unquantized checkpoint")
