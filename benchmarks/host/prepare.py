"""Host time of ModelRunner.prepare: the batch's tensors built from the scheduled sequences.

    python -m benchmarks.host.prepare [--batches 64,256,512] [--repeats 200] [--out bench_out]

Decode batches as the engine's steady state has them: B sequences of a 512-token prompt with one generated
token and one PENDING token from the step in flight, block size 16, block tables sized for 512 + 128 + 16
tokens (41 blocks), every other sequence on one of 4 adapters; the host path a graph replay takes
(`on_host=True`). Prefill rows: 4 prompts of 512 tokens, one chunk each, on the device path. Median
milliseconds per call over `--repeats` calls (after 10 warm-up calls); the table goes to stdout and
prepare.json under --out. On a CUDA machine the host tensors are pinned, as in the engine.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from moeserve.config import EngineConfig
from moeserve.lora.slot_pool import LoRASlotPool
from moeserve.model_spec import ModelSpec
from moeserve.models import loader
from moeserve.sampling_params import SamplingParams
from moeserve.worker.model_runner import ModelRunner
from moeserve.worker.sequence import PENDING, ScheduledBatch, Sequence

CONTEXT, BLOCK, STEPS, NUM_ADAPTERS = 512, 16, 128, 4
# prepare reads only the runner's block size, device and LoRA pool: a one-layer toy model is enough
SPEC = ModelSpec(family="qwen3_moe", vocab_size=96, hidden_size=64, num_layers=1, sparse_layers=(True,),
                 num_heads=4, num_kv_heads=2, head_dim=16, num_experts=8, top_k=2, moe_intermediate_size=48,
                 intermediate_size=80, norm_topk_prob=True, max_position_embeddings=4096)


def make_runner(max_bs: int) -> ModelRunner:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = EngineConfig(model="random", device=device, dtype="float32", max_model_len=CONTEXT + STEPS + BLOCK,
                       max_num_seqs=max_bs, block_size=BLOCK, moe_backend="torch", attention_backend="torch",
                       linear_backend="torch").resolve()
    model = loader.random_model(SPEC, cfg.exec_options())
    runner = ModelRunner(cfg, SPEC, None, model=model)
    runner.lora_pool = LoRASlotPool(SPEC, model, NUM_ADAPTERS, 16, {"q_proj", "o_proj"}, runner.device,
                                    runner.dtype)
    return runner


def decode_batch(B: int) -> ScheduledBatch:
    width = -(-(CONTEXT + STEPS + BLOCK) // BLOCK)
    seqs = []
    for i in range(B):
        s = Sequence(f"d{i}", [(7 * i + j) % 96 for j in range(CONTEXT)], SamplingParams(temperature=0.0))
        s.output_token_ids = [5, PENDING]
        s.num_pending, s.pending_row = 1, i
        s.num_computed_tokens = s.num_tokens - 1
        s.block_table = [1 + i * width + j for j in range(width)]
        s.lora_slot = i // 2 % NUM_ADAPTERS if i % 2 == 0 else -1
        seqs.append(s)
    return ScheduledBatch(seqs, [1] * B, is_decode=True)


def prefill_batch(n: int) -> ScheduledBatch:
    seqs = []
    for i in range(n):
        s = Sequence(f"p{i}", [(3 * i + j) % 96 for j in range(CONTEXT)], SamplingParams(temperature=0.0))
        s.block_table = [1 + i * (CONTEXT // BLOCK) + j for j in range(CONTEXT // BLOCK)]
        s.lora_slot = i % NUM_ADAPTERS if i % 2 == 0 else -1
        seqs.append(s)
    return ScheduledBatch(seqs, [CONTEXT] * n, is_decode=False)


def time_ms(fn, repeats: int) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="64,256,512")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--out", default="bench_out")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    runner = make_runner(max(batches))
    rows = []
    for B in batches:
        sb = decode_batch(B)
        rows.append({"case": f"decode B={B}", "ms": time_ms(lambda: runner.prepare(sb, on_host=True), args.repeats)})
    sb = prefill_batch(4)
    rows.append({"case": "prefill 4 x 512", "ms": time_ms(lambda: runner.prepare(sb), args.repeats)})
    print(f"ModelRunner.prepare, median ms per call ({runner.device.type}, pinned host tensors: {runner.pin})")
    print(f"{'case':>18s} {'ms':>8s}")
    for r in rows:
        print(f"{r['case']:>18s} {r['ms']:8.3f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    payload = {"device": runner.device.type, "pinned": runner.pin, "cpu": platform.processor() or platform.machine(),
               "torch_threads": torch.get_num_threads(), "context": CONTEXT, "block_size": BLOCK,
               "repeats": args.repeats, "rows": rows, "date": time.strftime("%Y-%m-%d")}
    (out / "prepare.json").write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
