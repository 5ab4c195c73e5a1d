"""Incremental detokenization that never emits half a multi-byte character.

Each step decodes only a short window of recent tokens (prefix_offset..end) and compares it
with the window's already-emitted part; text ending in U+FFFD waits for more tokens.
"""
from __future__ import annotations

from moeserve.runtime.sequence import Sequence


def detokenize_step(tokenizer, seq: Sequence, skip_special_tokens: bool, final: bool = False) -> str:
    """Append the newly decodable text of seq's output tokens to seq.text; return the new text.
    `final`: the sequence ended, so an incomplete character is emitted (as U+FFFD) instead of held."""
    ids = seq.output_token_ids
    if skip_special_tokens and not final:
        special = tokenizer.all_special_ids_set
        if ids and ids[-1] in special:
            return ""
    prefix = tokenizer.decode(ids[seq.prefix_offset:seq.read_offset], skip_special_tokens=skip_special_tokens)
    full = tokenizer.decode(ids[seq.prefix_offset:], skip_special_tokens=skip_special_tokens)
    if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
        return ""
    new = full[len(prefix):]
    seq.text += new
    seq.prefix_offset = seq.read_offset
    seq.read_offset = len(ids)
    return new


class TokenizerWrapper:
    """Thin wrapper: HF tokenizer plus a cached set of special ids and chat templating."""

    def __init__(self, hf_tokenizer):
        self.tok = hf_tokenizer
        self.all_special_ids_set = set(hf_tokenizer.all_special_ids)
        self.eos_token_id = hf_tokenizer.eos_token_id

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict]) -> str:
        if not getattr(self.tok, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; use a plain completion prompt")
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
