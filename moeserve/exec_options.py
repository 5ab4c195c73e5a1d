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
    """How a base weight is stored and multiplied (plain data; layers/weight_formats.py implements each method's
    create / load / shard / apply hooks).

    method None: stored in the activation dtype, multiplied by F.linear / oneDNN / the Triton GEMV / the fused MoE.
    method "fp8": block-wise float8_e4m3fn with one float32 scale_inv per `block` (out x in) of the weight, as Qwen
    and DeepSeek publish it (kernels/fp8.py); `act_quant` True multiplies W8A8 (activations quantized per token-group
    of block[1] at run time), False weight-only (the fp8 tile dequantized in the K loop), None (the engine's) picks
    per call: W8A8 where the call is a GEMM, weight-only where it is a GEMV (kernels/fp8_linear, fused_moe_fp8
    resolve_act_quant; the torch backend runs weight-only then)."""
    method: str | None = None
    block: tuple[int, int] = (128, 128)
    act_quant: bool | None = None

    @property
    def multiplication(self) -> str:
        """How the quantized weights are multiplied, in words (the start-up log)."""
        return {True: "W8A8", False: "weight-only", None: "W8A8 GEMMs, weight-only GEMVs"}[self.act_quant]

    @property
    def quantized(self) -> bool:
        return self.method is not None


PLAIN_WEIGHTS = WeightFormat()
WEIGHT_METHODS = (None, "fp8")


def module_matches(name: str, entry: str) -> bool:
    """Whether `entry` of a checkpoint's modules_to_not_convert names module `name` ("model.layers.0.mlp.gate"):
    the whole name, or a run of its dotted parts ("lm_head", "mlp.gate", "layers.0.self_attn")."""
    return f".{entry.strip('.')}." in f".{name}."


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
    # CUDA: a GEMM-computed projection's LoRA shrink on the model's LoRA stream, beside the GEMM (layers/linear.py);
    # None: beside the FP8 GEMM only, True: beside cuBLAS too, False: never (EngineConfig.lora_side_stream)
    lora_side_stream: bool | None = None
    weights: WeightFormat = PLAIN_WEIGHTS  # how the quantizable base weights are stored (weight_format)
    # checkpoint module names (or runs of their dotted parts) kept in the stored dtype whatever `weights` says: a
    # checkpoint's modules_to_not_convert / ignored_layers
    unquantized_modules: tuple[str, ...] = ()
    # how the KV cache is stored: None (the default) in `dtype`; float8_e4m3fn: each layer's K and V divided by their
    # scale (Attention.k_scale / v_scale), clamped to the e4m3 range and rounded (kernels/kv_fp8.py)
    kv_cache_dtype: torch.dtype | None = None

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
        if self.lora_side_stream is not None and not isinstance(self.lora_side_stream, bool):
            raise ValueError(f"lora_side_stream must be a boolean, got {self.lora_side_stream!r}")
        if self.weights.method not in WEIGHT_METHODS:
            raise ValueError(f"weight format {self.weights.method!r} is not implemented (known: fp8)")
        if self.kv_cache_dtype not in (None, self.dtype, torch.float8_e4m3fn):
            raise ValueError(f"kv_cache_dtype must be the activation dtype {self.dtype} or torch.float8_e4m3fn, got "
                             f"{self.kv_cache_dtype}")
        if not isinstance(self.device, torch.device):
            object.__setattr__(self, "device", torch.device(self.device))

    @property
    def kv_cache_fp8(self) -> bool:
        return self.kv_cache_dtype == torch.float8_e4m3fn

    def weight_format(self, *names: str) -> WeightFormat:
        """How the base weight of a module is stored and multiplied, `names` its checkpoint module names (several
        for a fused module: q|k|v, gate|up). Only quantizable weights ask (projections and routed experts; the
        embeddings, lm_head, norms and router are stored as they are); a fused module any of whose parts the
        checkpoint keeps unconverted stays plain (its fp8 parts, if any, are dequantized at load)."""
        if not self.weights.quantized:
            return PLAIN_WEIGHTS
        if any(module_matches(n, m) for n in names for m in self.unquantized_modules):
            return PLAIN_WEIGHTS
        return self.weights

    def on_device(self, device: torch.device | str) -> "ExecOptions":
        """The same options on another device of the same kind (a tensor-parallel rank's own GPU)."""
        return replace(self, device=torch.device(device))


TORCH_CPU = ExecOptions()  # the torch reference on the CPU in float32: the default of tests and tools
