"""Continuous batching: graphed decode steps, batched prefill steps, preemption by recompute,
and LoRA-slot admission.

A step is either a decode step (every running sequence that has its next token to compute, one
row each: replayed from a CUDA graph) or a prefill step (prompt chunks of admitted and newly admitted
sequences within the token budget: eager). They never mix, so a prompt arriving never pushes the
running decodes out of their graph.

Why separate steps are worth their cost: at decode batch sizes of 64 and more nearly every expert
is touched, so any step costs about one read of all weights, and a separate prefill step reads them
again. That read is paid once per prefill step, not per prompt — so prefill steps are batched:
waiting prompts are prefilled when nothing decodes, when they fill half the token budget, or once
they have waited `prefill_delay_steps` decode steps (a bound on the extra time to first token) — but
never in two steps in a row while sequences wait to decode, so a stream of prompts cannot starve them.

When KV blocks run out, the newest running sequence is preempted (its blocks freed, recomputed
later) — nobody else's cache is touched.

Prefix caching: an admitted sequence takes the longest run of its full prompt blocks the cache holds
(under its adapter version) and starts computing at the first uncached block; at least one token is always
computed, since the last one's logits are sampled. Blocks are registered once a launched step has
computed them (their token ids are prompt tokens, known on the host). A preempted sequence's blocks stay
cached, so its recompute finds them again.

LoRA slots (more active adapters than slots): admission is FIFO, but a request whose adapter version is
already in a slot (or a base request) is admitted even when an earlier one waits for a new slot; only
requests that need a new slot queue behind that one, in order. A slot changes adapter when its adapter's
requests have drained (LRU among unused slots). So that no adapter waits forever behind resident ones
that keep getting traffic, a request that has waited `lora_max_wait_steps` steps for a new slot has one
drained for it: the longest-resident unpinned slot's adapter takes no new requests until its slot
empties and the waiting request has it (a bounded wait; each adapter gets its turn).
"""
from __future__ import annotations

from collections import deque
from typing import Protocol

from moeserve.worker.kv_cache import BlockAllocator, prefix_hashes
from moeserve.worker.sequence import ScheduledBatch, SeqStatus, Sequence


class LoRASlots(Protocol):
    """What the scheduler needs of the LoRA manager (engine/lora_manager.py)."""

    def slot_of(self, seq: Sequence) -> tuple[int, bool]: ...  # (resident slot or -1, bound to a version)
    def acquire(self, seq: Sequence) -> bool: ...  # False: no slot for it now
    def preempt(self, seq: Sequence) -> None: ...  # stops computing for now, keeps its version and slot
    def release(self, seq: Sequence) -> None: ...  # done
    def identity(self, seq: Sequence) -> tuple[str, int] | None: ...  # bound adapter version (prefix-cache key)
    def drain_victim(self) -> int: ...  # slot to drain for a request waiting for a new slot, or -1


LORA_MAX_WAIT_STEPS = 32  # steps a request may wait for a new LoRA slot before one is drained for it


