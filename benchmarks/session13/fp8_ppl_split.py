"""Which FP8 products cost the demo model's perplexity under W8A8: the held text of tests/test_fp8_engine.py scored by
the unquantized engine, the FP8 engine weight-only (the CPU's auto) and W8A8 everywhere (dynamic), and with W8A8 set
on the routed experts alone, then on the other FP8 modules (attention projections) alone. CPU, float32, the kernels'
twins.

    PYTHONPATH=. python benchmarks/session13/fp8_ppl_split.py
"""
import dataclasses
import sys
import tempfile

import torch

sys.path.insert(0, "tests")
from engine_probe import prompt_logits  # noqa: E402
from test_fp8_engine import HELD_TEXT  # noqa: E402

from moeserve import Engine, EngineConfig  # noqa: E402
from moeserve.models import upcycle  # noqa: E402

demo = upcycle.demo_model_path(tempfile.mkdtemp(), progress=False)


def engine(**kw):
    return Engine(EngineConfig(model=str(demo), device="cpu", dtype="float32", max_model_len=1024, **kw))


def perplexity(e):
    ids = e.tokenizer.encode(HELD_TEXT)
    logits = prompt_logits(e, ids)[:-1]
    return torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:])).exp().item()


def w8a8_on(e, experts: bool):
    """W8A8 on the routed experts (MoEBlock) or on every other FP8 module."""
    for m in e.runner.model.modules():
        fmt = getattr(getattr(m, "weights", None), "format", None)
        if fmt is not None and (type(m).__name__ == "MoEBlock") == experts:
            m.weights.format = dataclasses.replace(fmt, act_quant=True)


base = perplexity(engine())
print(f"unquantized {base:.3f}")
for act in ("auto", "dynamic"):
    p = perplexity(engine(quantization="fp8", fp8_activations=act))
    print(f"fp8, --fp8-activations {act}: {p:.3f} ({(p - base) / base:+.2%})")
for experts in (True, False):
    e = engine(quantization="fp8")
    w8a8_on(e, experts)
    p = perplexity(e)
    print(f"W8A8 on {'the experts' if experts else 'attention'} only: {p:.3f} ({(p - base) / base:+.2%})")
