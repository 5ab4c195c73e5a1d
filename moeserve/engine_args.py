"""Command-line flags for every EngineConfig field (vLLM spelling), shared by serve/generate/demo."""
from __future__ import annotations

import argparse
import re
from dataclasses import MISSING, fields

from moeserve.config import BACKENDS, DTYPES, FP8_ACTIVATIONS, KV_CACHE_DTYPES, LOAD_FORMATS, EngineConfig
from moeserve.errors import LoRAAdapterError
from moeserve.lora.names import validate_adapter_name

_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
               "kib": 2**10, "mib": 2**20, "gib": 2**30}


def _default(name: str):
    f = next(f for f in fields(EngineConfig) if f.name == name)
    return f.default_factory() if f.default is MISSING else f.default


def parse_bytes(text: str) -> int:
    """'4GiB', '512MB', '1e9' or a plain integer -> bytes."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 4GiB, 512MB, 1000000)")
    try:
        return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}") from None


def parse_lora_module(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(
            f"expected NAME=PATH, got {text!r} (--lora-modules takes every NAME=PATH that follows it; put other "
            "arguments after '--', or write --lora-modules=NAME=PATH)")
    try:
        validate_adapter_name(name)
    except LoRAAdapterError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return name, path


def split_lora_modules_argv(argv: list[str]) -> list[str]:
    """Rewrite `--lora-modules a=/p b=/q` as `--lora-modules=a=/p --lora-modules=b=/q`, so that the list ends at
    the first argument that is not NAME=PATH: `generate --lora-modules a=/p "a prompt"` then keeps its prompt.
    The flag keeps vLLM's `nargs="+"` spelling (argparse alone would swallow the prompt as a module).
    Stops at `--`: what follows it is positional."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return out + argv[i:]
        if arg != "--lora-modules":
            out.append(arg)
            i += 1
            continue
        i += 1
        values = 0
        while i < len(argv) and not argv[i].startswith("-") and "=" in argv[i]:
            out.append(f"--lora-modules={argv[i]}")
            values += 1
            i += 1
        if not values:  # let argparse report the missing value
            out.append(arg)
    return out


