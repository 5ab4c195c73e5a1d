"""Incremental detokenization that never emits half a multi-byte character.

Each step decodes only a short window of recent tokens (prefix_offset..end) and compares it
with the window's already-emitted part; text ending in U+FFFD waits for more tokens.
"""
from __future__ import annotations


def detokenize_step(tokenizer, state, skip_special_tokens: bool, final: bool = False) -> str:
    """Append the newly decodable text of state's tokens to state.text; return the new text.
    `state` has decode_ids (the prompt's last tokens, then the output tokens), text, prefix_offset and
    read_offset (read_offset starts after the prompt's tokens: their text is the prompt's, not ours).
    `final`: the request ended, so an incomplete character is emitted (as U+FFFD) instead of held."""
    ids = state.decode_ids
    if skip_special_tokens and not final:
        special = tokenizer.all_special_ids_set
        if ids and ids[-1] in special:
            return ""
    prefix = tokenizer.decode(ids[state.prefix_offset:state.read_offset], skip_special_tokens=skip_special_tokens)
    full = tokenizer.decode(ids[state.prefix_offset:], skip_special_tokens=skip_special_tokens)
    if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
        return ""
    new = full[len(prefix):]
    state.text += new
    state.prefix_offset = state.read_offset
    state.read_offset = len(ids)
    return new
