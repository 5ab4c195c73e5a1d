"""EngineConfig: every CLI flag maps to one field; validated once, "auto" resolved first.

Importing this module does not import torch: the HTTP process builds a config from flags and sends it to the engine
core without it. What needs the device (resolve, exec_options, torch_dtype) imports torch when called, in the core.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING

from moeserve.lora.names import validate_adapter_name
from moeserve.module_tree import ALL_TARGETS

if TYPE_CHECKING:
    import torch

    from moeserve.exec_options import ExecOptions

logger = logging.getLogger("moeserve")

DTYPES = ("float32", "bfloat16", "float16")  # torch's names of the serving dtypes (torch_dtype)
BACKENDS = ("auto", "torch", "triton")
LOAD_FORMATS = ("auto", "safetensors", "dummy")
FP8_ACTIVATIONS = ("auto", "dynamic", "none")  # fp8_activations (models/quantization.py ACT_QUANT)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # kv_cache_dtype, vLLM's values ("fp8" is "fp8_e4m3")


def flag(field_name: str) -> str:
    """A config field as errors name it, with its command-line flag: 'max_lora_rank (--max-lora-rank)'."""
    return f"{field_name} (--{field_name.replace('_', '-')})"


def cuda_device_count() -> int:
    """The CUDA devices this process sees (0: none, or torch built without CUDA). Imports torch: called where a
    config is resolved (the engine core) and where data-parallel cores are given GPUs, not to build a config."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass
