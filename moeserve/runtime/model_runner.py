"""ModelRunner: owns the model, the KV cache and (on CUDA) the graph runner.

It turns a ScheduledBatch into a ForwardBatch, runs the forward (graph replay for decode
batches that fit a captured bucket, eager otherwise), then computes logits only for the rows
that sample (and prompt-logprob rows), samples, and returns host-side results.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from moeserve.config import EngineConfig
from moeserve.layers.sampler import compute_logprobs, sample
from moeserve.models.loader import load_model
from moeserve.models.moe_decoder import MoEForCausalLM
from moeserve.models.spec import ModelSpec
from moeserve.runtime.context import AttentionMetadata, ForwardBatch, LoRABatch
from moeserve.runtime.kv_cache import allocate_kv_cache, kv_bytes_per_block
from moeserve.runtime.scheduler import ScheduledBatch
from moeserve.runtime.sequence import Sequence, TokenLogprobs

logger = logging.getLogger("moeserve")


@dataclass
class StepResult:
    sampled: dict[Sequence, int]  # seq -> new token id
    logprobs: dict[Sequence, TokenLogprobs]
    prompt_logprobs: dict[Sequence, list[TokenLogprobs]]


class ModelRunner:
    def __init__(self, config: EngineConfig, spec: ModelSpec, model_dir: str | None, progress: bool = False,
                 model: MoEForCausalLM | None = None):
        """Loads the checkpoint at model_dir, or adopts a prebuilt `model` (benchmarks with random weights)."""
        self.config = config
        self.spec = spec
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        lora_backend = config.moe_backend  # dense LoRA kernels travel with the MoE backend choice
        self.model = model if model is not None else load_model(
            model_dir, spec, self.device, self.dtype, config.attention_backend, config.moe_backend, lora_backend,
            progress=progress)
        self.block_size = config.block_size
        self.max_blocks_per_seq = -(-config.max_model_len // self.block_size)
        self.lora_pool = None  # set by the engine when LoRA is enabled (before graph capture)
        self.graph_runner = None
        self.default_generator = torch.Generator(device=self.device)
        self.default_generator.manual_seed(config.seed)

    # ---- KV cache -------------------------------------------------------------------------
    def allocate_kv_cache(self, num_blocks: int | None = None) -> int:
        cfg = self.config
        per_block = kv_bytes_per_block(self.spec, self.block_size, self.dtype)
        if num_blocks is None:
            num_blocks = cfg.num_kv_blocks
        if num_blocks is None:
            if cfg.kv_cache_memory_bytes is not None:
                budget = cfg.kv_cache_memory_bytes
            elif self.device.type == "cuda":
                free, _total = torch.cuda.mem_get_info(self.device)
                budget = int(free * cfg.gpu_memory_utilization) - (2 << 30)  # headroom: activations, graphs
            else:
                # CPU: enough for every sequence at full length, capped
                want = cfg.max_num_seqs * self.max_blocks_per_seq * per_block
                budget = min(want, 2 << 30)
            num_blocks = budget // per_block + 1
        num_blocks = int(num_blocks)
        if num_blocks < 2:
            raise ValueError(f"KV cache budget too small: {num_blocks} blocks of {per_block} bytes")
        self.model.kv_caches = allocate_kv_cache(self.spec, num_blocks, self.block_size, self.dtype, self.device)
        logger.info("KV cache: %d blocks x %d tokens (%.1f MiB)", num_blocks, self.block_size,
                    num_blocks * per_block / 2**20)
        return num_blocks

    # ---- batch construction -----------------------------------------------------------------
    def prepare(self, sb: ScheduledBatch, on_host: bool = False) -> ForwardBatch:
        """The batch's tensors on the model's device, or on the host (`on_host`) for a graph replay,
        which copies them once into its static buffers."""
        bs = self.block_size
        ids, pos, slots, token_lora, block_tables = [], [], [], [], []
        qsl, seq_lens = [0], []
        width = max(len(s.block_table) for s in sb.seqs)  # eager attention reads only this many blocks
        for seq, n in zip(sb.seqs, sb.num_new_tokens):
            start = seq.num_computed_tokens
            ids.extend(seq.tokens_slice(start, start + n))
            for p in range(start, start + n):
                pos.append(p)
                slots.append(seq.block_table[p // bs] * bs + p % bs)
            token_lora.extend([seq.lora_slot] * n)
            block_tables.append(seq.block_table + [0] * (width - len(seq.block_table)))
            qsl.append(qsl[-1] + n)
            seq_lens.append(start + n)
        dev = torch.device("cpu") if on_host else self.device
        is_decode = sb.is_decode
        attn = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=torch.tensor(block_tables, dtype=torch.int32, device=dev),
            context_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            is_decode=is_decode,
            query_start_loc=None if is_decode else torch.tensor(qsl, dtype=torch.int32, device=dev),
            query_start_loc_host=qsl,
            seq_lens_host=seq_lens,
            max_query_len=max(sb.num_new_tokens),
        )
        lora = None
        if self.lora_pool is not None and any(s >= 0 for s in token_lora):
            lora = LoRABatch(torch.tensor(token_lora, dtype=torch.int32, device=dev), self.lora_pool.slot_ranks,
                             active_slots=tuple(sorted({s for s in token_lora if s >= 0})))
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(pos, dtype=torch.int64, device=dev),
            attn=attn,
            lora=lora,
        )

    # ---- one step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, sb: ScheduledBatch) -> StepResult:
        graphed = self.graph_runner is not None and self.graph_runner.can_run(sb)
        batch = self.prepare(sb, on_host=graphed)
        hidden = self.graph_runner.run(sb, batch) if graphed else self.model(batch)
        return self._sample(sb, hidden)

    def _sample(self, sb: ScheduledBatch, hidden: torch.Tensor) -> StepResult:
        rows, sampling_seqs = [], []
        prompt_lp_rows: list[tuple[Sequence, int, int]] = []  # (seq, first row, count)
        offset = 0
        for seq, n in zip(sb.seqs, sb.num_new_tokens):
            start = seq.num_computed_tokens
            if start + n == seq.num_tokens:
                rows.append(offset + n - 1)
                sampling_seqs.append(seq)
            if seq.prompt_logprobs is not None and len(seq.prompt_logprobs) < seq.num_prompt_tokens:
                # row at position p scores prompt token p+1
                last = min(start + n, seq.num_prompt_tokens - 1)
                first = len(seq.prompt_logprobs) - 1
                if last > first:
                    prompt_lp_rows.append((seq, offset + first - start, last - first))
            offset += n
        result = StepResult({}, {}, {})
        if rows:
            # decode: every row samples, in order — no gather needed
            picked = hidden if len(rows) == hidden.shape[0] else hidden[torch.tensor(rows, device=hidden.device)]
            logits = self.model.compute_logits(picked)
            params = [s.params for s in sampling_seqs]
            gens = [self._generator(s) for s in sampling_seqs]
            tokens = sample(logits, params, gens, self.default_generator)
            want_lp = [s for s in sampling_seqs if s.logprobs is not None]
            tokens_host = tokens.tolist()
            if want_lp:
                top_n = max(s.params.logprobs for s in want_lp)
                chosen, top_v, top_i = compute_logprobs(logits, tokens, top_n)
                chosen, top_v, top_i = chosen.tolist(), top_v.tolist() if top_v is not None else None, \
                    top_i.tolist() if top_i is not None else None
            for i, seq in enumerate(sampling_seqs):
                result.sampled[seq] = tokens_host[i]
                if seq.logprobs is not None:
                    k = seq.params.logprobs
                    top = list(zip(top_i[i][:k], top_v[i][:k])) if k and top_i is not None else []
                    result.logprobs[seq] = TokenLogprobs(tokens_host[i], chosen[i], top)
        for seq, first_row, count in prompt_lp_rows:
            logits = self.model.compute_logits(hidden[first_row:first_row + count])
            p0 = len(seq.prompt_logprobs)  # index of the first prompt token scored here
            targets = torch.tensor(seq.prompt_token_ids[p0:p0 + count], device=logits.device)
            chosen, top_v, top_i = compute_logprobs(logits, targets, seq.params.prompt_logprobs)
            chosen = chosen.tolist()
            top_v = top_v.tolist() if top_v is not None else None
            top_i = top_i.tolist() if top_i is not None else None
            result.prompt_logprobs[seq] = [
                TokenLogprobs(seq.prompt_token_ids[p0 + j], chosen[j],
                              list(zip(top_i[j], top_v[j])) if top_i is not None else [])
                for j in range(count)
            ]
        return result

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        if seq.params.seed is None or seq.params.greedy:
            return None
        if seq.generator is None:
            seq.generator = torch.Generator(device=self.device)
            seq.generator.manual_seed(seq.params.seed)
        return seq.generator
