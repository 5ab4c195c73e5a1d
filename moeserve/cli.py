"""`moeserve` command line: demo, generate, make-tiny, serve, bench.

Each command imports what it needs when it runs (the server's fastapi and uvicorn, the demo's builders, a
benchmark's module), so a command, --help or a mistyped flag does not pay for the others."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from moeserve.errors import USER_ERRORS, EngineStartError

DEMO_QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Why do we sleep?",
    "What is a river?",
]
ADAPTER_QUESTIONS = DEMO_QUESTIONS[2:]  # asked again through each adapter; none of them is in its training data


def _demo(args) -> int:
    from moeserve import Engine, EngineConfig, SamplingParams
    from moeserve.engine_args import engine_config_from_args
    from moeserve.demo_adapters import ADAPTERS_DIR, DEMO_ADAPTERS, demo_adapters
    from moeserve.models.upcycle import demo_model_path

    cfg = engine_config_from_args(args)
    adapters = {}
    if cfg.model is None:
        print("Building (first run only) or reusing the embedded demo model: SmolLM2-135M-Instruct "
              "upcycled into a 4-expert top-2 Mixtral MoE, and its two demo adapters")
        cfg.model = str(demo_model_path(progress=True))
        if not args.no_lora:  # trained for the demo model only: another --model gets none
            adapters = demo_adapters(cfg.model, progress=True)
    if adapters:
        cfg.enable_lora = True
        cfg.lora_modules = {**adapters, **cfg.lora_modules}
        if cfg.max_loras == EngineConfig().max_loras:  # not set by the user: as many slots as adapters
            cfg.max_loras = len(cfg.lora_modules)
    engine = Engine(cfg, progress=True)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    questions = list(DEMO_QUESTIONS)
    loras = [None] * len(questions)
    for name in adapters:  # the same batch: base rows and rows of each adapter side by side
        questions += ADAPTER_QUESTIONS
        loras += [name] * len(ADAPTER_QUESTIONS)
    prompts = [engine.chat_prompt([{"role": "user", "content": q}]) for q in questions]
    # one untimed step first: on the CPU the first forward packs the fp32 weights for oneDNN (layers/cpu_linear.py)
    engine.generate(prompts[:1], SamplingParams(max_tokens=1, temperature=0.0), lora=loras[:1])
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params, lora=loras)
    dt = time.perf_counter() - t0
    for q, lora, o in zip(questions, loras, outs):
        tag = f"[adapter {lora}: {DEMO_ADAPTERS[lora]}]" if lora in DEMO_ADAPTERS else \
            f"[adapter {lora}]" if lora else "[base]"
        print(f"\n{tag} Q: {q}\n  A: {o.text.strip()}")
    ntok = sum(len(o.token_ids) for o in outs)
    # the engine's config: "auto" device and dtype resolved to what actually ran
    print(f"\n{len(outs)} requests in one continuous batch, {ntok} tokens in {dt:.2f} s "
          f"= {ntok / dt:.1f} tokens/s on {engine.config.device} ({engine.config.dtype})")
    if adapters:
        print(f"Demo model cached in {cfg.model}, its adapters in {os.path.join(cfg.model, ADAPTERS_DIR)} "
              "(MOESERVE_CACHE_DIR moves the cache)")
    return 0


def _generate(args) -> int:
    from moeserve import Engine, SamplingParams
    from moeserve.engine_args import engine_config_from_args

    engine = Engine(engine_config_from_args(args), progress=True)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.sample_seed)
    prompts = [engine.chat_prompt([{"role": "user", "content": p}]) if args.chat else p for p in args.prompt]
    outs = engine.generate(prompts, params, lora=args.lora)
    for p, o in zip(args.prompt, outs):
        if args.json:
            print(json.dumps({"prompt": p, "text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason}))
        else:
            print(f"--- {p}\n{o.text}")
    return 0


def _make_tiny(args) -> int:
    from moeserve.models.tiny import make_tiny

    path = make_tiny(args.family, args.out, expert_layout=args.expert_layout, seed=args.seed, force=args.force,
                     quantization=args.quantization)
    print(f"wrote tiny {args.family} model to {path}")
    return 0


def _serve(args) -> int:
    from moeserve.server.app import check_serve_args, listening_socket, serve_main

    check_serve_args(args)
    # bound first: a port in use is reported now, not after the model (or the demo model's first build) has loaded
    sock = listening_socket(args.host, args.port)
    try:
        if args.model is None:
            # the demo model with its demo adapters under their names (caps, brief), as the README's examples use it
            from moeserve.demo_adapters import ADAPTERS_DIR, demo_adapters
            from moeserve.models.upcycle import demo_model_path

            print("Building (first run only) or reusing the embedded demo model and its demo adapters", flush=True)
            args.model = str(demo_model_path(progress=True))
            adapters = demo_adapters(args.model, progress=True)
            args.enable_lora = True
            args.lora_modules = [*adapters.items(), *(args.lora_modules or [])]  # the user's win a clash of names
            if args.enable_lora_runtime_loading and args.lora_dir is None:  # loads by name from the demo's adapters
                args.lora_dir = os.path.join(args.model, ADAPTERS_DIR)
    except BaseException:
        sock.close()
        raise
    return serve_main(args, sock) or 0


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a mistake is one line naming it (not the usage of every flag first; --help has that)."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see `{self.prog} --help`)\n")


def build_parser(argv=None) -> argparse.ArgumentParser:
    from moeserve.engine_args import add_engine_args
    from moeserve.models.tiny import TINY_FAMILIES

    parser = ArgumentParser(prog="moeserve", description=__doc__)
    parser.add_argument("--log-level", default="WARNING", help="logging level (default: WARNING)")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="answer a few chat prompts with the embedded demo MoE (base + two adapters)")
    add_engine_args(p)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--no-lora", action="store_true", help="base model only")
    p.set_defaults(func=_demo)

    p = sub.add_parser("generate", help="generate completions for prompts given on the command line")
    add_engine_args(p)
    p.add_argument("prompt", nargs="+")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    p.add_argument("--lora", default=None, help="adapter name (from --lora-modules) for every prompt")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--sample-seed", type=int, default=None)
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.set_defaults(func=_generate)

    p = sub.add_parser("make-tiny", help="write a tiny random model (with tokenizer) of a family")
    p.add_argument("--family", required=True, choices=TINY_FAMILIES)
    p.add_argument("--out", required=True)
    p.add_argument("--expert-layout", default="per_expert", choices=("per_expert", "fused"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="overwrite a model (or replace a file) at --out")
    p.add_argument("--quantization", default=None, choices=("fp8",),
                   help="write a block-wise FP8 checkpoint (float8_e4m3fn weights, float32 scale_inv per 128x128 "
                        "block, quantization_config fp8), as Qwen and DeepSeek publish them")
    p.set_defaults(func=_make_tiny)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    if "serve" in (argv or sys.argv[1:]):  # the server's imports (fastapi, uvicorn) only when serving
        from moeserve.server.app import add_serve_args

        add_serve_args(p)
    p.set_defaults(func=_serve)

    p = sub.add_parser("bench", help="benchmarks: serve | decode | prefill | protocol | churn | tp_decode (kernel "
                                     "benchmarks: python -m benchmarks.kernels.kernels in a clone)")
    p.add_argument("which", choices=BENCHMARKS + tuple(DEVELOPER_BENCHMARKS))
    p.add_argument("rest", nargs=argparse.REMAINDER, help="arguments passed to the benchmark")
    p.set_defaults(func=_bench)
    return parser


BENCHMARKS = ("serve", "decode", "prefill", "protocol", "churn", "tp_decode")  # moeserve/bench/<name>.py
# kernel and collective micro-benchmarks live outside the package, in the repository's benchmarks/kernels/
DEVELOPER_BENCHMARKS = {"kernels": "kernels", "attention": "attention", "collectives": "collectives"}


def _bench(args) -> int:
    import importlib

    if args.which in DEVELOPER_BENCHMARKS:
        raise ValueError(f"`bench {args.which}` is a developer benchmark, not installed with the package: from a "
                         f"clone of the repository, at its root, run `python -m benchmarks.kernels."
                         f"{DEVELOPER_BENCHMARKS[args.which]}`")
    mod = importlib.import_module(f"moeserve.bench.{args.which}")
    return mod.main(args.rest) or 0


def main(argv=None) -> int:
    from moeserve.engine_args import split_lora_modules_argv

    argv = list(sys.argv[1:] if argv is None else argv)
    if "bench" not in argv[:3]:  # bench passes its arguments through untouched
        argv = split_lora_modules_argv(argv)  # `generate --lora-modules a=/p "prompt"` keeps its prompt
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.WARNING),
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except EngineStartError as e:
        print(f"error: the engine failed to start: {e} (its log above has the details)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
