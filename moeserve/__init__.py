"""moeserve: Mixture-of-Experts LLM serving with many LoRA adapters and LoRA-variant CUDA graphs.

The names below are imported on first use: importing a module of the package (the HTTP server's, whose process
runs no model) does not import the engine, nor torch under it."""
import importlib

_EXPORTS = {
    "Engine": "moeserve.frontend.offline_engine",
    "EngineShutdownError": "moeserve.errors",
    "RequestError": "moeserve.errors",
    "EngineConfig": "moeserve.config",
    "SamplingParams": "moeserve.sampling_params",
    "RequestOutput": "moeserve.outputs",
    "TokenLogprobs": "moeserve.outputs",
}
__all__ = ["Engine", "EngineConfig", "SamplingParams", "RequestOutput", "TokenLogprobs", "RequestError",
           "EngineShutdownError"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'moeserve' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__():
    return sorted([*globals(), *__all__])
