"""ExecOptions: how the model executes — device, dtype, the backend of each kind of op, PDL, how base weights are
stored — built once from the engine's config (EngineConfig.exec_options) and handed to the model, which hands the
same object to every layer. Layers read it at construction only (the forward reads attributes they set then).

The rules that derive one choice from another live here and nowhere else:
  * a backend left "auto" is "triton" on CUDA and "torch" elsewhere; `linear_backend` "auto" follows attention;
  * the norms and the attention prologue follow the attention backend; dense LoRA kernels follow the MoE backend;
  * PDL left unset is on where the device has it (CUDA, compute capability >= 9.0), an explicit True is refused
    where it has not.
Which implementation a backend name selects is the registry's business (layers/backends.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

BACKENDS = ("torch", "triton")  # what a resolved backend may be ("auto" is resolved by the rules below)


def resolve_backend(requested: str, on_cuda: bool) -> str:
    """A backend flag's value once "auto" is resolved: Triton on CUDA, the torch reference elsewhere."""
    if requested == "auto":
        return "triton" if on_cuda else "torch"
    return requested


def resolve_linear_backend(requested: str, attention_backend: str) -> str:
    """The dense projections' backend: "auto" follows attention's (resolved), as the fused norms do."""
    return attention_backend if requested == "auto" else requested


def resolve_pdl(requested: bool | None, available: bool) -> bool:
    """PDL unset (None): on where the device has it; else what was asked (the caller refuses True where it is not
    available, naming its flag)."""
    return available if requested is None else requested


@dataclass(frozen=True)
class WeightFormat:
    """How a base weight is stored and multiplied. Today there is one format: stored in the activation dtype,
    multiplied by F.linear / oneDNN / the Triton GEMV / the fused MoE. A quantized format (FP8 base weights: storage
    dtype, scale granularity, the GEMM that reads it) is another value of this class, and ExecOptions.weight_format
    is where a weight's format is chosen."""
    storage: str = "activation_dtype"


@dataclass(frozen=True)
class ExecOptions:
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dtype: torch.dtype = torch.float32
    attention_backend: str = "torch"  # paged attention
    moe_backend: str = "torch"  # routing + routed experts
    # dense projections (q/k/v/o, dense MLP, shared expert, lm_head): "triton" runs the batches the GEMV serves
    # through it (kernels/gemv.serves), cuBLAS the rest
    linear_backend: str = "torch"
    # RMSNorm (fused with the residual add) and the attention prologue; None: follows the attention backend
    norm_backend: str | None = None
    # dense multi-LoRA shrink / expand; None: follows the MoE backend (the fused MoE carries the expert LoRA)
    lora_backend: str | None = None
    pdl: bool = False  # Triton kernels launch with programmatic dependent launch (kernels/pdl.py)
    weights: WeightFormat = WeightFormat()

    def __post_init__(self):
        if self.norm_backend is None:
            object.__setattr__(self, "norm_backend", self.attention_backend)
        if self.lora_backend is None:
            object.__setattr__(self, "lora_backend", self.moe_backend)
        for name in ("attention_backend", "moe_backend", "linear_backend", "norm_backend", "lora_backend"):
            if getattr(self, name) not in BACKENDS:
                raise ValueError(f"{name} must be one of {', '.join(BACKENDS)}, got {getattr(self, name)!r}")
        if self.pdl not in (True, False):
            raise ValueError(f"pdl must be a boolean, got {self.pdl!r}")
        if not isinstance(self.device, torch.device):
            object.__setattr__(self, "device", torch.device(self.device))

    def weight_format(self, name: str) -> WeightFormat:
        """How the base weight `name` (its checkpoint name) is stored and multiplied: one format for all today."""
        return self.weights

    def on_device(self, device: torch.device | str) -> "ExecOptions":
        """The same options on another device of the same kind (a tensor-parallel rank's own GPU)."""
        return replace(self, device=torch.device(device))


TORCH_CPU = ExecOptions()  # the torch reference on the CPU in float32: the default of tests and tools
