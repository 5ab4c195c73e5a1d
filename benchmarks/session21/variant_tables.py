"""Tile tables (MOESERVE_MOE_TILES files) that give the engine's LoRA calls the shrink options of the best
`--lora-sweep` variants, for `bench decode` to run the whole step with them.

    PYTHONPATH=. python benchmarks/session21/variant_tables.py SWEEP_JSON OUT_DIR [--ranks 2]     # GPU

Reads `sweep_lora` of a kernels_bench.json (benchmarks.kernels.kernels --lora-sweep), ranks each batch's variants
that change only the shrinks' options (not the base tiles) by their MoE + LoRA time, and writes OUT_DIR/bestN.json
(N = 1 .. ranks): the shipped bf16 table with each swept batch's row (the smallest max_tokens >= the batch) given
the N-th best variant's options. Prints which variant went where.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from benchmarks.kernels.kernels import _lora_variants, engine_plan
from moeserve.kernels.moe_plan import LORA_OPTIONS, TABLE_PATH


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("sweep")
    ap.add_argument("out")
    ap.add_argument("--ranks", type=int, default=2)
    args = ap.parse_args()
    sweep = json.loads(Path(args.sweep).read_text())["sweep_lora"]
    shipped = json.loads(TABLE_PATH.read_text())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for n in range(args.ranks):
        table = json.loads(json.dumps(shipped))
        entry = next(e for e in table["entries"] if e["dtype"] == "bfloat16")
        for batch, rows in sweep.items():
            batch = int(batch)
            base = engine_plan(batch, lora=True, decode=False)
            variants = _lora_variants(base)
            shrink_only = [r for r in rows if r["variant"] in variants
                           and variants[r["variant"]].gate_up == base.gate_up
                           and variants[r["variant"]].down == base.down]
            ranked = sorted(shrink_only, key=lambda r: r["lora_us"])
            if n >= len(ranked):
                continue
            pick = ranked[n]
            options = {k: v for k, v in asdict(variants[pick["variant"]]).items() if k in LORA_OPTIONS}
            row = min((r for r in entry["tiles"] if r["max_tokens"] >= batch), key=lambda r: r["max_tokens"])
            row.update(options)
            print(f"best{n + 1} T={batch}: {pick['variant']} {pick['lora_us']:.1f} us (x{pick['ratio']:.3f}) "
                  f"-> row max_tokens {row['max_tokens']}: {options}")
        (out / f"best{n + 1}.json").write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