class Scheduler:
    def __init__(self, allocator: BlockAllocator, max_num_seqs: int, max_num_batched_tokens: int,
                 chunked_prefill: bool, lora: LoRASlots | None = None, prefill_delay_steps: int = 0,
                 lora_max_wait_steps: int = LORA_MAX_WAIT_STEPS):
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_tokens = max_num_batched_tokens
        self.chunked_prefill = chunked_prefill
        self.prefill_delay_steps = prefill_delay_steps
        self.lora = lora
        self.lora_max_wait_steps = lora_max_wait_steps
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.failed: list[Sequence] = []  # refused during admission (e.g. adapter unreadable); engine reports them
        self.num_preemptions = 0
        self._decode_steps_waited = 0  # decode steps run while prefill work waited
        self._last_was_prefill = False
        self.num_steps = 0  # schedule() calls: the clock of waiting times
        self._added_at: dict[Sequence, int] = {}  # waiting, never admitted -> step it arrived
        self.lora_drain_slot = -1  # slot drained for a starving request (-1: none); exposed for stats/tests
        self.prefix_cache_queries = 0  # tokens of admitted sequences looked up in the prefix cache
        self.prefix_cache_hits = 0  # of them, tokens found cached

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self._added_at[seq] = self.num_steps

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.failed)

    @staticmethod
    def _remaining(seq: Sequence) -> int:
        return seq.num_tokens - seq.num_computed_tokens

    @staticmethod
    def _sampled_all(seq: Sequence) -> bool:
        """Its last token is sampled (maybe still in flight): nothing left to compute."""
        return seq.num_sampled >= seq.params.max_tokens

    def _chunk(self, need: int, budget: int) -> int:
        """Tokens to compute this step. Without chunked prefill a sequence runs whole — unless it can never
        fit one step's budget (a long prompt, or a recompute after preemption), which is then chunked."""
        if self.chunked_prefill or need > self.max_tokens:
            return min(need, budget)
        return need

    def schedule(self) -> ScheduledBatch | None:
        self.num_steps += 1
        decodes = [s for s in self.running if self._remaining(s) == 1 and not self._sampled_all(s)]
        prefilling = [s for s in self.running if self._remaining(s) > 1]
        # never two prefill steps in a row while sequences wait to decode: a steady stream of prompts
        # must not starve the running requests
        if (self.waiting or prefilling) and (not decodes or (not self._last_was_prefill
                                                             and self._prefill_due(prefilling))):
            sb = self._schedule_prefill(prefilling, may_preempt=not decodes)
            if sb is not None:
                self._decode_steps_waited = 0
                self._last_was_prefill = True
                return sb
        self._last_was_prefill = False
        if not decodes:
            return None
        if self.waiting or prefilling:
            self._decode_steps_waited += 1
        return self._schedule_decode(decodes)

    def _prefill_due(self, prefilling: list[Sequence]) -> bool:
        if self._decode_steps_waited >= self.prefill_delay_steps:
            return True
        want, room = sum(self._remaining(s) for s in prefilling), self.max_num_seqs - len(self.running)
        for seq in self.waiting:  # enough admissible prompt tokens to be worth a read of the weights?
            if want >= self.max_tokens // 2 or room <= 0:
                break
            want += self._remaining(seq) - len(self._cached_prefix(seq)) * self.allocator.block_size
            room -= 1
        return want >= self.max_tokens // 2

    def _grow(self, seq: Sequence, num_tokens: int, scheduled: dict[Sequence, int]) -> bool:
        """Blocks for seq's first num_tokens, preempting the newest running sequences if short;
        False if seq itself had to go."""
        while not self.allocator.grow(seq.block_table, num_tokens):
            victim = max(self.running, key=lambda s: s.arrival)
            self._preempt(victim)
            scheduled.pop(victim, None)
            if victim is seq:
                return False
        return True

    def _schedule_decode(self, decodes: list[Sequence]) -> ScheduledBatch | None:
        scheduled: dict[Sequence, int] = {}
        for seq in sorted(decodes, key=lambda s: s.arrival):
            if seq.status == SeqStatus.RUNNING and self._grow(seq, seq.num_computed_tokens + 1, scheduled):
                scheduled[seq] = 1
        if not scheduled:
            return None
        return ScheduledBatch(list(scheduled), [1] * len(scheduled), is_decode=True)

    def _schedule_prefill(self, prefilling: list[Sequence], may_preempt: bool) -> ScheduledBatch | None:
        """Prompt chunks. A chunk short of KV blocks waits while decodes run (they free blocks as they
        finish); only when nothing decodes does it preempt the newest sequence, never one preempted in
        this very call (that would thrash: admitted, preempted, admitted again)."""
        scheduled: dict[Sequence, int] = {}
        preempted = self.num_preemptions
        for seq in sorted(prefilling, key=lambda s: s.arrival):  # prompts already under way first
            budget = self.max_tokens - sum(scheduled.values())  # a preempted victim gives its share back
            if seq.status != SeqStatus.RUNNING or budget <= 0:
                continue
            n = self._chunk(self._remaining(seq), budget)
            if n > budget:
                continue
            if may_preempt:
                if self._grow(seq, seq.num_computed_tokens + n, scheduled):
                    scheduled[seq] = n
            elif self.allocator.grow(seq.block_table, seq.num_computed_tokens + n):
                scheduled[seq] = n
        if self.num_preemptions != preempted:
            return ScheduledBatch(list(scheduled), list(scheduled.values()), is_decode=False) if scheduled else None
        budget = self.max_tokens - sum(scheduled.values())
        # admit waiting sequences: FIFO, except that LoRA slot waits only hold back requests needing a new slot
        lora_blocked = False  # a request needing a new slot got none: later ones needing one queue behind it
        drain = self._lora_drain_slot()
        skipped: list[Sequence] = []
        try:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                seq = self.waiting.popleft()
                if seq.lora_name is not None and self.lora is not None:
                    slot, bound = self.lora.slot_of(seq)
                    if (slot < 0 and lora_blocked) or (slot >= 0 and slot == drain and not bound):
                        skipped.append(seq)  # behind the blocked one / its adapter's slot is being drained
                        continue
                    try:
                        got_slot = self.lora.acquire(seq)
                    except Exception as e:  # noqa: BLE001 - e.g. the adapter's files vanished: fail this request only
                        seq.error = f"{type(e).__name__}: {e}"
                        self.failed.append(seq)
                        self._added_at.pop(seq, None)
                        continue
                    if not got_slot:
                        lora_blocked = True
                        skipped.append(seq)
                        continue
                cached = self._cached_prefix(seq)  # after acquire: the key holds the version it runs with
                num_cached = len(cached) * self.allocator.block_size
                n = self._chunk(self._remaining(seq) - num_cached, budget)
                if n > budget or not self.allocator.grow(seq.block_table, num_cached + n, cached):
                    if self.lora is not None and seq.lora_name is not None:
                        self.lora.preempt(seq)  # keeps the slot it just got: it is first in line
                    skipped.append(seq)
                    break
                seq.num_computed_tokens = num_cached
                seq.num_hashed_blocks = len(cached)
                if seq.num_cached_tokens is None:
                    seq.num_cached_tokens = num_cached
                if self.allocator.enable_prefix_caching:
                    self.prefix_cache_queries += seq.num_tokens
                    self.prefix_cache_hits += num_cached
                seq.status = SeqStatus.RUNNING
                self.running.append(seq)
                self._added_at.pop(seq, None)
                scheduled[seq] = n
                budget -= n
        finally:
            self.waiting.extendleft(reversed(skipped))
        if not scheduled:
            return None
        return ScheduledBatch(list(scheduled), list(scheduled.values()), is_decode=False)

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks seq can start from (not yet taken); none while its adapter version is unbound."""
        if not self.allocator.enable_prefix_caching:
            return []
        if seq.block_hashes is None:  # a sequence keeps its adapter version to its end, preempted or not
            key = None
            if seq.lora_name is not None and self.lora is not None:
                key = self.lora.identity(seq)  # bound by acquire, before admission looks here
                if key is None:
                    return []
            seq.block_hashes = prefix_hashes(seq.prompt_token_ids, self.allocator.block_size, key)
        if seq.wants_prompt_logprobs:
            return []  # every prompt position's logits are wanted: compute them all (its blocks are still cached)
        return self.allocator.match(seq.block_hashes[:(seq.num_tokens - 1) // self.allocator.block_size])

    def cache_computed_blocks(self, sb: ScheduledBatch) -> None:
        """After `sb` was launched (num_computed_tokens advanced): register the full prompt blocks it computed.
        Decode steps compute no prompt token (a prompt is whole before its first decode), so they skip the rows."""
        if sb.is_decode or not self.allocator.enable_prefix_caching:
            return
        bs = self.allocator.block_size
        for seq in sb.seqs:
            hashes = seq.block_hashes
            if hashes is None or seq.num_hashed_blocks >= len(hashes):
                continue
            full = min(seq.num_computed_tokens // bs, len(hashes))
            for i in range(seq.num_hashed_blocks, full):
                self.allocator.register(seq.block_table[i], hashes[i])
            seq.num_hashed_blocks = max(full, seq.num_hashed_blocks)

    def _lora_drain_slot(self) -> int:
        """Bounded wait for LoRA slots: once the oldest request needing a new slot has waited
        lora_max_wait_steps, the slot the manager picks takes no new requests until it is free."""
        self.lora_drain_slot = -1
        if self.lora is None:
            return -1
        for seq in self.waiting:  # the oldest request that needs a new slot (others get theirs without waiting)
            if seq.lora_name is not None and self.lora.slot_of(seq)[0] < 0:
                if self.num_steps - self._added_at.get(seq, self.num_steps) > self.lora_max_wait_steps:
                    self.lora_drain_slot = self.lora.drain_victim()
                break
        return self.lora_drain_slot

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.allocator.release(seq.block_table)  # its computed prompt blocks stay cached for the recompute
        if self.lora is not None and seq.lora_name is not None:
            self.lora.preempt(seq)
        seq.num_computed_tokens = 0
        seq.num_hashed_blocks = 0
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
        self._added_at.pop(seq, None)
        self.allocator.release(seq.block_table)
        if self.lora is not None and seq.lora_name is not None:
            self.lora.release(seq)
        seq.status = SeqStatus.FINISHED