def add_engine_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add one flag per EngineConfig field; dest is always the field name."""
    g = parser.add_argument_group("model")
    g.add_argument("--model", default=None,
                   help="HF model folder (config.json + safetensors); omitted: the embedded demo model")
    g.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model folder)")
    g.add_argument("--device", default=_default("device"), help="auto | cpu | cuda | cuda:N (default: auto)")
    g.add_argument("--dtype", default=_default("dtype"), choices=("auto", *DTYPES),
                   help="weight/activation dtype; auto = bfloat16 on CUDA, float32 on CPU")
    g.add_argument("--load-format", default=_default("load_format"), choices=LOAD_FORMATS,
                   help="auto/safetensors: the checkpoint's weights; dummy: random weights from config.json "
                        "alone (benchmarks without the checkpoint on disk)")
    g.add_argument("--quantization", "-q", default=None, choices=("fp8",),
                   help="base weights in block-wise FP8 (float8_e4m3fn, one scale per 128 x 128 block): a plain "
                        "checkpoint is quantized at load (with --load-format dummy too); unset: what the "
                        "checkpoint declares (an fp8 quantization_config serves FP8). LoRA stays in --dtype")
    g.add_argument("--fp8-activations", default=_default("fp8_activations"), choices=FP8_ACTIVATIONS,
                   help="FP8 products: auto quantizes activations per token-group of 128 (W8A8) where a call is a "
                        "GEMM, not in decode GEMVs; dynamic always; none never "
                        "(weight-only, exact against the dequantized weights, slower)")
    g.add_argument("--seed", type=int, default=_default("seed"),
                   help="seed of the sampler for requests that give no seed of their own")

    g = parser.add_argument_group("memory and batching")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output in tokens (default: min(max_position_embeddings, 4096))")
    g.add_argument("--max-num-seqs", type=int, default=_default("max_num_seqs"),
                   help="most sequences running at once (default: %(default)s)")
    g.add_argument("--max-num-batched-tokens", type=int, default=_default("max_num_batched_tokens"),
                   help="token budget of one step; longer prompts are prefilled in chunks (default: %(default)s)")
    g.add_argument("--prefill-delay-steps", type=int, default=_default("prefill_delay_steps"),
                   help="decode steps that waiting prompts may wait to be prefilled together, unless they fill "
                        "half the token budget first: each prefill step reads every weight once (default: "
                        "%(default)s; 0 = prefill at once)")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=_default("enable_chunked_prefill"),
                   help="split long prompts across steps (default: on)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=_default("enable_prefix_caching"),
                   help="reuse the KV blocks of prompt prefixes computed before, keyed by adapter version "
                        "(default: on)")
    g.add_argument("--block-size", type=int, default=_default("block_size"),
                   help="tokens per KV-cache block, a power of two (default: %(default)s)")
    g.add_argument("--kv-cache-dtype", default=_default("kv_cache_dtype"), choices=KV_CACHE_DTYPES,
                   help="how K and V are stored: auto = --dtype; fp8 (= fp8_e4m3): float8_e4m3fn divided by a "
                        "per-layer scale (the checkpoint's self_attn.k_scale / v_scale, else 1.0), one byte per "
                        "element: twice the blocks in the same memory, half the bytes read by decode attention")
    g.add_argument("--gpu-memory-utilization", type=float, default=_default("gpu_memory_utilization"),
                   help="fraction of free GPU memory given to the KV cache (default: %(default)s)")
    g.add_argument("--kv-cache-memory-bytes", type=parse_bytes, default=None,
                   help="explicit KV-cache budget, e.g. 8GiB; overrides --gpu-memory-utilization")
    g.add_argument("--num-kv-blocks", type=int, default=None,
                   help="explicit number of KV-cache blocks; overrides both memory flags")
    g.add_argument("--device-memory-bytes", type=parse_bytes, default=None,
                   help="device memory the engine may use in all, e.g. 40GiB (default: what the device reports free "
                        "at start); start-up refuses when the weights, the LoRA pool and one --max-model-len "
                        "sequence of KV cache do not fit")
    g.add_argument("--max-queue-len", type=int, default=_default("max_queue_len"),
                   help="waiting requests beyond this are refused with HTTP 503 (default: %(default)s)")

    g = parser.add_argument_group("backends")
    g.add_argument("--moe-backend", default=_default("moe_backend"), choices=BACKENDS,
                   help="routed-expert kernels; auto = triton on CUDA, torch on CPU")
    g.add_argument("--attention-backend", default=_default("attention_backend"), choices=BACKENDS,
                   help="attention kernels; auto = triton on CUDA, torch on CPU")
    g.add_argument("--linear-backend", default=_default("linear_backend"), choices=BACKENDS,
                   help="dense projections (q/k/v/o, dense MLP, shared expert, lm_head): triton = a Triton GEMV "
                        "where it beats cuBLAS (one row, or two when in > out; the dense LoRA expand fused in), cuBLAS "
                        "elsewhere; torch = cuBLAS always; auto = the attention backend's choice")

    g = parser.add_argument_group("LoRA")
    g.add_argument("--enable-lora", action="store_true", default=_default("enable_lora"),
                   help="serve LoRA adapters (implied by --lora-modules)")
    g.add_argument("--max-loras", type=int, default=_default("max_loras"),
                   help="adapters resident on the device at once (default: %(default)s)")
    g.add_argument("--max-lora-rank", type=int, default=_default("max_lora_rank"),
                   help="largest adapter rank accepted (default: %(default)s)")
    g.add_argument("--lora-separate-gate-up", action=argparse.BooleanOptionalAction,
                   default=_default("lora_separate_gate_up"),
                   help="hold an up A next to each routed expert's gate_up A, so that adapters with separate "
                        "gate_proj and up_proj LoRAs of rank r cost rank r (without it they are stacked into one "
                        "LoRA of rank 2r); costs one more hidden-size row per rank in every expert slot (default: "
                        "on when a --lora-modules adapter has separate gate and up LoRAs)")
    g.add_argument("--max-cpu-loras", type=int, default=None,
                   help="parsed adapters kept in host memory (default: max(max_loras, 16))")
    g.add_argument("--lora-modules", nargs="+", action="extend", type=parse_lora_module, default=None,
                   metavar="NAME=PATH",
                   help="adapters loaded at start, each served under NAME (the list ends at the first argument that "
                        "is not NAME=PATH, or at '--')")
    g.add_argument("--enable-lora-runtime-loading", action="store_true",
                   default=_default("enable_lora_runtime_loading"),
                   help="answer /v1/load_lora_adapter and /v1/unload_lora_adapter (off by default: loading parses "
                        "files the client names; see --lora-dir)")
    g.add_argument("--lora-dir", default=None, metavar="DIR",
                   help="runtime loads may only read adapters inside DIR (symlinks resolved); a load request may "
                        "then give just lora_name, read from DIR/<lora_name>")
    g.add_argument("--lora-target-modules", nargs="+", default=None, metavar="MODULE",
                   help="modules that may carry LoRA, each with device buffers for --max-loras adapters at "
                        "--max-lora-rank: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj (dense layers) "
                        "shared_expert shared_expert_gate experts router (default: those the --lora-modules adapters "
                        "use; without --lora-modules, all)")

    g = parser.add_argument_group("parallelism")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=_default("tensor_parallel_size"),
                   help="ranks (GPUs) the model is split across, one process each (default: %(default)s)")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=_default("data_parallel_size"),
                   help="engine cores behind one server, each a whole copy of the model on its own GPUs (core i: "
                        "GPUs i*TP to i*TP+TP-1 of those visible); requests go to the least busy core (`serve` only; "
                        "default: %(default)s)")
    g.add_argument("--enable-expert-parallel", action="store_true", default=_default("enable_expert_parallel"),
                   help="split routed experts whole across the --tensor-parallel-size ranks (E / N each) instead "
                        "of slicing every expert")
    g.add_argument("--dist-timeout", type=int, default=_default("dist_timeout"),
                   help="seconds a collective waits for a rank before the engine stops with an error naming it "
                        "(default: %(default)s)")
    g.add_argument("--disable-custom-all-reduce", action="store_true", default=_default("disable_custom_all_reduce"),
                   help="all-reduce activations through NCCL only (default: on CUDA they go through a symmetric-memory "
                        "buffer, torch's one-shot / two-shot kernels, where every rank can set one up; NCCL otherwise "
                        "and for messages larger than the buffer)")

    g = parser.add_argument_group("CUDA graphs")
    g.add_argument("--enforce-eager", "--disable-cuda-graph", dest="enforce_eager", action="store_true",
                   default=_default("enforce_eager"), help="run every step eagerly, capture no CUDA graphs")
    g.add_argument("--cuda-graph-max-bs", type=int, default=_default("cuda_graph_max_bs"),
                   help="largest decode batch replayed from a graph (default: %(default)s)")
    g.add_argument("--cuda-graph-bs", type=int, nargs="+", default=None, metavar="BS",
                   help="explicit decode batch-size buckets to capture, e.g. 1 2 4 8 16")
    g.add_argument("--record-nolora-graph", action=argparse.BooleanOptionalAction,
                   default=_default("record_nolora_graph"),
                   help="with LoRA on, also capture a graph with no LoRA work per batch size, replayed for "
                        "batches without adapters (default: on where it takes effect: CUDA graphs with the triton "
                        "MoE backend)")
    g.add_argument("--pdl", action=argparse.BooleanOptionalAction, default=_default("pdl"),
                   help="launch the Triton kernels with programmatic dependent launch, so each one starts while the "
                        "previous one drains (default: on where the GPU has it, compute capability 9.0+)")
    g.add_argument("--lora-side-stream", action=argparse.BooleanOptionalAction, default=_default("lora_side_stream"),
                   help="on CUDA, run the LoRA shrink of a projection a GEMM computes (batch 3 and up, prefill) "
                        "beside that GEMM on a stream of its own (default: beside the FP8 GEMM only; "
                        "--lora-side-stream: beside bf16 cuBLAS too; the results are the same bits every way)")
    g.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=_default("warmup"),
                   help="on CUDA, compile and run every prefill kernel variant at start-up, with and without LoRA, "
                        "so no request waits for a compile (default: on; --no-warmup starts faster)")
    return parser


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    kwargs = {name: getattr(args, name) for name in EngineConfig.field_names() if hasattr(args, name)}
    kwargs["lora_modules"] = dict(kwargs.get("lora_modules") or [])
    return EngineConfig(**kwargs)
