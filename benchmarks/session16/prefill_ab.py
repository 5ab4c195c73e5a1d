"""Prefill with every prompt on an adapter, the MoE LoRA in place at every size against apart above 4,096 pairs (the
thresholds of session 15), in one engine, interleaved rounds (base, in place, apart, ...), on `bench prefill`'s
protocol (256 prompts x 256 tokens, max_num_batched_tokens 8,192, so most MoE calls see 8,192 tokens). Call 3's
kernel bench (random slots per token) had the in-place epilogue ahead on the tuned 128-row tiles at T = 1,024-8,192;
real prompts sit on one adapter each, which a kernel bench does not show.

    PYTHONPATH=. python benchmarks/session16/prefill_ab.py --layers 48 --out DIR [--quantization fp8]

Ran in call 4 on commit 006365d (its thresholds moe_plan.LORA_APART_MIN_PAIRS and
fused_moe_fp8.FP8_LORA_IN_PLACE_MAX_PAIRS left the tree after, when in place won): the script needs that commit.
"""
import argparse
import json
import random
import statistics
import time
from pathlib import Path

from moeserve import Engine, EngineConfig
from moeserve.bench.prefill import PEAK_TFLOPS, active_params, run_prompts
from moeserve.bench.protocol import NUM_ADAPTERS, write_adapter, write_model_config
from moeserve.kernels import fused_moe_fp8, moe_plan
from moeserve.model_spec import ModelSpec

APART_FROM, FP8_IN_PLACE_TO = moe_plan.LORA_APART_MIN_PAIRS, fused_moe_fp8.FP8_LORA_IN_PLACE_MAX_PAIRS


def set_in_place_everywhere(on: bool) -> None:
    moe_plan.LORA_APART_MIN_PAIRS = 1 << 40 if on else APART_FROM
    fused_moe_fp8.FP8_LORA_IN_PLACE_MAX_PAIRS = 1 << 40 if on else FP8_IN_PLACE_TO
    moe_plan.default_plan.cache_clear()
    fused_moe_fp8.fp8_plan.cache_clear()
    fused_moe_fp8.lora_options.cache_clear()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    model = write_model_config("qwen3-30b-a3b", out / "prefill_model", args.layers)
    spec = ModelSpec.from_model_dir(model)
    adapters = {f"ad{i}": str(write_adapter(model, out / "prefill_adapters" / f"ad{i}", seed=i + 1))
                for i in range(NUM_ADAPTERS)}
    engine = Engine(EngineConfig(model=str(model), load_format="dummy", enable_prefix_caching=False, max_num_seqs=256,
                                 max_num_batched_tokens=8192, max_model_len=1024, enforce_eager=True,
                                 enable_lora=True, max_loras=NUM_ADAPTERS, max_lora_rank=16, lora_modules=adapters,
                                 quantization=args.quantization))
    rng = random.Random(0)
    names = list(adapters)
    times = {"base": [], "lora in place": [], "lora apart": []}
    for rnd in range(args.rounds + 1):  # round 0 untimed (compiles)
        for mode in times:
            set_in_place_everywhere(mode == "lora in place")
            prompts = [[rng.randrange(1000, spec.vocab_size - 1) for _ in range(256)] for _ in range(256)]
            loras = None if mode == "base" else [names[i % len(names)] for i in range(256)]
            dt = run_prompts(engine, prompts, loras)
            if rnd:
                times[mode].append(dt)
    floor = 2 * active_params(spec) / (PEAK_TFLOPS * 1e12)
    res = {m: 256 * 256 / statistics.median(t) for m, t in times.items()}
    for m, tok_s in res.items():
        print(f"{args.quantization or 'bf16'} {m:14s} {tok_s:9,.0f} tok/s  {tok_s * floor:.3f} of the floor  "
              f"{tok_s / res['base']:.3f} of base  (times {', '.join(f'{t:.3f}' for t in times[m])})", flush=True)
    (out / f"prefill_ab_{args.quantization or 'bf16'}.json").write_text(
        json.dumps({"tok_s": res, "times": times, "floor_tok_s": 1 / floor, "time": time.time()}, indent=1))


if __name__ == "__main__":
    main()
