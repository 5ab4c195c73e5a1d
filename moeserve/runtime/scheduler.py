"""Continuous batching with chunked prefill, preemption by recompute, and LoRA-slot admission.

Each step: every running sequence gets the tokens it still needs (1 for decode; a prompt chunk
for prefill) within the token budget, oldest first; then waiting sequences are admitted while
sequence slots, token budget, KV blocks and adapter slots allow. When KV blocks run out, the
newest running sequence is preempted (its blocks freed, recomputed later) — nobody else's cache
is touched.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

from moeserve.runtime.kv_cache import BlockAllocator
from moeserve.runtime.sequence import Sequence, SeqStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.num_new_tokens) and all(
            s.num_computed_tokens + 1 == s.num_tokens for s in self.seqs)


class Scheduler:
    def __init__(self, allocator: BlockAllocator, max_num_seqs: int, max_num_batched_tokens: int,
                 chunked_prefill: bool, lora_acquire: Callable[[Sequence], bool] | None = None,
                 lora_release: Callable[[Sequence], None] | None = None):
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_tokens = max_num_batched_tokens
        self.chunked_prefill = chunked_prefill
        self.lora_acquire = lora_acquire or (lambda seq: True)
        self.lora_release = lora_release or (lambda seq: None)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.failed: list[Sequence] = []  # refused during admission (e.g. adapter unreadable); engine reports them
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.failed)

    def _chunk(self, need: int, budget: int) -> int:
        """Tokens to compute this step. Without chunked prefill a sequence runs whole — unless it can never
        fit one step's budget (a long prompt, or a recompute after preemption), which is then chunked."""
        if self.chunked_prefill or need > self.max_tokens:
            return min(need, budget)
        return need

    def schedule(self) -> ScheduledBatch | None:
        budget = self.max_tokens
        scheduled: dict[Sequence, int] = {}
        # running sequences: decodes (1 token each) first, then prefill chunks, oldest first
        for seq in sorted(self.running, key=lambda s: (s.num_tokens - s.num_computed_tokens > 1, s.arrival)):
            if seq.status != SeqStatus.RUNNING:
                continue  # preempted earlier in this loop
            if budget <= 0:
                break
            n = self._chunk(seq.num_tokens - seq.num_computed_tokens, budget)
            if n > budget:
                continue
            ok = True
            while not self.allocator.grow(seq.block_table, seq.num_computed_tokens + n):
                victim = max(self.running, key=lambda s: s.arrival)
                self._preempt(victim)
                budget += scheduled.pop(victim, 0)
                if victim is seq:
                    ok = False
                    break
            if ok:
                scheduled[seq] = n
                budget -= n
        # admit waiting sequences (FIFO; one blocked on LoRA slots holds back new adapters)
        lora_blocked = False
        skipped: list[Sequence] = []
        try:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                seq = self.waiting.popleft()
                n = self._chunk(seq.num_tokens - seq.num_computed_tokens, budget)
                if n > budget:
                    skipped.append(seq)
                    break
                if seq.lora_name is not None:
                    try:
                        got_slot = not lora_blocked and self.lora_acquire(seq)
                    except Exception as e:  # noqa: BLE001 - e.g. the adapter's files vanished: fail this request only
                        seq.error = f"{type(e).__name__}: {e}"
                        self.failed.append(seq)
                        continue
                    if not got_slot:
                        lora_blocked = True
                        skipped.append(seq)
                        continue
                if not self.allocator.grow(seq.block_table, seq.num_computed_tokens + n):
                    self.lora_release(seq)
                    skipped.append(seq)
                    break
                seq.status = SeqStatus.RUNNING
                self.running.append(seq)
                scheduled[seq] = n
                budget -= n
        finally:
            self.waiting.extendleft(reversed(skipped))
        if not scheduled:
            return None
        return ScheduledBatch(list(scheduled), list(scheduled.values()))

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.allocator.release(seq.block_table)
        self.lora_release(seq)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence wherever it is and free its resources."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.failed:
            self.failed.remove(seq)
        self.allocator.release(seq.block_table)
        self.lora_release(seq)
        seq.status = SeqStatus.FINISHED
