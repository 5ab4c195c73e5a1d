"""moeserve: Mixture-of-Experts LLM serving with many LoRA adapters and LoRA-variant CUDA graphs."""
from moeserve.config import EngineConfig
from moeserve.frontend.offline_engine import Engine, EngineShutdownError, RequestError
from moeserve.outputs import RequestOutput, TokenLogprobs
from moeserve.sampling_params import SamplingParams

__all__ = ["Engine", "EngineConfig", "SamplingParams", "RequestOutput", "TokenLogprobs", "RequestError",
           "EngineShutdownError"]
__version__ = "0.1.0"
