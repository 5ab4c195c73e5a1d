"""Start-up warm-up: run the eager (prefill) forwards the engine will run, so every kernel variant is compiled
and launched before the first request, not inside it.

Triton compiles a kernel once per set of compile-time constants (a MoE plan's tiles, LoRA or not) and per
specialization of its integer arguments (a value of 1, a multiple of 16), and the first launch of each pays that
compile: seconds per variant, across ~10 kernels a layer uses. Decode sizes are compiled by graph capture; this
covers the eager steps: prefill chunks of every MoE plan tier, token counts of both specializations, one and
several sequences, with a prompt prefix in the cache or not, and each with and without adapters. A variant that
cannot run on this device (a tile too large for its shared memory, say) fails here, at start-up, with its shape
named. Triton's on-disk cache makes a second start's warm-up mostly loads, not compiles.

The forwards write K/V only into the dummy block 0 and sample greedily; nothing they compute is kept.
"""
from __future__ import annotations

import logging
import time

from moeserve.sampling_params import SamplingParams
from moeserve.worker.sequence import ScheduledBatch, Sequence

logger = logging.getLogger("moeserve")

# token counts at and either side of the MoE plans' tier edges (pairs 64 / 512 / 2048 at top-8, and the tuned
# table's rows), each as a multiple of 16 and as an odd count
WARM_TOKENS = (1, 3, 8, 16, 17, 33, 64, 65, 127, 256, 257, 511, 1024, 1025, 2047, 4096, 4097, 8192)


def _variant_key(t: int, top_k: int) -> tuple:
    """What a token count decides at compile time: kernels size tiles and program counts by the next power of two
    of the tokens or of the (token, expert) pairs (the MoE alignment's chunk and chunk count, the tuned tile
    table's rows), and Triton specializes integers on 1 and multiples of 16."""
    return _next_pow2(t), _next_pow2(t * top_k), t == 1, t % 16 == 0


def _next_pow2(n: int) -> int:
    # as triton.next_power_of_2, which the kernels size by; this module does not import triton (the CLI would pay)
    return 1 << (n - 1).bit_length()


def warmup_token_counts(max_batched_tokens: int, top_k: int = 1) -> list[int]:
    """Token counts of the warm-up prefills: WARM_TOKENS, the smallest count of every `_variant_key` (for a
    model routing each token to `top_k` experts), and the largest step, all within the step's token budget (a
    step batches several prompts, so its count is not bounded by one sequence's length)."""
    firsts: dict[tuple, int] = {}
    for t in range(1, max_batched_tokens + 1):
        firsts.setdefault(_variant_key(t, top_k), t)
    return sorted({t for t in WARM_TOKENS if t <= max_batched_tokens} | set(firsts.values()) | {max_batched_tokens})


