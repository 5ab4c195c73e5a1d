"""Decode throughput by LoRA mode: base, idle-single, idle-dual, active, mixed, eager.

Protocol (docs/benchmarks.md, "Decode"): random bf16 weights N(0, 0.02) in real shapes built on the GPU; B sequences
with a 512-token context already in the KV cache (prefill excluded); 128 timed decode steps, each the
engine's own pipelined step minus scheduling (EngineCore.step): batch construction and launch of step n+1
(graph replay or eager forward, logits, greedy pick, its input tokens taken from step n's on the device)
before the host reads step n's tokens, so the host's work overlaps the device's. `--sync-steps` times the
synchronous step instead: each step built, run, picked and read back before the next starts.
tokens/s = B * steps / time, median of repeats.
Roofline floor per step = bytes that must be read (attention + router + expected touched experts
+ lm_head + KV + LoRA bytes touched) / read bandwidth measured in the same run.

    python -m moeserve.bench.decode --preset qwen3-30b-a3b --batches 1,8,32,64,128,256,512
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch

from moeserve.bench import layer_profile
from moeserve.bench.common import bandwidths, graph_time_us
from moeserve.config import KV_CACHE_DTYPES, EngineConfig
from moeserve.lora.slot_pool import LoRASlotPool
from moeserve.models import loader
from moeserve.model_spec import ModelSpec
from moeserve.worker.graph_runner import LORA, NOLORA, CudaGraph, GraphRunner
from moeserve.worker.model_runner import InFlightStep, ModelRunner
from moeserve.worker.sequence import ScheduledBatch, Sequence, mark_launched
from moeserve.sampling_params import SamplingParams

PRESETS = {
    "qwen3-30b-a3b": dict(family="qwen3_moe", hidden_size=2048, num_layers=48, num_heads=32, num_kv_heads=4,
                          head_dim=128, num_experts=128, top_k=8, moe_intermediate_size=768,
                          intermediate_size=6144, norm_topk_prob=True, vocab_size=151936, qk_norm="head"),
    "olmoe-1b-7b": dict(family="olmoe", hidden_size=2048, num_layers=16, num_heads=16, num_kv_heads=16,
                        head_dim=128, num_experts=64, top_k=8, moe_intermediate_size=1024, intermediate_size=1024,
                        norm_topk_prob=False, vocab_size=50304, qk_norm="full"),
    "qwen1.5-moe-a2.7b": dict(family="qwen2_moe", hidden_size=2048, num_layers=24, num_heads=16, num_kv_heads=16,
                              head_dim=128, num_experts=60, top_k=4, moe_intermediate_size=1408,
                              intermediate_size=5632, shared_expert_intermediate_size=5632, norm_topk_prob=False,
                              vocab_size=151936, qkv_bias=True),
}
MODES = ("base", "idle-single", "idle-dual", "active", "mixed", "eager")
PROMPT, NUM_ADAPTERS, RANK = 512, 4, 16
WARMUP_STEPS = 3


def preset_spec(name: str, num_layers: int | None = None) -> ModelSpec:
    p = dict(PRESETS[name])
    if num_layers:
        p["num_layers"] = num_layers
    p["sparse_layers"] = tuple(True for _ in range(p["num_layers"]))
    return ModelSpec(max_position_embeddings=4096, **p)


def floor_bytes(spec: ModelSpec, B: int, ctx: int, lora_tokens: list[int], fp8: bool = False,
                kv_fp8: bool = False) -> float:
    """Bytes a decode step must read: weights touched + KV + LoRA touched (bf16; with `fp8` the attention, expert
    and shared-expert weights at one byte, their block scales 1/4,096 of that left out; with `kv_fp8` the KV cache
    at one byte per element)."""
    H, E, k, inter = spec.hidden_size, spec.num_experts, spec.top_k, spec.moe_intermediate_size
    attn = H * (spec.q_size + 2 * spec.kv_size) + spec.q_size * H
    touched = E * (1 - (1 - k / E) ** B)
    experts = touched * 3 * H * inter
    shared = 3 * H * spec.shared_expert_intermediate_size
    quantized = (attn + experts + shared) / (2 if fp8 else 1)  # in bf16 elements: halved bytes in FP8
    per_layer = quantized + E * H
    kv = B * ctx * 2 * spec.kv_size / (2 if kv_fp8 else 1)  # in bf16 elements, as above
    lora = 0.0
    for n in lora_tokens:  # tokens per active adapter
        lora += RANK * (3 * H + spec.q_size + 2 * spec.kv_size + spec.q_size + H)  # q/k/v/o A and B
        lora += E * (1 - (1 - k / E) ** n) * RANK * (H + 2 * inter + inter + H)
    return 2 * (spec.num_layers * (per_layer + kv + lora) + spec.vocab_size * H)


def timed_steps(runner, sb: ScheduledBatch, steps: int, warmup: int = WARMUP_STEPS) -> float:
    """Seconds for `steps` decode steps of batch `sb` through `runner` (a ModelRunner, or tensor parallelism's
    rank-0 runner) after `warmup` untimed ones, as the engine runs them (EngineCore.step without the scheduler):
    launch step n+1, its inputs from step n's tokens on the device, then read step n's tokens into the sequences.
    The last step's tokens are read inside the timed span."""
    def read_back(step: InFlightStep) -> None:
        for seq, token in runner.collect(step).sampled.items():
            seq.fill_pending(token)

    inflight = None
    for step in range(steps + warmup):
        if step == warmup:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        launched = runner.launch(sb)
        mark_launched(sb, launched.sampling_seqs)
        if inflight is not None:
            read_back(inflight)
        inflight = launched
    read_back(inflight)
    return time.perf_counter() - t0


