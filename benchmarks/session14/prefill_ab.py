"""Prefill with every prompt on an adapter, the slot-sorted expert rows on and off in one engine, interleaved rounds
(base, sorted, unsorted, ...): what moe_plan.LORA_SLOT_SORTED_MIN_PAIRS is worth on `bench prefill`'s protocol
(256 prompts x 256 tokens, max_num_batched_tokens 8,192, so most MoE calls see 8,192 tokens).

    PYTHONPATH=. python benchmarks/session14/prefill_ab.py --layers 48 --out DIR [--quantization fp8]

Ran in call 2 on ca8257d, whose default_plan turned the sorted rows on from 4,096 tokens; they lost (call2/), the
threshold was removed after, so the script needs that commit.
"""
import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from moeserve import Engine, EngineConfig
from moeserve.bench.prefill import PEAK_TFLOPS, active_params, run_prompts
from moeserve.bench.protocol import NUM_ADAPTERS, write_adapter, write_model_config
from moeserve.kernels import fused_moe_fp8, moe_plan
from moeserve.model_spec import ModelSpec

SORTED_FROM = moe_plan.LORA_SLOT_SORTED_MIN_PAIRS


def set_slot_sorted(on: bool) -> None:
    moe_plan.LORA_SLOT_SORTED_MIN_PAIRS = SORTED_FROM if on else 1 << 40
    moe_plan.default_plan.cache_clear()
    fused_moe_fp8.fp8_plan.cache_clear()


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
    times = {"base": [], "lora sorted": [], "lora unsorted": []}
    for rnd in range(args.rounds + 1):  # round 0 untimed
        for mode in times:
            set_slot_sorted(mode == "lora sorted")
            prompts = [[rng.randrange(1000, spec.vocab_size - 1) for _ in range(256)] for _ in range(256)]
            loras = None if mode == "base" else [names[i % len(names)] for i in range(256)]
            dt = run_prompts(engine, prompts, loras)
            if rnd:
                times[mode].append(dt)
    floor = 2 * active_params(spec) / (PEAK_TFLOPS * 1e12)
    res = {m: 256 * 256 / statistics.median(t) for m, t in times.items()}
    for m, tok_s in res.items():
        print(f"{args.quantization or 'bf16'} {m:14s} {tok_s:9,.0f} tok/s  {tok_s * floor:.3f} of the floor  "
              f"{tok_s / res['base']:.3f} of base  (times {', '.join(f'{t:.3f}' for t in times[m])})")
    (out / f"prefill_ab_{args.quantization or 'bf16'}.json").write_text(
        json.dumps({"tok_s": res, "times": times, "floor_tok_s": 1 / floor, "time": time.time()}, indent=1))


if __name__ == "__main__":
    main()