def _sequence(num_tokens: int, context: int, lora_slot: int, block_size: int) -> Sequence:
    """A sequence whose next `num_tokens` prompt tokens follow `context` cached ones, all in the dummy block."""
    seq = Sequence("warmup", [1] * (context + num_tokens), SamplingParams(max_tokens=1, temperature=0.0))
    seq.num_computed_tokens = context
    seq.block_table = [0] * -(-(context + num_tokens) // block_size)
    seq.lora_slot = lora_slot
    return seq


def _split(num_tokens: int, parts: int) -> list[int]:
    """`parts` counts summing to num_tokens, none more than one above another."""
    q, r = divmod(num_tokens, parts)
    return [q + 1] * r + [q] * (parts - r)


def warmup_batches(token_counts: list[int], lora_slots: list[int], block_size: int,
                   max_seq_tokens: int | None = None) -> list[ScheduledBatch]:
    """For each count and LoRA slot (-1: none): one fresh prompt; from 2 tokens, two prompts of which the second
    continues a cached prefix of one block (a prefix-cache hit or a later prefill chunk); from 32 tokens, 16
    prompts (sequence counts specialize like token counts). No sequence holds more than `max_seq_tokens` tokens
    (with its cached prefix): a count that fits none of those shapes runs as that many tokens over the fewest
    prompts that hold it."""
    cap = max_seq_tokens or max(token_counts, default=1) + block_size
    batches = []
    for slot in lora_slots:
        for n in token_counts:
            shapes = 0
            if n <= cap:
                batches.append(ScheduledBatch([_sequence(n, 0, slot, block_size)], [n], False))
                shapes += 1
            if n >= 2 and -(-n // 2) + block_size <= cap:
                first, second = _split(n, 2)
                seqs = [_sequence(first, 0, slot, block_size), _sequence(second, block_size, slot, block_size)]
                batches.append(ScheduledBatch(seqs, [first, second], False))
                shapes += 1
            if n >= 32 and -(-n // 16) <= cap:
                sizes = _split(n, 16)
                batches.append(ScheduledBatch([_sequence(k, 0, slot, block_size) for k in sizes], sizes, False))
                shapes += 1
            if not shapes:
                sizes = _split(n, -(-n // cap))
                batches.append(ScheduledBatch([_sequence(k, 0, slot, block_size) for k in sizes], sizes, False))
    return batches


def eager_decode_sizes(max_num_seqs: int, graph_max_bs: int | None) -> list[int]:
    """Decode batch sizes that run eagerly (all of them without graphs; those above the largest graph with):
    WARM_TOKENS in that range and the largest batch."""
    low = 0 if graph_max_bs is None else graph_max_bs
    return sorted({b for b in WARM_TOKENS if low < b <= max_num_seqs} | ({max_num_seqs} if max_num_seqs > low else set()))


def decode_split_shapes(sizes: range, max_blocks: int, splits_of) -> list[tuple[int, int]]:
    """(batch, context blocks) of eager decode steps covering every split count `splits_of(batch, blocks)` takes
    for batches in `sizes` and contexts of 1..max_blocks blocks (the decode attention kernel is compiled once per
    split count, which depends on both), the smallest of each."""
    shapes: dict[int, tuple[int, int]] = {}
    for blocks in range(1, max_blocks + 1):
        for b in sizes:
            shapes.setdefault(splits_of(b, blocks), (b, blocks))
    return sorted(set(shapes.values()))


def decode_batches(shapes: list[tuple[int, int]], lora_slots: list[int], block_size: int) -> list[ScheduledBatch]:
    """Eager decode steps: (B, context blocks) -> B sequences of that many cached blocks, one new token each."""
    return [ScheduledBatch([_sequence(1, blocks * block_size - 1, slot, block_size) for _ in range(b)], [1] * b, True)
            for slot in lora_slots for b, blocks in shapes]


def warm_up(runner, token_counts: list[int], with_lora: bool, block_size: int,
            decode_shapes: list[tuple[int, int]] = (), max_seq_tokens: int | None = None) -> float:
    """Run the warm-up batches through `runner` (launch and collect, as a step does): prefills of `token_counts`
    tokens and eager decode steps of `decode_shapes` (batch, context blocks); seconds taken. LoRA batches use
    slot 0 whatever it holds: the kernels compile the same for an empty slot (rank 0)."""
    t0 = time.perf_counter()
    slots = [-1, 0] if with_lora else [-1]
    for batch in (warmup_batches(token_counts, slots, block_size, max_seq_tokens)
                  + decode_batches(list(decode_shapes), slots, block_size)):
        runner.collect(runner.launch(batch))
    runner.prev_tokens = None
    seconds = time.perf_counter() - t0
    logger.info("warm-up: %d prefill and %d eager decode shapes%s compiled and run in %.1f s", len(token_counts),
                len(decode_shapes),
                " with and without adapters" if with_lora else "", seconds)
    return seconds


def compile_details(hook_kwargs: dict) -> str:
    """The constants and specialization attributes Triton's cache hook was given (top-level in recent Triton
    releases, under "compile" in earlier ones)."""
    details = hook_kwargs.get("compile") if isinstance(hook_kwargs.get("compile"), dict) else hook_kwargs
    return f"constants={details.get('constants')} attrs={details.get('configs')}"


class CompileWatch:
    """After start-up: counts, and logs by name, every Triton kernel variant first launched on the request path
    (compiled, or loaded from Triton's on-disk cache), which the requests of that step waited for: a shape the
    warm-up did not reach. Installed once per engine core (Triton's hook is process-wide: the one found is chained
    and put back on close)."""

    def __init__(self):
        from triton import knobs  # here, not at the top: `import moeserve` does not import triton

        self.count = 0
        self._runtime = knobs.runtime
        self._previous = knobs.runtime.jit_cache_hook
        knobs.runtime.jit_cache_hook = self._hook

    def _hook(self, *args, **kwargs):
        self.count += 1
        spec = str(kwargs.get("repr") or kwargs.get("key") or "?")  # name[options](argument types and alignments)
        name = spec.split("[")[0].split("(")[0]
        # the compile-time constants and the specialization attributes (which arguments were 1, or multiples of
        # 16): what tells one variant from another; on one line, so a log grep keeps all of it
        spec = " ".join(f"{spec} key={kwargs.get('key')} {compile_details(kwargs)}".split())
        logger.warning("kernel %s compiled on the request path: the start-up warm-up did not reach this variant "
                       "(%d so far): %s", name, self.count, spec[:4000])
        return self._previous(*args, **kwargs) if self._previous else None

    def close(self) -> None:
        if self._runtime.jit_cache_hook == self._hook:
            self._runtime.jit_cache_hook = self._previous

