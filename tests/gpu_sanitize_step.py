"""One prefill + one decode step of the whole engine with Triton backends and LoRA, for
`compute-sanitizer --tool memcheck`. Not collected by pytest; run on the device machine."""
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from moeserve import Engine, EngineConfig, SamplingParams  # noqa: E402
from peft_fixtures import make_peft_adapter, save_base_checkpoint  # noqa: E402

root = Path(tempfile.mkdtemp())
base = save_base_checkpoint("qwen3_moe", root / "base")
ad, _ = make_peft_adapter("qwen3_moe", root / "a", rank=4, seed=1)
engine = Engine(EngineConfig(model=str(base), device="cuda", enforce_eager=True, lora_modules={"A": str(ad)},
                             max_lora_rank=16, max_loras=2))
outs = engine.generate([[5, 6, 7, 8, 9], [11, 12, 13]], SamplingParams(max_tokens=2, temperature=0.0),
                       lora=["A", None])
print("sanitize step ok:", [o.token_ids for o in outs])
