"""Where a decode step's time goes, kernel by kernel, in the step's own CUDA graph (not in regions timed apart).

`bench decode --profile` times each region of a layer as its own graph, so the overlap programmatic dependent launch
gives between a kernel and the one before it (a GEMV's K walk under the LoRA shrink launched just before it) is
lost there, and a launch looks dearer than it is: session 20 removed two launches at B = 1 that the regions priced
at ~2.5 us each and the step did not move. Here the whole step (all layers, dual graphs, PDL on) replays under the
torch profiler, and every kernel's start and end are read off the device timeline: for a middle layer of the model,
base against active (every row on one of 4 rank-16 adapters), each kernel's duration, the time from the previous
kernel's end to its start (negative: it overlapped), and the layer's span, medians over the middle layers.

    PYTHONPATH=. python benchmarks/session20/step_timeline.py --batches 1,8 --out DIR     # GPU (H200: ~60 s)

Prints one table per (B, mode) and writes DIR/step_timeline.json. A profiler that records no kernels inside graph
replays says so and exits 2.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from moeserve.bench.decode import DecodeBench, preset_spec, slots_for
from moeserve.worker.graph_runner import LORA, NOLORA
from moeserve.worker.sequence import ScheduledBatch


def step_kernels(bench: DecodeBench, B: int, mode: str) -> list[tuple[str, float, float]]:
    """(name, start us, end us) of every kernel one graphed decode step runs, in start order."""
    from torch.profiler import ProfilerActivity, profile

    seqs = bench.sequences(B, slots_for(mode, B))
    sb = ScheduledBatch(seqs, [1] * B, is_decode=True)
    runner = bench.runner
    for _ in range(3):  # compiled, captured, warm
        runner.collect(runner.launch(sb))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        runner.collect(runner.launch(sb))
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
              and not e.name.startswith(("Memcpy", "Memset"))]
    return sorted(((e.name, e.time_range.start, e.time_range.end) for e in events), key=lambda k: k[1])


def layer_table(kernels: list[tuple[str, float, float]], num_layers: int) -> dict:
    """Per position in a layer: the kernel's short name and the medians over the middle layers of its duration and
    of its gap after the previous kernel's end; the layer's span. Layers are cut by the kernel count a layer runs
    (the step's kernels minus those outside the layers: the embedding and the rows' grouping before the first
    layer's input norm, the final norm, logits and sampling after the last layer)."""
    per_layer = len(kernels) // num_layers
    outside = len(kernels) - per_layer * num_layers
    # a layer opens with its input norm: the first norm kernel is layer 0's (else split what is outside evenly)
    head = next((i for i, k in enumerate(kernels) if "norm" in k[0].lower()), outside // 2)
    head = min(head, outside)
    layers = [kernels[head + i * per_layer: head + (i + 1) * per_layer] for i in range(num_layers)]
    middle = layers[num_layers // 4: num_layers - num_layers // 4]
    rows = []
    for pos in range(per_layer):
        durs = [ly[pos][2] - ly[pos][1] for ly in middle]
        gaps = [ly[pos][1] - (ly[pos - 1][2] if pos else prev[-1][2])
                for prev, ly in zip(layers[num_layers // 4 - 1:], middle)]
        rows.append({"kernel": middle[0][pos][0][:48], "us": statistics.median(durs), "gap_us": statistics.median(gaps)})
    spans = [ly[-1][2] - ly[0][1] for ly in middle]
    starts = [b[0][1] - a[0][1] for a, b in zip(middle, middle[1:])]
    return {"kernels_per_layer": per_layer, "outside": len(kernels) - per_layer * num_layers, "rows": rows,
            "layer_span_us": statistics.median(spans), "layer_period_us": statistics.median(starts),
            "step_us": kernels[-1][2] - kernels[0][1]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--modes", default="base,active")
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--quantization", default=None, help="fp8: the FP8 engine (as bench decode's flag)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("step_timeline needs a CUDA device")
    batches = [int(b) for b in args.batches.split(",")]
    spec = preset_spec(args.preset, args.layers)
    bench = DecodeBench(spec, max(batches), steps=8, quantization=args.quantization)
    bench.attach_lora_pool()
    bench.runner.graph_runner = bench.graphs(batches, [LORA, NOLORA])
    result = {}
    with torch.inference_mode():
        for B in batches:
            for mode in args.modes.split(","):
                kernels = step_kernels(bench, B, mode)
                if len(kernels) < spec.num_layers:
                    print(f"B={B} {mode}: the profiler recorded {len(kernels)} kernels in a graphed step: it does "
                          "not see inside graph replays here")
                    return 2
                t = layer_table(kernels, spec.num_layers)
                result[f"{mode}@{B}"] = t
                print(f"\nB={B} {mode}: {t['kernels_per_layer']} kernels a layer (+{t['outside']} outside), layer "
                      f"period {t['layer_period_us']:.1f} us, span {t['layer_span_us']:.1f} us, step "
                      f"{t['step_us']:.0f} us")
                for r in t["rows"]:
                    print(f"  {r['kernel']:48s} {r['us']:7.2f} us  gap {r['gap_us']:+6.2f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "step_timeline.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
