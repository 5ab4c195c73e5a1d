"""FP8 against the unquantized demo model, greedy (#25's oracle on real weights): SmolLM2-135M upcycled, float32 on
the CPU, the kernels' twins. Eight prompts, 64 new tokens each, greedy; for each FP8 setting the tokens generated
before the first that differs from the unquantized engine's, and the top-1 agreement on the unquantized engine's
continuation (teacher-forced: at each of the 64 positions, whether both engines' argmax is the same token).

    PYTHONPATH=. python benchmarks/session27/fp8_greedy_agreement.py [--out DIR]
"""
import argparse
import json
import pathlib
import sys
import tempfile

from moeserve import Engine, EngineConfig, SamplingParams
from moeserve.models import upcycle

sys.path.insert(0, "tests")
from engine_probe import prompt_logits  # noqa: E402

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three uses of a river for the people who live near it.",
    "def fibonacci(n):",
    "Translate to French: The cat sleeps on the warm window sill.",
    "What is 17 times 23? Show your work.",
    "Once upon a time, in a village at the edge of a forest,",
]
NEW_TOKENS = 64


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for fp8_greedy_agreement.json")
    args = parser.parse_args()
    demo = upcycle.demo_model_path(tempfile.mkdtemp(), progress=False)

    def engine(**kw):
        return Engine(EngineConfig(model=str(demo), device="cpu", dtype="float32", max_model_len=1024, **kw))

    sp = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    base = engine()
    prompts = [base.tokenizer.encode(p) for p in PROMPTS]
    want = [o.token_ids for o in base.generate(prompts, sp)]
    def argmax_on_base_path(e):  # each generated position's argmax, on the unquantized engine's sequence
        return [prompt_logits(e, p + w)[len(p) - 1:-1].argmax(-1) for p, w in zip(prompts, want)]

    base_top1 = argmax_on_base_path(base)
    rows, top1 = {}, {}
    for label, kw in (("fp8 weight-only (CPU auto)", dict(quantization="fp8")),
                      ("fp8 W8A8 (--fp8-activations dynamic)", dict(quantization="fp8", fp8_activations="dynamic"))):
        e = engine(**kw)
        got = [o.token_ids for o in e.generate(prompts, sp)]
        same = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), len(w)) for g, w in zip(got, want)]
        rows[label] = same
        agree = [(a == b).float().mean().item() for a, b in zip(argmax_on_base_path(e), base_top1)]
        top1[label] = sum(agree) / len(agree)
    print(f"greedy tokens before the first that differs from the unquantized engine's ({NEW_TOKENS} generated):")
    print(f"{'prompt':<62}" + "".join(f"{label[:22]:>24}" for label in rows))
    for i, text in enumerate(PROMPTS):
        print(f"{text[:60]:<62}" + "".join(f"{rows[label][i]:>24}" for label in rows))
    for label, same in rows.items():
        whole = sum(s == NEW_TOKENS for s in same)
        print(f"{label}: {whole} / {len(same)} prompts identical over all {NEW_TOKENS}; mean agreeing prefix "
              f"{sum(same) / len(same):.1f}; top-1 agreement on the unquantized continuation {top1[label]:.3f}")
    if args.out:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "fp8_greedy_agreement.json").write_text(json.dumps(
            dict(prompts=PROMPTS, new_tokens=NEW_TOKENS, agreeing_prefix=rows, top1_agreement=top1), indent=1))


if __name__ == "__main__":
    main()
