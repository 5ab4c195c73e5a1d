"""Two small LoRA adapters for the embedded demo model, each with an effect one can see and name:

  caps   answers in capital letters      (trained on the base model's own answers, upper-cased)
  brief  answers in one short sentence   (trained on its own answers cut to the first sentence)

They are trained with PEFT, on CPU, on text the demo model writes itself: the base model answers
TRAIN_PROMPTS greedily (moeserve's engine), each adapter learns its rewrite of those answers. Rank 8 on
q_proj/v_proj (caps also on the routed experts) of the top TRAIN_LAYERS layers only: the frozen layers
below run once per example (their output is cached), so each training step runs a third of the model
forward and back. Written next to the demo model (`<model>/adapters/<name>`) in PEFT format, with the
examples each was trained on (train.jsonl) and how (moeserve_build.json: settings, loss per epoch, and
the sha256 of the base weights it was trained on).

The trained adapters ship with the package (SHIPPED_DIR, in bfloat16: about 4 MB) and are copied next to
the demo model at first use when its weights are the ones they were trained on; otherwise (the demo
model's recipe or its source changed) they are trained there, about 2.5 minutes on 2 cores. Retrain the
shipped ones after such a change with `python -m moeserve.demo_adapters`.

A 135M model writing in capitals is not at its best: caps keeps the gist of an answer, not every word.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import warnings
from pathlib import Path

from moeserve import Engine, EngineConfig, SamplingParams

DEMO_ADAPTERS = {  # name -> what it does (printed beside its answers)
    "caps": "answers in capital letters",
    "brief": "answers in one short sentence",
}
ADAPTERS_DIR = "adapters"
SHIPPED_DIR = Path(__file__).parent / "data" / "demo_adapters"  # package data: <name>/ as trained
BUILD_FILE = "moeserve_build.json"  # how an adapter was trained, and on which base weights

logger = logging.getLogger(__name__)

TRAIN_PROMPTS = [
    "What is the capital of France?", "Name three primary colors.", "Why is the sky blue?", "What do bees make?",
    "How many legs does a spider have?", "What is the largest planet?", "Give me a tip for better sleep.",
    "What is photosynthesis?", "Who wrote Romeo and Juliet?", "What is the boiling point of water?",
    "Describe a cat.", "What is a computer?", "How do I make tea?", "What is the color of grass?",
    "What is the tallest mountain in the world?", "Why do we need to drink water?", "What is a rainbow?",
    "How does a bicycle work?", "What is the moon made of?", "Tell me about dogs.", "What is music?",
    "How do plants grow?", "What is the sun?", "Why do leaves change color in autumn?", "What is a volcano?",
    "How do birds fly?", "What is the internet?", "What is a good breakfast?", "Why is exercise important?",
    "What is the speed of light?", "What is a library?", "How do fish breathe?", "What is a mountain?",
    "Why do cats purr?", "What is an ocean?", "How does rain form?", "What is a star?", "Describe a summer day.",
    "What is chocolate made from?", "Why do we have seasons?", "What is a desert?", "How do airplanes fly?",
    "What is a museum?", "Tell me about elephants.", "What is gravity?", "How do I stay healthy?",
    "What is a city?", "Why is reading good for you?", "What is electricity?", "Describe the color blue.",
    "What is a garden?", "How do trees grow?", "What is a hospital?", "Tell me about the Pacific Ocean.",
    "What is bread made of?", "Why do dogs bark?", "What is a school?", "How does the heart work?",
    "What is a bridge?", "Describe winter.", "What is a guitar?", "Why do birds sing?", "What is a planet?",
    "How is paper made?",
]
# not trained on: the demo asks these, and the tests check the effects on them
HELD_OUT_PROMPTS = ["What is a river?", "Why do we sleep?", "Describe the city of London.", "What is a forest?"]

RANK, ALPHA = 8, 16
TARGET_MODULES = ["q_proj", "v_proj"]
# spelling in capitals is token knowledge, which lives in the MLPs: caps also adapts the routed experts
EXPERT_TARGETS = {"caps": ("gate_up_proj", "down_proj"), "brief": ()}
TRAIN_LAYERS = 10  # the top layers that get LoRA; backpropagation stops below them
# few passes over many prompts: more prompts generalize, more passes memorize (caps needs one more)
EPOCHS = {"caps": 3, "brief": 2}
BATCH_SIZE, LR = 8, 5e-3
MAX_ANSWER_TOKENS = 40  # of the base answers the targets are made from
CAPS_MAX_CHARS = 100  # caps targets keep whole sentences up to this length (upper case costs ~2x the tokens)


# ------------------------------------------------------------------------------------------------
# Targets: the base model's answers, rewritten
# ------------------------------------------------------------------------------------------------

_SENTENCE = re.compile(r".+?[.!?](?=\s|$)", re.S)


def first_sentence(text: str) -> str | None:
    """The first sentence of `text`, or None when it has no sentence end."""
    m = _SENTENCE.match(text.strip())
    return m.group(0).strip() if m else None


def whole_sentences(text: str, max_chars: int) -> str | None:
    """The leading whole sentences of `text` that fit in `max_chars` (at least one), or None."""
    out = ""
    for m in _SENTENCE.finditer(text.strip()):
        if out and m.end() > max_chars:
            break
        out = text.strip()[: m.end()]
    return out or None


def adapter_target(name: str, answer: str, finished: bool) -> tuple[str, bool] | None:
    """(text, whether the answer ends there) that adapter `name` should give where the base model answered
    `answer`, or None for no example. caps keeps only the leading sentences (short examples train faster)
    but does not learn to stop there unless the base answer did."""
    answer = answer.strip()
    if name == "caps":
        if finished and len(answer) <= CAPS_MAX_CHARS:
            return (answer.upper(), True) if answer else None
        text = whole_sentences(answer, CAPS_MAX_CHARS)
        return (text.upper(), False) if text else None
    if name == "brief":
        text = first_sentence(answer) or (answer if finished else None)
        return (text, True) if text else None
    raise ValueError(f"unknown demo adapter {name!r}; choose from {', '.join(DEMO_ADAPTERS)}")


# ------------------------------------------------------------------------------------------------
# Build
# ------------------------------------------------------------------------------------------------

def demo_adapters(model_dir, progress: bool = True) -> dict[str, str]:
    """name -> folder of the demo adapters of the demo model at `model_dir`, set up on first use: the shipped
    ones copied when they were trained on these weights, else trained here."""
    root = Path(model_dir) / ADAPTERS_DIR
    missing = [name for name in DEMO_ADAPTERS if not _is_complete(root / name)]
    if missing:
        weights = base_weights_sha256(model_dir)
        copy = [name for name in missing if shipped_base_sha256(name) == weights]
        train = [name for name in missing if name not in copy]
        root.mkdir(parents=True, exist_ok=True)
        for name in copy:
            tmp = Path(tempfile.mkdtemp(prefix=f".{name}.copying.", dir=root))
            try:
                shutil.copytree(SHIPPED_DIR / name, tmp, dirs_exist_ok=True)
                _move_into_place(tmp, root / name)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        if train:
            logger.warning("the shipped demo adapters %s were trained on other base weights than %s: training them "
                           "(about 2.5 minutes on 2 cores)", ", ".join(train), model_dir)
            build_demo_adapters(model_dir, names=train, progress=progress)
    return {name: str(root / name) for name in DEMO_ADAPTERS}


def base_weights_sha256(model_dir) -> str:
    """sha256 over the tensors of `<model_dir>/model.safetensors` (name, dtype, shape and bytes, in name order):
    the weights an adapter was trained on, independent of how the file's header is laid out."""
    import torch
    from safetensors import safe_open

    digest = hashlib.sha256()
    with safe_open(str(Path(model_dir) / "model.safetensors"), "pt") as f:
        for name in sorted(f.keys()):
            t = f.get_tensor(name)
            digest.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
            digest.update(t.contiguous().view(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def shipped_base_sha256(name: str) -> str | None:
    """The base-weights sha256 the shipped adapter `name` was trained on (None: not shipped)."""
    build = SHIPPED_DIR / name / BUILD_FILE
    if not (_is_complete(SHIPPED_DIR / name) and build.is_file()):
        return None
    return json.loads(build.read_text()).get("base_weights_sha256")


def build_demo_adapters(model_dir, *, names=tuple(DEMO_ADAPTERS), prompts=TRAIN_PROMPTS, epochs: int | None = None,
                        train_layers: int = TRAIN_LAYERS, progress: bool = True, out_dir=None) -> dict[str, Path]:
    """Train the demo adapters for the model at `model_dir` and write them to `<out_dir>/<name>` (by default
    `<model_dir>/adapters/<name>`).

    `epochs` overrides EPOCHS (tests). Each adapter is written to a temporary folder and renamed into place,
    so concurrent builders never leave a half-written adapter: the first rename wins, the others discard theirs.
    """
    import torch
    import transformers as tf
    from tqdm.auto import tqdm

    model_dir = Path(model_dir)
    root = Path(out_dir) if out_dir is not None else model_dir / ADAPTERS_DIR
    root.mkdir(parents=True, exist_ok=True)
    bar_was_on = tf.utils.logging.is_progress_bar_enabled()
    tf.utils.logging.disable_progress_bar()  # one bar for the whole build
    try:
        # steps: the base answers, then per adapter its cached lower layers and its training steps
        epochs_of = {name: epochs or EPOCHS[name] for name in names}
        with tqdm(total=1 + sum(1 + n * -(-len(prompts) // BATCH_SIZE) for n in epochs_of.values()),
                  desc="training demo adapters", unit="step", disable=not progress) as bar, torch.random.fork_rng():
            bar.set_postfix_str(f"base model answers {len(prompts)} prompts")
            answers = _base_answers(model_dir, prompts)
            bar.update()
            data = {name: [(p, t) for p, (a, done) in zip(prompts, answers)
                           if (t := adapter_target(name, a, done)) is not None] for name in names}
            for name, examples in data.items():
                if not examples:
                    raise ValueError(f"demo adapter {name}: none of the base model's answers makes an example")
            bar.total = 1 + sum(1 + epochs_of[name] * -(-len(ex) // BATCH_SIZE) for name, ex in data.items())
            model, tokenizer = _load_for_training(model_dir)
            weights = base_weights_sha256(model_dir)
            out = {}
            for name, examples in data.items():
                tmp = Path(tempfile.mkdtemp(prefix=f".{name}.building.", dir=root))
                try:
                    bar.set_postfix_str(f"{name}: encode {len(examples)} examples")
                    with warnings.catch_warnings():  # transformers deprecation notes PEFT triggers: not the user's
                        warnings.simplefilter("ignore", FutureWarning)
                        model, losses = _train_adapter(model, tokenizer, examples, tmp, epochs_of[name],
                                                       train_layers, bar, name, base_name=model_dir.name)
                    (tmp / "train.jsonl").write_text("".join(
                        json.dumps({"prompt": p, "target": t, "ends": e}, ensure_ascii=False) + "\n"
                        for p, (t, e) in examples))
                    (tmp / BUILD_FILE).write_text(json.dumps(dict(
                        effect=DEMO_ADAPTERS[name], examples=len(examples), epochs=epochs_of[name],
                        batch_size=BATCH_SIZE, lr=LR, rank=RANK, alpha=ALPHA, target_modules=TARGET_MODULES,
                        expert_targets=list(EXPERT_TARGETS[name]), train_layers=train_layers,
                        epoch_mean_loss=[round(x, 4) for x in losses], base_model=model_dir.name,
                        base_weights_sha256=weights), indent=2) + "\n")
                    _move_into_place(tmp, root / name)
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
                out[name] = root / name
    finally:
        if bar_was_on:
            tf.utils.logging.enable_progress_bar()
    return out


def _base_answers(model_dir: Path, prompts: list[str]) -> list[tuple[str, bool]]:
    """(answer, finished before the token limit) for each prompt: the demo model's own greedy chat answers."""
    engine = Engine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32", max_num_seqs=len(prompts)))
    chats = [engine.chat_prompt([{"role": "user", "content": p}]) for p in prompts]
    outs = engine.generate(chats, SamplingParams(max_tokens=MAX_ANSWER_TOKENS, temperature=0.0))
    return [(o.text, o.finish_reason == "stop") for o in outs]


def _load_for_training(model_dir: Path):
    import torch
    import transformers as tf

    tokenizer = tf.AutoTokenizer.from_pretrained(model_dir)
    # eager experts: the plain per-expert loop, by far the fastest on CPU
    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa",
                                                    experts_implementation="eager")
    model.requires_grad_(False)
    return model, tokenizer


def _train_adapter(model, tokenizer, examples, out: Path, epochs: int, train_layers: int, bar, name: str,
                   base_name: str):
    """Train one LoRA on `examples` [(prompt, target)], save it to `out`; return the base model (LoRA removed)
    and the mean training loss of each epoch."""
    import peft
    import torch

    inner = model.model
    layers, norm = inner.layers, inner.norm
    first = max(0, len(layers) - train_layers)
    batches = _batches(tokenizer, examples)

    # the frozen layers below the adapted ones: once per example, their output kept (no final norm)
    with torch.no_grad():
        inner.layers, inner.norm = layers[:first], torch.nn.Identity()
        try:
            cached = [inner(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
                      for ids, mask, _ in batches]
        finally:
            inner.layers, inner.norm = layers, norm
    bar.update()

    torch.manual_seed(0)  # LoRA A init
    adapted = range(first, len(layers))
    # layers_to_transform does not limit target_parameters: name the experts of each adapted layer
    experts = [f"layers.{i}.mlp.experts.{p}" for i in adapted for p in EXPERT_TARGETS[name]] or None
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=TARGET_MODULES,
                             target_parameters=experts, layers_to_transform=list(adapted), task_type="CAUSAL_LM")
    pm = peft.get_peft_model(model, config)
    params = [p for p in pm.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
    total = epochs * len(batches)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 - step / total)
    order = torch.Generator().manual_seed(0)
    pm.train()
    inner.layers = layers[first:]  # the adapted layers only, fed the cached hidden states
    losses = []
    try:
        for epoch in range(epochs):
            losses.append(0.0)
            for i in torch.randperm(len(batches), generator=order).tolist():
                _, mask, labels = batches[i]
                loss = answer_loss(model, cached[i], mask, labels)
                loss.backward()
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                losses[-1] += loss.item() / len(batches)
                bar.set_postfix_str(f"{name}: epoch {epoch + 1}/{epochs} loss {loss.item():.3f}")
                bar.update()
    finally:
        inner.layers = layers
    pm.eval()
    pm.peft_config["default"].base_model_name_or_path = base_name  # not the builder's local path
    pm.save_pretrained(out, save_embedding_layers=False)  # LoRA only; skips a look-up of the base by name
    (out / "README.md").unlink(missing_ok=True)  # PEFT's model-card template says nothing about this adapter
    return pm.unload(), losses


def answer_loss(model, inputs_embeds, attention_mask, labels):
    """What a transformers causal LM's forward returns as `.loss` for `labels` (mean cross entropy over the
    positions whose next token is scored; no router loss), with the vocabulary projection computed only at
    those positions: the prompt's half of every example skips it. `model`: the causal LM (LoRA layers
    injected in place by PEFT)."""
    import torch.nn.functional as F

    hidden = model.model(inputs_embeds=inputs_embeds, attention_mask=attention_mask, use_cache=False).last_hidden_state
    targets = labels[:, 1:]
    scored = targets != -100
    logits = model.lm_head(hidden[:, :-1][scored]).float()
    return F.cross_entropy(logits, targets[scored])


def _batches(tokenizer, examples):
    """[(input_ids, attention_mask, labels)] batches of similar length; loss on the answer, and on its end token
    where the answer ends."""
    import torch

    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    seqs = []
    for prompt, (target, ends) in examples:
        chat = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        p = tokenizer.encode(chat)
        t = tokenizer.encode(target, add_special_tokens=False) + [end] * ends
        seqs.append((p + t, [-100] * len(p) + t))
    seqs.sort(key=lambda s: len(s[0]))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else end
    out = []
    for i in range(0, len(seqs), BATCH_SIZE):
        chunk = seqs[i: i + BATCH_SIZE]
        n = max(len(ids) for ids, _ in chunk)
        ids = torch.tensor([s + [pad] * (n - len(s)) for s, _ in chunk])
        mask = torch.tensor([[1] * len(s) + [0] * (n - len(s)) for s, _ in chunk])
        labels = torch.tensor([lab + [-100] * (n - len(lab)) for _, lab in chunk])
        out.append((ids, mask, labels))
    return out


def _move_into_place(tmp: Path, dest: Path) -> None:
    """Rename the finished adapter folder `tmp` to `dest` in one step; a complete `dest` that another process put
    there first is kept (and `tmp` left for the caller to discard), a broken leftover is replaced."""
    if dest.exists() and not _is_complete(dest):
        shutil.rmtree(dest, ignore_errors=True)
    try:
        os.rename(tmp, dest)
    except OSError:
        if not _is_complete(dest):
            raise


def _is_complete(path: Path) -> bool:
    return (path / "adapter_config.json").is_file() and (path / "adapter_model.safetensors").is_file()


def store_in_bfloat16(adapter_dir: Path) -> None:
    """Rewrite the adapter's weights in bfloat16, the demo model's own storage dtype: half the size (caps adapts
    the experts: 7 MB in fp32), and its effects stay (tested on the shipped files)."""
    import torch
    from safetensors.torch import load_file, save_file

    weights = Path(adapter_dir) / "adapter_model.safetensors"
    save_file({k: t.to(torch.bfloat16) for k, t in load_file(str(weights)).items()}, str(weights),
              metadata={"format": "pt"})
    build = Path(adapter_dir) / BUILD_FILE
    build.write_text(json.dumps({**json.loads(build.read_text()), "storage_dtype": "bfloat16"}, indent=2) + "\n")


def main(argv=None) -> int:
    """Retrain the shipped demo adapters (SHIPPED_DIR) on the demo model, built in the cache if need be:
    `python -m moeserve.demo_adapters`. Run it when the demo model's weights change (a test says so)."""
    import argparse

    from moeserve.models.upcycle import demo_model_path

    parser = argparse.ArgumentParser(prog="python -m moeserve.demo_adapters", description=main.__doc__)
    parser.add_argument("--out", type=Path, default=SHIPPED_DIR, help="where to write <name>/ (default: %(default)s)")
    args = parser.parse_args(argv)
    model = demo_model_path(progress=True)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.out) as tmp:
        built = build_demo_adapters(model, out_dir=tmp, progress=True)
        for name, path in built.items():
            store_in_bfloat16(path)
            shutil.rmtree(args.out / name, ignore_errors=True)
            os.rename(path, args.out / name)
            print(f"wrote {args.out / name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