def held_bytes(model: torch.nn.Module) -> int:
    """Bytes of the storages behind a model's parameters and buffers (weights, scales), each storage once."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in (*model.parameters(), *model.buffers())}
    return sum(storages.values())


class DecodeBench:
    def __init__(self, spec: ModelSpec, max_bs: int, steps: int, device="cuda", dtype=torch.bfloat16,
                 backend: str = "triton", graph_factory=CudaGraph, linear_backend: str | None = None,
                 pdl: bool | None = None, quantization: str | None = None, fp8_activations: str = "auto",
                 kv_cache_dtype: str = "auto", block_size: int = 16, lora_side_stream: bool | None = None):
        self.spec, self.steps, self.device = spec, steps, torch.device(device)
        self.dtype, self.graph_factory = dtype, graph_factory
        self.max_len = PROMPT + steps + 16
        self.cfg = EngineConfig(model="random", device=device, dtype=str(dtype).split(".")[-1],
                                max_model_len=self.max_len, max_num_seqs=max_bs, block_size=block_size,
                                moe_backend=backend, attention_backend=backend,
                                linear_backend=linear_backend or backend, pdl=pdl,
                                quantization=quantization, fp8_activations=fp8_activations,
                                kv_cache_dtype=kv_cache_dtype, lora_side_stream=lora_side_stream).resolve()
        self.model = loader.random_model(spec, self.cfg.exec_options())
        self.weight_bytes = held_bytes(self.model)
        self.runner = ModelRunner(self.cfg, spec, None, model=self.model)
        self.block_size = block_size
        blocks = max_bs * -(-self.max_len // block_size) + 2
        self.runner.allocate_kv_cache(blocks)
        for k_cache, v_cache in self.runner.kv_caches:  # prompt context: random K/V (prefill excluded)
            for cache in (k_cache, v_cache):
                if cache.dtype == torch.float8_e4m3fn:  # normal_ has no fp8 kernel: drawn in float32, then cast
                    cache.copy_(torch.randn(cache.shape, device=cache.device))
                else:
                    cache.normal_()
        self.pool = None

    def attach_lora_pool(self) -> None:
        targets = {"q_proj", "k_proj", "v_proj", "o_proj", "experts"}
        self.pool = LoRASlotPool(self.spec, self.model, NUM_ADAPTERS, RANK, targets, self.device, self.dtype)
        g = torch.Generator(device=self.device).manual_seed(1)
        with torch.no_grad():  # 4 random rank-16 adapters straight into the slots
            for layer in self.model.layers:
                bufs = [layer.self_attn.qkv_proj.lora_a, layer.self_attn.qkv_proj.lora_b,
                        layer.self_attn.o_proj.lora_a, layer.self_attn.o_proj.lora_b]
                b = layer.mlp.lora_bufs
                bufs += [b.gate_up_a, b.gate_up_b, b.down_a, b.down_b]
                for t in bufs:
                    t.normal_(0.0, 0.02, generator=g)
        self.pool.slot_ranks.fill_(RANK)
        self.runner.lora_pool = self.pool

    def sequences(self, B: int, slots: list[int]) -> list[Sequence]:
        seqs, bs = [], self.block_size
        for i in range(B):
            s = Sequence(f"b{i}", [1] * PROMPT, SamplingParams(max_tokens=self.steps + 8, temperature=0.0))
            s.block_table = [1 + i * -(-self.max_len // bs) + j for j in range(-(-self.max_len // bs))]
            s.num_computed_tokens = PROMPT - 1
            s.lora_slot = slots[i]
            seqs.append(s)
        return seqs

    def graphs(self, sizes: list[int], variants: list[str]) -> GraphRunner:
        gr = GraphRunner(self.model, sizes, variants, self.runner.max_blocks_per_seq, self.device,
                         self.pool.slot_ranks if self.pool is not None else None,
                         graph_factory=self.graph_factory,
                         pool=torch.cuda.graph_pool_handle() if self.graph_factory is CudaGraph else None)
        gr.capture_all()
        return gr

    @torch.inference_mode()
    def time_decode(self, B: int, slots: list[int], graph_runner: GraphRunner | None, repeats: int,
                    sync_steps: bool = False) -> float:
        """Median seconds for `steps` decode steps."""
        self.runner.graph_runner = graph_runner
        return statistics.median(self.run_steps(self.sequences(B, slots), sync_steps) for _ in range(repeats))

    @torch.inference_mode()
    def run_steps(self, seqs: list[Sequence], sync_steps: bool = False) -> float:
        """Seconds for `steps` decode steps of `seqs` after 3 warm-up steps; each step's tokens land in the
        sequences' output_token_ids. The step is the engine's pipelined one (timed_steps).
        `sync_steps`: each step built, run, picked and read back before the next starts."""
        sb = ScheduledBatch(seqs, [1] * len(seqs), is_decode=True)
        if not sync_steps:
            return timed_steps(self.runner, sb, self.steps)
        for step in range(self.steps + WARMUP_STEPS):
            if step == WARMUP_STEPS:
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
            self._sync_step(sb)
        return time.perf_counter() - t0

    def _sync_step(self, sb: ScheduledBatch) -> None:
        graph_runner = self.runner.graph_runner
        graphed = graph_runner is not None and graph_runner.can_run(sb)
        batch = self.runner.prepare(sb, on_host=graphed)
        hidden = graph_runner.run(sb, batch) if graphed else self.model(batch)
        tokens = self.model.compute_logits(hidden).argmax(dim=-1).tolist()
        for s, t in zip(sb.seqs, tokens):
            s.output_token_ids.append(t)
            s.num_computed_tokens += 1

    @torch.inference_mode()
    def layer_budget(self, B: int, bandwidth: float, timer=graph_time_us, mode: str = "base") -> list[dict]:
        """Per-region kernel budget of one decode layer at batch B (see layer_profile), its rows on adapters as in
        `mode` (slots_for; the pool attached first). A region's bytes are the base model's either way: with
        adapters its time over them shows what the adapters cost there."""
        seqs = self.sequences(B, slots_for(mode, B))
        batch = self.runner.prepare(ScheduledBatch(seqs, [1] * B, is_decode=True))
        # a distinct token per row: identical rows would all route to the same top-k experts in the timed layer
        ids = (torch.arange(B, device=batch.input_ids.device) * 7919 + 1) % self.model.embed_tokens.shape[0]
        x = torch.nn.functional.embedding(ids, self.model.embed_tokens)
        rows = layer_profile.layer_budget(self.model, self.runner.kv_caches, batch, x, PROMPT, bandwidth, timer)
        layer_profile.print_budget(B, rows, "" if mode == "base" else f", {mode} (4 rank-16 adapters)")
        return rows


def slots_for(mode: str, B: int) -> list[int]:
    if mode == "active":
        return [i % NUM_ADAPTERS for i in range(B)]
    if mode == "mixed":
        return [(i // 2) % NUM_ADAPTERS if i % 2 == 0 else -1 for i in range(B)]
    return [-1] * B


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="moeserve bench decode", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3-30b-a3b", choices=sorted(PRESETS))
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the preset (memory)")
    ap.add_argument("--batches", default="1,8,32,64,128,256,512")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--linear-backend", default="triton", choices=("torch", "triton"),
                    help="dense projections: triton = the Triton GEMV at <= 8 rows (default), torch = cuBLAS")
    ap.add_argument("--pdl", action=argparse.BooleanOptionalAction, default=None,
                    help="Triton kernels with programmatic dependent launch (default: the engine's, on for Hopper)")
    ap.add_argument("--quantization", default=None, choices=("fp8",),
                    help="base weights in block-wise FP8 (drawn, then quantized; LoRA stays bf16)")
    ap.add_argument("--fp8-activations", default="auto", choices=("auto", "dynamic", "none"),
                    help="with --quantization fp8: the engine flag of that name (auto: W8A8 GEMMs, weight-only GEMVs)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                    help="the engine flag of that name: fp8 stores K and V in float8_e4m3fn (scales 1.0)")
    ap.add_argument("--lora-side-stream", action=argparse.BooleanOptionalAction, default=None,
                    help="the engine flag of that name: a GEMM projection's LoRA shrink beside its GEMM (default: "
                         "beside the FP8 GEMM only)")
    ap.add_argument("--block-size", type=int, default=16,
                    help="the engine flag of that name: tokens per KV cache block (a power of two)")
    ap.add_argument("--sync-steps", action="store_true",
                    help="time the synchronous step (batch built, graph run, tokens picked and read back before the "
                         "next step starts) instead of the engine's pipelined one")
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--profile", action="store_true",
                    help="also print each batch size's per-layer kernel budget (time, bytes, share of the floor, "
                         "kernel count per region of a layer)")
    ap.add_argument("--profile-modes", default="base",
                    help="with --profile: the modes whose budgets to print (base, active, mixed: the regions with "
                         "the rows on adapters as the timed mode of that name puts them)")
    args = ap.parse_args(argv)
    profile_modes = [m for m in args.profile_modes.split(",") if m]
    if bad := [m for m in profile_modes if m not in ("base", "active", "mixed")]:
        ap.error(f"--profile-modes {','.join(bad)}: the budget takes base, active or mixed")
    if not torch.cuda.is_available():
        raise SystemExit("bench decode needs a CUDA device")
    batches = [int(b) for b in args.batches.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    spec = preset_spec(args.preset, args.layers)
    bench = DecodeBench(spec, max(batches), args.steps, linear_backend=args.linear_backend, pdl=args.pdl,
                        quantization=args.quantization, fp8_activations=args.fp8_activations,
                        kv_cache_dtype=args.kv_cache_dtype, block_size=args.block_size,
                        lora_side_stream=args.lora_side_stream)
    bw = bandwidths()[1]  # read-only ceiling, measured in this run
    print(f"preset {args.preset}: {spec.num_layers} layers, read bandwidth {bw / 1e12:.2f} TB/s, "
          f"weights {bench.weight_bytes / 2**30:.2f} GiB", flush=True)
    results: dict[str, dict[int, float]] = {m: {} for m in modes}
    capture: dict[str, dict] = {}
    plan = {  # mode -> (needs LoRA pool, graph variants or None for eager)
        "base": (False, [NOLORA]), "idle-single": (True, [LORA]), "idle-dual": (True, [LORA, NOLORA]),
        "active": (True, [LORA, NOLORA]), "mixed": (True, [LORA, NOLORA]), "eager": (True, None),
    }
    dual_runner = None
    for mode in modes:
        needs_pool, variants = plan[mode]
        if needs_pool and bench.pool is None:
            bench.attach_lora_pool()
        if variants is None:
            gr = None
        elif variants == [LORA, NOLORA] and dual_runner is not None:
            gr = dual_runner  # idle-dual, active and mixed share one set of dual graphs
        else:
            gr = bench.graphs(batches, variants)
            capture[mode] = gr.capture_report()
            if variants == [LORA, NOLORA]:
                dual_runner = gr
        for B in batches:
            t = bench.time_decode(B, slots_for(mode, B), gr, args.repeats, sync_steps=args.sync_steps)
            results[mode][B] = t
            print(f"  {mode:12s} B={B:4d}  {B * args.steps / t:10.1f} tok/s  {t / args.steps * 1e3:7.2f} ms/step",
                  flush=True)
        if gr is not None and gr is not dual_runner:
            del gr
            gc.collect()
            torch.cuda.empty_cache()

    # after the timed modes: the profiler the budget uses can slow what runs after it
    budgets: dict = {}  # {B: rows} of the base model, and {"<mode>": {B: rows}} of each other profile mode
    for mode in profile_modes if args.profile else []:
        if mode != "base" and bench.pool is None:
            bench.attach_lora_pool()
        rows_of = {B: bench.layer_budget(B, bw, mode=mode) for B in batches}
        if mode == "base":
            budgets.update(rows_of)
        else:
            budgets[mode] = rows_of
    rows = []
    for B in batches:
        row = {"batch": B}
        for mode in modes:
            step = results[mode][B] / args.steps
            slots = slots_for(mode, B)
            per_adapter = [sum(1 for s in slots if s == a) for a in range(NUM_ADAPTERS)]
            fb = floor_bytes(spec, B, PROMPT + args.steps // 2, [n for n in per_adapter if n],
                             fp8=args.quantization == "fp8", kv_fp8=bench.cfg.kv_cache_dtype != "auto")
            row[mode] = {"tok_s": B / step, "step_ms": step * 1e3, "efficiency": fb / bw / step}
        rows.append(row)
    ratios = {"idle-dual/base": ("idle-dual", "base"), "idle-dual/idle-single": ("idle-dual", "idle-single"),
              "active/base": ("active", "base"), "mixed/base": ("mixed", "base")}
    for row in rows:
        row["ratios"] = {name: row[a]["tok_s"] / row[b]["tok_s"] for name, (a, b) in ratios.items()
                         if a in row and b in row}

    timed_step = "sync" if args.sync_steps else "pipelined"
    print(f"\nDecode tokens/s ({args.preset}, {spec.num_layers} layers, {args.steps} {timed_step} steps, "
          f"context {PROMPT}, read BW {bw / 1e12:.2f} TB/s, PDL {'on' if bench.cfg.pdl else 'off'}, "
          f"KV cache {bench.cfg.kv_cache_dtype}; eff = roofline floor / step)")
    head = f"{'B':>5} " + " ".join(f"{m:>20s}" for m in modes) + " " + " ".join(f"{r:>22s}" for r in ratios)
    print(head)
    for row in rows:
        cells = [f"{row[m]['tok_s']:9.0f} {row[m]['step_ms']:5.2f}ms {row[m]['efficiency']:3.0%}" for m in modes]
        rats = [f"{row['ratios'][r]:22.3f}" if r in row["ratios"] else f"{'-':>22s}" for r in ratios]
        print(f"{row['batch']:>5} " + " ".join(f"{c:>20s}" for c in cells) + " " + " ".join(rats))
    for mode, rep in capture.items():
        print(f"capture {mode}: " + ", ".join(f"{v}: {rep['capture_seconds'][v]:.1f} s, "
                                              f"{rep['pool_bytes'][v] / 2**20:.0f} MiB" for v in rep["variants"]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    payload = {"quantization": args.quantization, "fp8_activations": args.fp8_activations,
               "kv_cache_dtype": bench.cfg.kv_cache_dtype,
               "preset": args.preset, "layers": spec.num_layers, "steps": args.steps, "context": PROMPT,
               "read_bandwidth": bw, "gpu": torch.cuda.get_device_name(), "rows": rows, "capture": capture,
               "layer_budget": budgets, "pdl": bench.cfg.pdl, "linear_backend": bench.cfg.linear_backend,
               "timed_step": timed_step, "weight_bytes": bench.weight_bytes,
               "date": time.strftime("%Y-%m-%d")}
    (out / f"decode_{args.preset}.json").write_text(json.dumps(payload, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for mode in modes:
            ax.plot(batches, [results[mode][B] and B * args.steps / results[mode][B] for B in batches], marker="o",
                    label=mode)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"moeserve decode, {args.preset} ({spec.num_layers} layers)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / f"decode_{args.preset}.png", dpi=120)
    except ImportError:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
