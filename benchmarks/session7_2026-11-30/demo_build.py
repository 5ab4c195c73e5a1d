"""Time the first build of the demo adapters (CPU): the base model's answers, then each adapter's training,
on a copy of the cached demo model. Prints the phases and writes JSON.

    OMP_NUM_THREADS=2 python benchmarks/session7_2026-11-30/demo_build.py --out demo_build.json
"""
import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import moeserve.lora.demo as demo
    from moeserve.models.upcycle import demo_model_path

    src = Path(demo_model_path(progress=False))
    model = Path(tempfile.mkdtemp())
    for f in src.iterdir():
        if f.is_file():
            shutil.copy(f, model / f.name)
    phases = {}

    def timed(name, fn):
        def run(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                phases[name] = phases.get(name, 0.0) + time.perf_counter() - t0
        return run

    demo._base_answers = timed("base_answers_s", demo._base_answers)
    demo._train_adapter = timed("training_s", demo._train_adapter)
    t0 = time.perf_counter()
    demo.build_demo_adapters(model, progress=False)
    phases["total_s"] = time.perf_counter() - t0
    shutil.rmtree(model, ignore_errors=True)
    print("  ".join(f"{k} {v:.1f}" for k, v in phases.items()), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(phases, indent=1) + "\n")


if __name__ == "__main__":
    main()
