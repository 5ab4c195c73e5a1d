"""Two small seeded adapters for the embedded demo model, so the demo can show base and adapter
rows side by side in one batch. They are random (rank 8 on q/v and every routed expert), scaled
to nudge the answers without wrecking them; written once next to the demo model in PEFT format."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from moeserve.models.spec import ModelSpec

DEMO_ADAPTERS = {"demo-a": 1, "demo-b": 2}  # name -> seed
RANK, ALPHA, STD = 8, 16, 0.06


def _write_adapter(spec: ModelSpec, out: Path, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    H, inter = spec.hidden_size, spec.moe_intermediate_size

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * STD).contiguous()

    tensors = {}
    for layer in range(spec.num_layers):
        p = f"base_model.model.model.layers.{layer}."
        for proj, out_dim in (("q_proj", spec.q_size), ("v_proj", spec.kv_size)):
            tensors[p + f"self_attn.{proj}.lora_A.weight"] = rnd(RANK, H)
            tensors[p + f"self_attn.{proj}.lora_B.weight"] = rnd(out_dim, RANK)
        for e in range(spec.num_experts):
            q = p + f"block_sparse_moe.experts.{e}."
            for w, (i, o) in (("w1", (H, inter)), ("w3", (H, inter)), ("w2", (inter, H))):
                tensors[q + f"{w}.lora_A.weight"] = rnd(RANK, i)
                tensors[q + f"{w}.lora_B.weight"] = rnd(o, RANK)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(tmp / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": RANK, "lora_alpha": ALPHA, "target_modules": ["q_proj", "v_proj", "w1", "w2", "w3"],
           "bias": "none", "use_dora": False, "use_rslora": False, "task_type": "CAUSAL_LM"}
    (tmp / "adapter_config.json").write_text(json.dumps(cfg, indent=1))
    try:
        tmp.rename(out)
    except OSError:  # another process finished first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


def demo_adapters(model_dir: str) -> dict[str, str]:
    """name -> path of the demo adapters for the demo model at model_dir (built on first use)."""
    spec = ModelSpec.from_model_dir(model_dir)
    if spec.family != "mixtral":
        return {}
    root = Path(model_dir) / "adapters"
    out = {}
    for name, seed in DEMO_ADAPTERS.items():
        path = root / name
        if not (path / "adapter_model.safetensors").is_file():
            _write_adapter(spec, path, seed)
        out[name] = str(path)
    return out
