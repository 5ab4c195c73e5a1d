"""Prefill throughput on the engine's own path, and where a prefill forward's time goes.

Protocol (docs/benchmarks.md, "Prefill"): `--load-format dummy` at a preset's shape, prefix caching off;
`Engine.generate` of 256 fresh prompts of 256 random tokens with max_tokens=1 (every prompt token computed once,
one sampled token each); tokens/s = prompt tokens / wall time, median of repeats, after one untimed run. The
compute floor is 2 x active parameters per token (attention projections, router, top-k experts, shared expert;
no lm_head, no attention scores) over the dense bf16 peak (790 TFLOP/s measured on the H200). `--lora`: the same
with every prompt on one of 4 rank-16 adapters (attention and every routed expert), reported beside the base.

The budget (`--profile`): one eager forward of T tokens (2,048 and 8,192 by default), its kernels timed by the
torch profiler and summed by region (attention, dense GEMMs, router, experts, dense LoRA, expert LoRA shrinks,
norms, other).

    python -m moeserve.bench.prefill --preset qwen3-30b-a3b [--layers 48] [--lora] [--profile] [--out bench_out/]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

PEAK_TFLOPS = 790.0  # dense bf16 matmul peak measured on the H200
REGIONS = (  # (region, substrings of kernel names), first match wins
    ("dense LoRA", ("_dense_lora",)),  # its slot grouping, one alignment launch a forward, counts under experts
    ("experts", ("_moe_", "_align_", "_silu_mul", "_topk_sum", "_gemv_gate_up", "_gemv_down")),
    ("expert LoRA", ("lora",)),  # the expert LoRA's shrinks (its expands ride in the expert GEMMs)
    ("router", ("topk", "router", "_route")),
    ("attention", ("attn", "attention", "flash", "paged", "_prefill_kernel", "_decode_split", "_decode_merge")),
    ("norm/rotary", ("norm", "rotary", "rope")),
    ("dense GEMM", ("gemm", "gemv", "cutlass", "sm90", "xmma", "cublas", "nvjet")),
)


def active_params(spec) -> float:
    """Weights each token multiplies through (all layers; embeddings and lm_head excluded)."""
    H = spec.hidden_size
    attn = H * (spec.q_size + 2 * spec.kv_size) + spec.q_size * H
    experts = spec.top_k * 3 * H * spec.moe_intermediate_size + spec.num_experts * H
    shared = 3 * H * spec.shared_expert_intermediate_size
    return spec.num_layers * (attn + experts + shared)


def region_of(name: str) -> str:
    low = name.lower()
    for region, keys in REGIONS:
        if any(k in low for k in keys):
            return region
    return "other"


def profile_forward(engine, num_tokens: int, lora: bool) -> dict[str, float]:
    """µs per region of one eager prefill forward of `num_tokens` tokens (16 prompts)."""
    from torch.profiler import ProfilerActivity, profile

    from moeserve.engine.warmup import warmup_batches

    slot = 0 if lora else -1
    batch = [b for b in warmup_batches([num_tokens], [slot], engine.config.block_size) if len(b.seqs) == 16][0]
    runner = engine.runner
    runner.collect(runner.launch(batch))  # compiled and warm
    torch.cuda.synchronize()
    regions: dict[str, float] = {}
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            runner.collect(runner.launch(batch))
            torch.cuda.synchronize()
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset")):
                regions[region_of(e.name)] = regions.get(region_of(e.name), 0.0) + e.time_range.elapsed_us()
    except Exception as exc:  # a profiler not built for this device: the throughput table stands alone
        print(f"profile at {num_tokens} tokens failed: {exc!r}")
    runner.prev_tokens = None
    return regions


def run_prompts(engine, prompts, loras) -> float:
    from moeserve import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine.generate(prompts, params, lora=loras)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="moeserve bench prefill", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--lora", action="store_true", help="also every prompt on one of 4 rank-16 adapters")
    ap.add_argument("--profile", action="store_true", help="per-region budget of one forward at --profile-tokens")
    ap.add_argument("--profile-tokens", default="2048,8192")
    ap.add_argument("--quantization", default=None, choices=("fp8",),
                    help="base weights in block-wise FP8 (drawn, then quantized; LoRA stays bf16)")
    ap.add_argument("--out", default="bench_out/")
    ap.add_argument("--tag", default="", help="a label for this tree in the JSON and the table")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench prefill needs a CUDA device")
        return 1
    from moeserve import Engine, EngineConfig
    from moeserve.bench.protocol import NUM_ADAPTERS, write_adapter, write_model_config
    from moeserve.model_spec import ModelSpec

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = write_model_config(args.preset, out / "prefill_model", args.layers)
    spec = ModelSpec.from_model_dir(model)
    # no decode graphs: every step here is a prefill (eager), and capturing them would only slow the start
    kw = dict(model=str(model), load_format="dummy", enable_prefix_caching=False, max_num_seqs=args.num_prompts,
              max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=max(1024, args.input_len + 8),
              enforce_eager=True, quantization=args.quantization)
    names = []
    if args.lora:
        adapters = {f"ad{i}": str(write_adapter(model, out / "prefill_adapters" / f"ad{i}", seed=i + 1))
                    for i in range(NUM_ADAPTERS)}
        names = list(adapters)
        kw.update(enable_lora=True, max_loras=NUM_ADAPTERS, max_lora_rank=16, lora_modules=adapters)
    t0 = time.perf_counter()
    engine = Engine(EngineConfig(**kw))
    start_s = time.perf_counter() - t0
    rng = random.Random(0)
    floor = 2 * active_params(spec) / (PEAK_TFLOPS * 1e12)  # s per token at the peak
    modes = ["base"] + (["lora"] if args.lora else [])
    result = {"tag": args.tag, "preset": args.preset, "layers": spec.num_layers, "gpu": torch.cuda.get_device_name(),
              "start_s": start_s, "floor_tok_s": 1 / floor, "modes": {}, "profile": {}}
    times = {m: [] for m in modes}
    for rep in range(args.repeats + 1):  # the first round is untimed (allocator, cuBLAS heuristics)
        for mode in modes:
            prompts = [[rng.randrange(1000, spec.vocab_size - 1) for _ in range(args.input_len)]
                       for _ in range(args.num_prompts)]
            loras = [names[i % len(names)] for i in range(len(prompts))] if mode == "lora" else None
            dt = run_prompts(engine, prompts, loras)
            if rep:
                times[mode].append(dt)
    tokens = args.num_prompts * args.input_len
    for mode in modes:
        tok_s = tokens / statistics.median(times[mode])
        result["modes"][mode] = {"tok_s": tok_s, "of_floor": tok_s * floor, "times_s": times[mode]}
    if args.profile:
        for t in map(int, args.profile_tokens.split(",")):
            for mode in modes:
                result["profile"][f"{mode}@{t}"] = profile_forward(engine, t, mode == "lora")
    (out / f"prefill{('_' + args.tag) if args.tag else ''}.json").write_text(json.dumps(result, indent=1))
    print(f"\n{args.preset} ({spec.num_layers} layers) on {result['gpu']}, {args.num_prompts} prompts x "
          f"{args.input_len} tokens, max_tokens=1, prefix cache off; engine start {start_s:.0f} s {args.tag}")
    print(f"compute floor {1 / floor:,.0f} tok/s (2 x {active_params(spec) / 1e9:.2f} G active parameters at "
          f"{PEAK_TFLOPS:.0f} TFLOP/s)")
    for mode, r in result["modes"].items():
        ratio = f", {r['tok_s'] / result['modes']['base']['tok_s']:.3f} of base" if mode != "base" else ""
        print(f"  {mode:5s}: {r['tok_s']:>9,.0f} tok/s = {r['of_floor']:.3f} of the floor{ratio}")
    for key, regions in result["profile"].items():
        total = sum(regions.values()) or 1.0
        parts = ", ".join(f"{k} {v / 1e3:.2f} ms ({v / total:.0%})" for k, v in sorted(regions.items(),
                                                                                   key=lambda kv: -kv[1]))
        print(f"  forward {key}: {total / 1e3:.2f} ms: {parts}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
