"""The demo model on the CPU: moeserve's Engine.generate against transformers' generate on the same folder.

8 chat prompts x 32 greedy tokens, float32, the same prompt token ids for both (transformers gets them as one
left-padded batch). Rounds alternate engine, transformers, engine, transformers, ... in one process; the table
gives each round's tok/s (generated tokens / wall time of the generate call, prefill included) and the medians.
The greedy texts of the two are compared prompt by prompt.

    OMP_NUM_THREADS=2 python benchmarks/cpu_demo_vs_transformers.py --rounds 3 --out cpu_demo_vs_transformers.json
"""
import argparse
import json
import statistics
import time
from pathlib import Path

import torch

QUESTIONS = [
    "What is the capital of France?", "Name three primary colors.", "Why is the sky blue?", "What do bees make?",
    "How many legs does a spider have?", "What is the largest planet?", "Give me a tip for better sleep.",
    "What is photosynthesis?",
]


def engine_run(engine, prompts, max_tokens):
    from moeserve import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, sp)
    dt = time.perf_counter() - t0
    assert all(len(o.token_ids) == max_tokens for o in outs)
    return dt, [o.token_ids for o in outs]


def transformers_run(model, prompts, max_tokens, pad_id):
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=pad_id)
    dt = time.perf_counter() - t0
    return dt, out[:, width:].tolist()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="engine / transformers pairs, alternated")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()

    import transformers as tf

    import moeserve
    from moeserve import Engine, EngineConfig
    from moeserve.models.upcycle import demo_model_path

    model_dir = str(demo_model_path())
    engine = Engine(EngineConfig(model=model_dir, device="cpu", dtype="float32"))
    prompts = [engine.chat_prompt([{"role": "user", "content": q}]) for q in QUESTIONS]
    hf = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad_id = hf.generation_config.pad_token_id
    if pad_id is None:
        pad_id = hf.config.eos_token_id
    n_tokens = len(prompts) * args.max_tokens

    # one untimed call each first: allocator and thread pools warm for both
    engine_run(engine, prompts, 2)
    transformers_run(hf, prompts, 2, pad_id)
    rows = []
    for r in range(args.rounds):
        e_dt, e_ids = engine_run(engine, prompts, args.max_tokens)
        t_dt, t_ids = transformers_run(hf, prompts, args.max_tokens, pad_id)
        rows.append(dict(round=r, engine_tok_s=n_tokens / e_dt, transformers_tok_s=n_tokens / t_dt))
        print(f"round {r}: engine {rows[-1]['engine_tok_s']:.1f} tok/s, transformers "
              f"{rows[-1]['transformers_tok_s']:.1f} tok/s", flush=True)

    tok = engine.tokenizer
    same_tokens = [a == b for a, b in zip(e_ids, t_ids)]
    same_texts = [tok.decode(a) == tok.decode(b) for a, b in zip(e_ids, t_ids)]
    e_med = statistics.median(x["engine_tok_s"] for x in rows)
    t_med = statistics.median(x["transformers_tok_s"] for x in rows)
    print(f"\n{len(prompts)} chat prompts x {args.max_tokens} greedy tokens, float32, "
          f"{torch.get_num_threads()} threads")
    print("| run | Engine.generate tok/s | transformers generate tok/s | ratio |")
    print("|---|---:|---:|---:|")
    for x in rows:
        print(f"| {x['round']} | {x['engine_tok_s']:.1f} | {x['transformers_tok_s']:.1f} | "
              f"{x['engine_tok_s'] / x['transformers_tok_s']:.2f}x |")
    print(f"| median | {e_med:.1f} | {t_med:.1f} | {e_med / t_med:.2f}x |")
    print(f"greedy texts equal: {sum(same_texts)}/{len(prompts)} (token ids equal: {sum(same_tokens)}/{len(prompts)})")
    for i, (a, b) in enumerate(zip(e_ids, t_ids)):
        if a != b:
            print(f"  prompt {i} differs:\n    engine:       {tok.decode(a)!r}\n    transformers: {tok.decode(b)!r}")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(
            moeserve=str(Path(moeserve.__file__).parent), prompts=len(prompts), max_tokens=args.max_tokens,
            dtype="float32", threads=torch.get_num_threads(),
            rounds=rows, engine_tok_s_median=e_med, transformers_tok_s_median=t_med, ratio=e_med / t_med,
            texts_equal=same_texts, token_ids_equal=same_tokens), indent=1) + "\n")
    return 0 if all(same_texts) else 1


if __name__ == "__main__":
    raise SystemExit(main())