class EngineConfig:
    model: str | None = None  # HF model folder; None = the embedded demo model
    tokenizer: str | None = None  # defaults to the model folder
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (auto: bf16 on cuda, fp32 on cpu)
    load_format: str = "auto"  # auto (safetensors) | dummy (random weights from config.json, for benchmarks)
    seed: int = 0
    # base weights: None (unset) serves what the checkpoint declares (an fp8 quantization_config serves FP8);
    # "fp8": block-wise FP8 (128 x 128 scales), a plain checkpoint quantized at load. LoRA stays in `dtype`
    quantization: str | None = None
    # how FP8 products treat activations: "auto" quantizes them per token-group of 128 (W8A8, as the checkpoints'
    # activation_scheme "dynamic" asks) where a call is a GEMM and not where it is a GEMV (decode rows); "dynamic"
    # always (GEMVs too: every row's activations rounded alike whatever its batch); "none" never (weight-only: the
    # fp8 tile dequantized in the K loop, exact against the dequantized weights, slower from 64 rows on Hopper)
    fp8_activations: str = "auto"

    # memory and batching
    max_model_len: int | None = None  # default min(max_position_embeddings, 4096)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192  # token budget of a prefill step (chunked prefill slices long prompts)
    prefill_delay_steps: int = 8  # decode steps waiting prompts may wait to be prefilled together
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True  # reuse KV blocks of prompt prefixes (keyed by adapter version)
    block_size: int = 16
    # how K and V are stored: "auto" in `dtype`; "fp8" (= "fp8_e4m3"): float8_e4m3fn, each layer's K and V divided by
    # a scale of their own (the checkpoint's self_attn.k_scale / v_scale, else 1.0): one byte per element, so a
    # memory budget holds twice the blocks of bf16 and decode attention reads half the bytes
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.90  # fraction of free device memory for the KV cache (cuda)
    kv_cache_memory_bytes: int | None = None  # explicit KV budget; overrides gpu_memory_utilization
    num_kv_blocks: int | None = None  # explicit block count (tests); overrides both
    # device memory the engine may use in all (weights, LoRA pool, KV cache, activations); default: what the
    # device reports free at start. Start-up refuses when weights + LoRA pool + one max_model_len sequence of KV
    # do not fit. On CPU it gives the planning a budget (there is none otherwise).
    device_memory_bytes: int | None = None

    # backends
    moe_backend: str = "auto"
    attention_backend: str = "auto"
    # dense projections (q/k/v/o, dense MLP, shared expert, lm_head): "triton" runs the batches where the Triton GEMV
    # beats cuBLAS through it (kernels/gemv.serves; LoRA expand fused in), cuBLAS the rest; "torch": cuBLAS always.
    # auto = attention_backend's
    linear_backend: str = "auto"

    # LoRA
    enable_lora: bool = False
    max_loras: int = 8  # device slots
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # host cache of parsed adapters (default: max(max_loras, 16))
    lora_modules: dict[str, str] = field(default_factory=dict)  # name -> path, loaded at start
    lora_target_modules: list[str] | None = None  # None = inferred from lora_modules (or all supported)
    # an up A per routed-expert slot, so separate gate_proj / up_proj LoRAs of rank r cost rank r, not 2r (+H per
    # rank and expert slot). None: on when a lora_modules adapter has them, decided when the pool is built
    lora_separate_gate_up: bool | None = None
    # /v1/load_lora_adapter and /v1/unload_lora_adapter answer only when this is on: loading parses files the
    # client names, so it is the operator's choice (vLLM gates it behind VLLM_ALLOW_RUNTIME_LORA_UPDATING)
    enable_lora_runtime_loading: bool = False
    lora_dir: str | None = None  # runtime loads are confined to this folder (realpath); a name alone means DIR/name

    # CUDA graphs
    enforce_eager: bool = False  # --disable-cuda-graph
    cuda_graph_max_bs: int = 256
    cuda_graph_bs: list[int] | None = None
    # with LoRA on, also capture a no-LoRA graph per batch size. None (default): on where it takes effect (CUDA
    # graphs and the triton MoE backend), silently off elsewhere; True: asked for, so a setting where it cannot
    # take effect is warned about; False: off
    record_nolora_graph: bool | None = None
    # Triton kernels launched with programmatic dependent launch (kernels/pdl.py): each kernel's launch and start
    # overlap the previous kernel's tail. None (default): on where the device has it (CUDA, compute capability
    # >= 9.0); True: asked for, refused where it cannot run; False: off
    pdl: bool | None = None
    # on CUDA, the LoRA shrink of a projection a GEMM computes (batch 3 and up, prefill) runs beside that GEMM on a
    # stream of its own (layers/linear.py). None (default): beside the FP8 GEMM only (measured: it pays there; beside
    # bf16 cuBLAS it gained at batch 64 and lost at 256); True: beside cuBLAS too; False: after the GEMM, on the
    # forward's stream. The same bits every way
    lora_side_stream: bool | None = None
    # at start, on CUDA: run the eager (prefill) shapes the engine will run, with and without LoRA, so every kernel
    # variant is compiled then and not in a user's request (engine/warmup.py); --no-warmup skips it
    warmup: bool = True

    # serving
    max_queue_len: int = 1024  # waiting requests beyond this are refused (server answers 503)

    # parallelism (one worker process per extra rank; NCCL on cuda, gloo on cpu)
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False  # routed experts split whole across the ranks instead of sliced
    dist_timeout: int = 600  # seconds a collective may wait for a rank before the engine stops naming it
    # activation all-reduces through NCCL only; by default (CUDA, several ranks) they go through a symmetric-memory
    # buffer where every rank can set one up (distributed/parallel_state.py), NCCL otherwise
    disable_custom_all_reduce: bool = False
    # engine cores behind one frontend, each a whole copy of the model on its own GPUs (core i: GPUs i*TP..i*TP+TP-1);
    # started by the server's DataParallelClient (frontend/dp_client.py), never by an engine core itself
    data_parallel_size: int = 1

    def __post_init__(self):
        self._resolved = False

    def _resolve_pdl(self, on_cuda: bool) -> None:
        if self.pdl not in (None, True, False):
            raise ValueError(f"{flag('pdl')} must be a boolean, got {self.pdl!r}")
        import torch

        from moeserve.exec_options import resolve_pdl
        from moeserve.kernels.pdl import supported  # imports triton: only here, once per engine

        available = on_cuda and supported(torch.device(self.device))
        if self.pdl and not available:
            raise ValueError(f"{flag('pdl')} needs a CUDA device of compute capability 9.0 or later (Hopper); "
                             f"{self.device!r} has none: leave it unset or pass --no-pdl")
        self.pdl = resolve_pdl(self.pdl, available)

    def _resolve_kv_cache_dtype(self, on_cuda: bool) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"{flag('kv_cache_dtype')} must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                             f"{self.kv_cache_dtype!r}")
        if self.kv_cache_dtype == "fp8":
            self.kv_cache_dtype = "fp8_e4m3"
        if self.kv_cache_dtype != "auto" and on_cuda:
            import torch

            capability = torch.cuda.get_device_capability(torch.device(self.device))
            if capability < (8, 9):  # the kernels convert e4m3 where the hardware has it (Ada, Hopper and later)
                raise ValueError(f"{flag('kv_cache_dtype')} {self.kv_cache_dtype} needs a CUDA device of compute "
                                 f"capability 8.9 or later; {self.device!r} has {capability[0]}.{capability[1]}: "
                                 "leave it auto")

    def resolve(self) -> "EngineConfig":
        """Resolve "auto" values, then validate; idempotent."""
        if self._resolved:
            return self
        from moeserve.exec_options import resolve_backend, resolve_linear_backend
        from moeserve.models.quantization import resolve_quantization

        cuda_devices = cuda_device_count()
        if self.device == "auto":
            self.device = "cuda" if cuda_devices else "cpu"
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"{flag('device')} must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.device.startswith("cuda") and not cuda_devices:
            raise ValueError(f"{flag('device')}={self.device!r} but no CUDA device is available")
        on_cuda = self.device.startswith("cuda")
        if self.dtype == "auto":
            self.dtype = "bfloat16" if on_cuda else "float32"
        if self.dtype not in DTYPES:
            raise ValueError(f"{flag('dtype')} must be one of auto, {', '.join(DTYPES)}, got {self.dtype!r}")
        for name in ("moe_backend", "attention_backend", "linear_backend"):
            v = getattr(self, name)
            if v not in BACKENDS:
                raise ValueError(f"{flag(name)} must be one of {', '.join(BACKENDS)}, got {v!r}")
        self.moe_backend = resolve_backend(self.moe_backend, on_cuda)
        self.attention_backend = resolve_backend(self.attention_backend, on_cuda)
        self.linear_backend = resolve_linear_backend(self.linear_backend, self.attention_backend)
        if not on_cuda:
            self.enforce_eager = True  # CUDA graphs need CUDA
        self._resolve_pdl(on_cuda)
        if self.lora_side_stream is not None and not isinstance(self.lora_side_stream, bool):
            raise ValueError(f"{flag('lora_side_stream')} must be a boolean, got {self.lora_side_stream!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_loras", "max_lora_rank",
                     "cuda_graph_max_bs", "max_queue_len", "tensor_parallel_size", "dist_timeout"):
            v = getattr(self, name)
            if not _is_int(v) or v <= 0:
                raise ValueError(f"{flag(name)} must be a positive integer, got {v!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"{flag('load_format')} must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}")
        if not _is_int(self.prefill_delay_steps) or self.prefill_delay_steps < 0:
            raise ValueError(f"{flag('prefill_delay_steps')} must be a non-negative integer, got "
                             f"{self.prefill_delay_steps!r}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"{flag('block_size')} must be a power of two, got {self.block_size}")
        for name in ("max_model_len", "kv_cache_memory_bytes", "num_kv_blocks", "device_memory_bytes", "max_cpu_loras"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or v <= 0):
                raise ValueError(f"{flag(name)} must be a positive integer (or unset), got {v!r}")
        u = self.gpu_memory_utilization
        if not (isinstance(u, (int, float)) and not isinstance(u, bool) and 0.0 < u <= 1.0):
            raise ValueError(f"{flag('gpu_memory_utilization')} must be a number in (0, 1], got {u!r}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = max(self.max_loras, 16)
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"{flag('max_cpu_loras')} ({self.max_cpu_loras}) must be >= {flag('max_loras')} "
                             f"({self.max_loras})")
        if self.lora_modules and not self.enable_lora:
            logger.info("lora_modules (--lora-modules) given: enabling LoRA")
            self.enable_lora = True
        model_dir = self.model if self.model is not None and os.path.isdir(self.model) else None  # a missing
        # folder is reported by the engine; a quantization_config not implemented is refused here, before any load
        self.quantization = resolve_quantization(self.quantization, model_dir)
        if self.fp8_activations not in FP8_ACTIVATIONS:
            raise ValueError(f"{flag('fp8_activations')} must be one of {', '.join(FP8_ACTIVATIONS)}, got "
                             f"{self.fp8_activations!r}")
        if self.fp8_activations != "auto" and self.quantization != "fp8":
            raise ValueError(f"{flag('fp8_activations')} applies to FP8 base weights: set {flag('quantization')} "
                             "fp8 or serve a checkpoint whose quantization_config is fp8")
        if self.fp8_activations == "dynamic" and self.moe_backend == "torch" and self.enable_lora:
            raise ValueError(f"{flag('fp8_activations')} dynamic on the torch MoE backend takes no expert LoRA: use "
                             f"{flag('moe_backend')} triton (CUDA or the Triton interpreter) or leave it auto")
        self._resolve_kv_cache_dtype(on_cuda)
        if self.lora_dir is not None and not os.path.isdir(self.lora_dir):
            raise ValueError(f"{flag('lora_dir')} {self.lora_dir!r} is not a directory")
        if self.lora_modules:
            for name in self.lora_modules:
                validate_adapter_name(name)
        if self.lora_target_modules:  # None or empty: inferred from lora_modules
            bad = [t for t in self.lora_target_modules if t not in ALL_TARGETS]
            if bad:
                raise ValueError(f"{flag('lora_target_modules')}: unsupported {bad}; supported: "
                                 f"{', '.join(ALL_TARGETS)}")
        if not _is_int(self.data_parallel_size) or self.data_parallel_size <= 0:
            raise ValueError(f"{flag('data_parallel_size')} must be a positive integer, got "
                             f"{self.data_parallel_size!r}")
        if on_cuda and self.tensor_parallel_size > cuda_devices:
            raise ValueError(f"{flag('tensor_parallel_size')} {self.tensor_parallel_size} exceeds the "
                             f"{cuda_devices} visible CUDA devices")
        if self.cuda_graph_bs is not None:
            if not self.cuda_graph_bs or any(not _is_int(b) or b <= 0 for b in self.cuda_graph_bs):
                raise ValueError(f"{flag('cuda_graph_bs')} must be a list of positive integers, got "
                                 f"{self.cuda_graph_bs!r}")
        self._resolved = True
        return self

    def on_device(self, device: str) -> "EngineConfig":
        """This resolved config on another device of the same kind (a tensor-parallel rank's own GPU): a copy,
        resolved and checked already."""
        if not self._resolved:
            raise ValueError("on_device() needs a resolved config: call resolve() first")
        other = replace(self, device=device)
        other._resolved = True
        return other

    def exec_options(self) -> ExecOptions:
        """How the model executes on this config's device (backends, dtype, PDL), built once per engine (per rank)
        and handed to the model; the rules deriving one choice from another are in exec_options.py."""
        if not self._resolved:
            raise ValueError("exec_options() needs a resolved config: call resolve() first")
        import torch

        from moeserve.exec_options import ExecOptions
        from moeserve.models.quantization import weight_format

        weights, unquantized = weight_format(self.quantization, self.model, activations=self.fp8_activations)
        return ExecOptions(device=torch.device(self.device), dtype=self.torch_dtype,
                           attention_backend=self.attention_backend, moe_backend=self.moe_backend,
                           linear_backend=self.linear_backend, pdl=self.pdl,
                           lora_side_stream=self.lora_side_stream, weights=weights,
                           unquantized_modules=unquantized,
                           kv_cache_dtype=None if self.kv_cache_dtype == "auto" else torch.float8_e4m3fn)

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)

    @property
    def kv_cache_torch_dtype(self) -> torch.dtype:
        """The dtype the KV cache is stored in: `dtype` for "auto", float8_e4m3fn for fp8."""
        import torch

        return self.torch_dtype if self.kv_cache_dtype == "auto" else torch.float8_e4m3fn

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
