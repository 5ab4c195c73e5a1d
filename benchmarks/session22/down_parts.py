"""The FP8 routed experts' two GEMMs timed apart at decode sizes (Qwen3-30B-A3B shape): is the W8A8 down GEMM
(fp8 h, each K step's product scaled; 64 % of bandwidth in the B = 256 step) beaten by a weight-only down GEMM that
reads the bf16 gate_up output and applies SiLU*up as it loads (no activation-quantization launch before it)?

    python benchmarks/session22/down_parts.py --out DIR [--tokens 64,256,512]

Per T: each variant a CUDA-graph replay rotating through 4 weight sets (> L2), interleaved, 3 rounds, medians;
GB/s of the touched expert weight bytes. Prints a table; writes DIR/down_parts.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from benchmarks.kernels.fp8_moe import HIDDEN, INTER, NUM_EXPERTS, TOP_K, make_inputs, touched_bytes  # noqa: E402
from moeserve.bench.common import graph_time_us  # noqa: E402
from moeserve.kernels.fp8 import WEIGHT_BLOCK, quantize_block_fp8, silu_mul_quant_fp8  # noqa: E402
from moeserve.kernels.fused_moe import silu_mul_rows, weight_descs  # noqa: E402
from moeserve.kernels.fused_moe_fp8 import _launch, fp8_plan  # noqa: E402
from moeserve.kernels.moe_align import moe_align  # noqa: E402
from moeserve.kernels.moe_plan import GemmTile, MoEPlan, MoEProblem, fit_tile, smem_limit  # noqa: E402

DEV = "cuda"
# weight-only down tiles: (block_m, block_n, block_k, warps, stages); bf16's H200 rows use 16 x 256 x 64
WO_TILES = [(16, 256, 64, 4, 3), (16, 128, 128, 4, 3), (16, 128, 64, 4, 4), (16, 64, 128, 4, 4), (16, 256, 128, 8, 3),
            (32, 128, 128, 4, 3), (32, 256, 64, 8, 3), (64, 128, 64, 4, 4), (64, 128, 128, 4, 3), (64, 256, 64, 8, 3)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--tokens", default="64,256,512")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(DEV).manual_seed(0)
    limit = smem_limit(torch.device(DEV))
    pdl = True
    sets = []
    for _ in range(4):
        w2 = torch.randn(NUM_EXPERTS, HIDDEN, INTER, generator=gen, device=DEV, dtype=torch.bfloat16) * 0.02
        sets.append(quantize_block_fp8(w2))
        del w2
    report = []
    for batch in [int(t) for t in args.tokens.split(",")]:
        problem = MoEProblem(NUM_EXPERTS, HIDDEN, INTER, TOP_K, torch.bfloat16, torch.device(DEV))
        engine = fp8_plan(batch, TOP_K, problem, True, decode=False)
        pairs = batch * TOP_K
        inputs = []
        for _ in sets:
            _, w, ids = make_inputs(batch, gen)
            gu = torch.randn(pairs, 2 * INTER, generator=gen, device=DEV, dtype=torch.bfloat16)
            inputs.append((w, ids, gu, {bm: moe_align(ids, NUM_EXPERTS, bm) for bm in (16, 32, 64)}))

        def down(tile, act_fp8, fused_act, quant, scale_product=False, tma=True):
            def make(wset, inp):
                q2, s2 = wset
                w, ids, gu, aligned = inp
                plan = MoEPlan(False, tile, tile, weights_tma=tma)
                _, desc, w_tma = weight_descs(q2, q2, plan)
                y = torch.empty(pairs, HIDDEN, dtype=torch.bfloat16, device=DEV)
                pre = silu_mul_quant_fp8(gu, WEIGHT_BLOCK[1]) if act_fp8 and not quant else None

                def fn():
                    if act_fp8:
                        h, hs = silu_mul_quant_fp8(gu, WEIGHT_BLOCK[1], pdl=pdl) if quant else pre
                    elif fused_act:
                        h, hs = gu, w
                    else:
                        h, hs = silu_mul_rows(gu, pdl), w
                    _launch(h, hs, q2, s2, y, w, aligned[tile.block_m], pairs, 1, HIDDEN, INTER, HIDDEN, 0, tile,
                            WEIGHT_BLOCK, act_fp8, fused_act, True, scale_product, pdl, desc, w_tma)
                    return y
                return fn
            return [make(ws, inp) for ws, inp in zip(sets, inputs)]

        variants = {"w8a8_engine+quant": down(engine.down, True, False, True, tma=engine.weights_tma),
                    "w8a8_engine_only": down(engine.down, True, False, False, tma=engine.weights_tma)}
        for bm, bn, bk, warps, stages in WO_TILES:
            tile = fit_tile(GemmTile(bm, bn, bk, warps, stages), 2, 2, limit)
            name = f"{bm}x{tile.block_n}x{tile.block_k}w{warps}s{tile.num_stages}"
            variants[f"wo_fused_{name}"] = down(tile, False, True, False)
            variants[f"wo_fused_{name}_p"] = down(tile, False, True, False, scale_product=True)
            variants[f"wo_fused_{name}_ptr"] = down(tile, False, True, False, tma=False)
        ref = variants["w8a8_engine_only"][0]().float().clone()
        errs = {}
        for n, fns in list(variants.items()):  # each against the W8A8 GEMM (a few % apart by design)
            try:
                errs[n] = ((fns[0]().float() - ref).norm() / ref.norm()).item()
            except Exception as exc:
                print(f"  {n}: {type(exc).__name__} {str(exc)[:160]}", flush=True)
                del variants[n]
        print(f"T={batch}: rel err vs W8A8 max {max(errs.values()):.3f} min-wo "
              f"{min(v for k, v in errs.items() if k.startswith('wo_')):.3f}", flush=True)
        times = {n: [] for n in variants}
        for _ in range(3):
            for n, fns in variants.items():
                try:
                    times[n].append(graph_time_us(fns))
                except Exception as exc:  # a tile that does not compile: skipped
                    print(f"  {n}: {type(exc).__name__} {str(exc)[:160]}", flush=True)
                    times[n] = None
                    variants[n] = None
            variants = {n: v for n, v in variants.items() if v is not None}
        med = {n: statistics.median(t) for n, t in times.items() if t}
        floor_b = touched_bytes(batch, 1) / 3  # the down third
        row = {"tokens": batch, "engine_down": engine.down.as_list(), "us": med, "rel_err": errs,
               "gbps": {n: floor_b / v / 1e3 for n, v in med.items()}}
        report.append(row)
        best_wo = min((n for n in med if n.startswith("wo_")), key=med.get)
        print(f"T={batch:4d}: W8A8 down {engine.down.as_list()} + quant {med['w8a8_engine+quant']:.1f} us "
              f"(GEMM alone {med['w8a8_engine_only']:.1f}, {row['gbps']['w8a8_engine_only']:.0f} GB/s); "
              f"best weight-only fused {best_wo} {med[best_wo]:.1f} us ({row['gbps'][best_wo]:.0f} GB/s)", flush=True)
        for n in sorted(med, key=med.get)[:8]:
            print(f"    {n:36s} {med[n]:7.1f} us {row['gbps'][n]:6.0f} GB/s")
        (out / "down_parts.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
