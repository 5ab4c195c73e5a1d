"""Which Triton kernels a decode step launches, with and without an adapter (CPU, the Triton interpreter).

    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/session19/launch_count.py

A tiny 2-layer qwen3_moe with an attention + experts adapter, the Triton backends: one prefill and two decode steps
at B = 1 and 4, launches counted by kernel name. Session 19: at B = 1 the adapter adds 4 launches a layer (the q|k|v
and o shrinks, whose expands ride in the GEMV epilogues, and the expert LoRA's two pair shrinks) and one a step (the
rows' grouping by slot), on ~10 a layer without it; the B = 1 decode step is 17 % longer with an adapter, ~2.6 µs a
launch.
"""
import collections
import pathlib
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tests"))

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from moeserve import Engine, EngineConfig, SamplingParams  # noqa: E402
from peft_fixtures import INTERPRETED_LAYERS, make_peft_adapter, save_base_checkpoint  # noqa: E402


def main() -> None:
    tmp = pathlib.Path(tempfile.mkdtemp())
    base = save_base_checkpoint("qwen3_moe", tmp / "base", **INTERPRETED_LAYERS)
    ad, _ = make_peft_adapter("qwen3_moe", tmp / "ad", kind="attn+experts", rank=4, seed=3,
                              config_overrides=INTERPRETED_LAYERS)
    engine = Engine(EngineConfig(model=str(base), device="cpu", dtype="float32", lora_modules={"ad": str(ad)},
                                 max_lora_rank=4, block_size=16, moe_backend="triton", attention_backend="triton"))
    launches = []
    run = InterpretedFunction.run

    def recording(self, *args, **kwargs):
        launches.append(self.fn.__name__)
        return run(self, *args, **kwargs)

    InterpretedFunction.run = recording
    for lora in (None, "ad"):
        for batch in (1, 4):
            launches.clear()
            engine.generate([[5, 6, 7, 8]] * batch, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
                            lora=[lora] * batch)
            print(f"adapter {lora}, B = {batch}: {len(launches)} launches (a prefill and 2 decode steps, "
                  f"{len(engine.runner.model.layers)} layers)")
            for name, n in sorted(collections.Counter(launches).items()):
                print(f"    {name}: {n}")


if __name__ == "__main__":
    main()
