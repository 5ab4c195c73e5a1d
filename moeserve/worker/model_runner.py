"""ModelRunner: owns the model, the KV cache and (on CUDA) the graph runner.

`launch` turns a ScheduledBatch into a ForwardBatch, runs the forward (graph replay for decode
batches that fit a captured bucket, eager otherwise), computes logits only for the rows that
sample (and prompt-logprob rows), samples the whole batch at once and starts one device-to-host
copy of the results — without waiting for the device. `collect` waits for that copy and returns
host-side results. So the host can schedule and launch step n+1 while the device runs step n:
step n+1's rows that continue from step n read their input token from step n's sampled tokens on
the device (see sequence.PENDING).
"""
from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

import numpy as np
import torch

from moeserve.config import EngineConfig
from moeserve.errors import InsufficientMemoryError
from moeserve.layers.batch import AttentionMetadata, ForwardBatch, LoRABatch
from moeserve.layers.sampler import SamplingTensors, compute_logprobs, row_key, sample
from moeserve.lora.slot_pool import describe_by_target, format_bytes
from moeserve.model_spec import ModelSpec
from moeserve.models.loader import load_model
from moeserve.models.moe_decoder import MoEForCausalLM
from moeserve.outputs import TokenLogprobs
from moeserve.worker.graph_runner import GraphRunner
from moeserve.worker.kv_cache import allocate_kv_cache, kv_bytes_per_block
from moeserve.worker.sequence import ScheduledBatch, Sequence, resolve_pending

logger = logging.getLogger("moeserve")

GiB = 1 << 30
# device memory kept out of the KV cache for activations, sampling and CUDA graphs
ACTIVATION_HEADROOM = 2 * GiB
CPU_KV_CAP = 2 * GiB  # CPU without a device_memory_bytes budget: no limit to plan against, so a cap
NUMPY_DTYPES = {torch.int64: np.int64, torch.int32: np.int32}  # the dtypes batch tensors are built in


@dataclass
class StepResult:
    sampled: dict[Sequence, int]  # seq -> new token id
    logprobs: dict[Sequence, TokenLogprobs]
    prompt_logprobs: dict[Sequence, list[TokenLogprobs]]


@dataclass
class InFlightStep:
    """A launched step: what it computes and where its results land on the host."""
    batch: ScheduledBatch
    sampling_seqs: list[Sequence]
    results: torch.Tensor | None  # [N] token ids, or [N, 2 + 2*top_n] fp32 with logprobs (host)
    top_n: int
    # (seq, host [count, 2 + 2*top_n] fp32): its prompt tokens scored this step (see _pack_logprobs)
    prompt_logprobs: list[tuple[Sequence, torch.Tensor]]
    done: "torch.cuda.Event | None"


class ModelRunner:
    def __init__(self, config: EngineConfig, spec: ModelSpec, model_dir: str | None, progress: bool = False,
                 model: MoEForCausalLM | None = None):
        """Loads the checkpoint at model_dir, or adopts a prebuilt `model` (benchmarks with random weights)."""
        self.config = config
        self.spec = spec
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        self.kv_dtype = config.kv_cache_torch_dtype  # float8_e4m3fn: one byte per element, twice the blocks of bf16
        self.model = model if model is not None else load_model(
            model_dir, spec, config.exec_options(), progress=progress, load_format=config.load_format,
            seed=config.seed)
        self.block_size = config.block_size
        self.max_blocks_per_seq = -(-config.max_model_len // self.block_size)
        # one (k, v) pair per layer; allocated, resized and freed here only, the model is handed them (bind_kv_caches)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_kv_blocks = 0
        self.lora_pool = None  # set by the engine when LoRA is enabled (before graph capture)
        self.graph_runner = None
        self.pin = self.device.type == "cuda"  # host buffers of async copies must be pinned
        self.prev_tokens: torch.Tensor | None = None  # sampled tokens of the last launched step (device)
        if spec.vocab_size >= 1 << 24:
            raise ValueError(f"vocab_size {spec.vocab_size} too large: token ids travel as exact fp32 (< 2^24)")

    # ---- KV cache -------------------------------------------------------------------------
    def weight_bytes(self) -> int:
        """Bytes of the model's parameters and buffers (LoRA slot buffers are the pool's, not counted here)."""
        return sum(t.numel() * t.element_size() for t in itertools.chain(self.model.parameters(),
                                                                          self.model.buffers()))

    def free_device_memory(self) -> int | None:
        """Device memory free for the KV cache now, after the weights and the LoRA pool: the device's own
        report, capped by config.device_memory_bytes (memory the engine may use in all) less what the engine
        holds. None on CPU without device_memory_bytes (nothing to plan against)."""
        cfg = self.config
        free = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else None
        if cfg.device_memory_bytes is not None:
            pool = self.lora_pool.nbytes if self.lora_pool is not None else 0
            left = cfg.device_memory_bytes - self.weight_bytes() - pool
            free = left if free is None else min(free, left)
        return free

    def allocate_kv_cache(self, num_blocks: int | None = None) -> int:
        cfg = self.config
        per_block = kv_bytes_per_block(self.spec, self.block_size, self.kv_dtype)
        if num_blocks is None:
            num_blocks = cfg.num_kv_blocks
        if num_blocks is None:
            free = None if cfg.kv_cache_memory_bytes is not None else self.free_device_memory()
            if cfg.kv_cache_memory_bytes is not None:
                budget = cfg.kv_cache_memory_bytes
            elif free is not None:
                budget = int(free * cfg.gpu_memory_utilization) - ACTIVATION_HEADROOM
            else:
                # CPU: enough for every sequence at full length, capped
                want = cfg.max_num_seqs * self.max_blocks_per_seq * per_block
                budget = min(want, CPU_KV_CAP)
            num_blocks = max(budget, 0) // per_block + 1
            if free is not None:
                self._check_fits(num_blocks, per_block, free, budget)
        num_blocks = int(num_blocks)
        if num_blocks < 2:
            raise ValueError(f"KV cache budget too small: {num_blocks} blocks of {per_block} bytes (one is "
                             "reserved for padded rows); raise num_kv_blocks (--num-kv-blocks) or "
                             "kv_cache_memory_bytes (--kv-cache-memory-bytes)")
        self._allocate_blocks(num_blocks)
        return num_blocks

    def _allocate_blocks(self, num_blocks: int) -> None:
        self.kv_caches = allocate_kv_cache(self.spec, num_blocks, self.block_size, self.kv_dtype, self.device)
        self.model.bind_kv_caches(self.kv_caches)
        self.num_kv_blocks = num_blocks
        per_block = kv_bytes_per_block(self.spec, self.block_size, self.kv_dtype)
        pool = f", LoRA slot pool {format_bytes(self.lora_pool.nbytes)}" if self.lora_pool is not None else ""
        logger.info("KV cache: %d blocks x %d tokens in %s (%s) beside weights %s%s", num_blocks, self.block_size,
                    str(self.kv_dtype).removeprefix("torch."), format_bytes(num_blocks * per_block),
                    format_bytes(self.weight_bytes()), pool)

    def resize_kv_cache(self, num_blocks: int) -> None:
        """Reallocate the cache with num_blocks blocks (tensor parallelism: every rank takes the smallest count);
        the old cache is freed first, so both never need room at once."""
        if num_blocks == self.num_kv_blocks:
            return
        self.model.bind_kv_caches([])
        self.kv_caches, self.num_kv_blocks = [], 0
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self._allocate_blocks(num_blocks)

    def _check_fits(self, num_blocks: int, per_block: int, free: int, budget: int) -> None:
        """Refuse to start unless the KV cache sized from device memory holds one max_model_len sequence
        (plus the block reserved for padded rows): weights + LoRA pool + that minimum must fit."""
        cfg = self.config
        need = self.max_blocks_per_seq + 1
        if num_blocks >= need:
            return
        pool = self.lora_pool
        pool_note = ""
        if pool is not None:
            pool_note = (f" and the LoRA slot pool ({pool.max_loras} slots x rank {pool.max_rank}: "
                         f"{format_bytes(pool.nbytes)}; {describe_by_target(pool.nbytes_by_target)})")
        fixes = []
        if pool is not None:
            fixes.append("lower --max-loras or --max-lora-rank, or list only the targets your adapters use in "
                         "--lora-target-modules (the pool)")
        fixes += ["lower --max-model-len", "raise --gpu-memory-utilization"]
        if cfg.device_memory_bytes is not None:
            fixes.append("raise --device-memory-bytes")
        raise InsufficientMemoryError(
            f"not enough device memory for the KV cache of one max_model_len={cfg.max_model_len} sequence "
            f"({format_bytes(need * per_block)} in {need} blocks of {self.block_size} tokens, one reserved): after "
            f"the weights ({format_bytes(self.weight_bytes())}){pool_note}, {format_bytes(free)} are free, and "
            f"gpu_memory_utilization={cfg.gpu_memory_utilization} of it less {format_bytes(ACTIVATION_HEADROOM)} "
            f"of headroom for activations and graphs leaves {format_bytes(max(budget, 0))} for the KV cache. "
            f"To fit: {'; '.join(fixes)}.")

    def capture_graphs(self, progress: bool = False) -> None:
        self.graph_runner = GraphRunner.for_engine(self, self.config, progress=progress)

    # ---- batch construction -----------------------------------------------------------------
    def _host(self, values, dtype) -> torch.Tensor:
        """A fresh host tensor (pinned on CUDA: graph replay and _dev copy it asynchronously, and the pinned
        allocator keeps a block from reuse until the copies that read it are done)."""
        # through numpy: a list of ints into numpy and back is ~3x faster than torch.tensor of it
        t = torch.from_numpy(np.asarray(values, dtype=NUMPY_DTYPES[dtype]))
        return t.pin_memory() if self.pin else t

    def _dev(self, values, dtype) -> torch.Tensor:
        return self._host(values, dtype).to(self.device, non_blocking=True)

    def prepare(self, sb: ScheduledBatch, on_host: bool = False) -> ForwardBatch:
        """The batch's tensors on the model's device, or in pinned host memory (`on_host`) for a graph
        replay, which copies them once into its static buffers. Token ids of PENDING tokens stay
        encoded as -(row + 1) (see resolve_pending)."""
        seqs, bs = sb.seqs, self.block_size
        if sb.is_decode:  # one row per sequence: its next input token at position num_computed_tokens
            pos = [s.num_computed_tokens for s in seqs]
            ids = [s.token_at(p) for s, p in zip(seqs, pos)]
            slots = [s.block_table[p // bs] * bs + p % bs for s, p in zip(seqs, pos)]
            token_lora = [s.lora_slot for s in seqs]
            seq_lens = [p + 1 for p in pos]
            qsl = list(range(len(seqs) + 1))
        else:
            ids, pos, slots, token_lora = [], [], [], []
            qsl, seq_lens = [0], []
            for seq, n in zip(seqs, sb.num_new_tokens):
                start = seq.num_computed_tokens
                ids.extend(seq.tokens_slice(start, start + n))
                positions = range(start, start + n)
                pos.extend(positions)
                table = seq.block_table
                slots.extend([table[p // bs] * bs + p % bs for p in positions])
                token_lora.extend([seq.lora_slot] * n)
                qsl.append(qsl[-1] + n)
                seq_lens.append(start + n)
        put = self._host if on_host else self._dev
        is_decode = sb.is_decode
        attn = AttentionMetadata(
            slot_mapping=put(slots, torch.int64),
            block_tables=put(block_table_array([s.block_table for s in seqs]), torch.int32),
            context_lens=put(seq_lens, torch.int32),
            is_decode=is_decode,
            query_start_loc=None if is_decode else put(qsl, torch.int32),
            query_start_loc_host=qsl,
            seq_lens_host=seq_lens,
            max_query_len=max(sb.num_new_tokens),
        )
        lora = None
        if self.lora_pool is not None and any(s >= 0 for s in token_lora):
            lora = LoRABatch(put(token_lora, torch.int32), self.lora_pool.slot_ranks,
                             active_slots=tuple(sorted({s for s in token_lora if s >= 0})))
        return ForwardBatch(input_ids=put(ids, torch.int64), positions=put(pos, torch.int64), attn=attn, lora=lora)

    # ---- one step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def launch(self, sb: ScheduledBatch) -> InFlightStep:
        """Enqueue the step's forward, sampling and result copy; returns without waiting for the device."""
        graphed = self.graph_runner is not None and self.graph_runner.can_run(sb)
        batch = self.prepare(sb, on_host=graphed)
        pending = self.prev_tokens if any(s.num_pending for s in sb.seqs) else None
        if graphed:
            hidden = self.graph_runner.run(sb, batch, pending)
        else:
            if pending is not None:
                resolve_pending(batch.input_ids, pending)
            hidden = self.model(batch)
        return self._sample(sb, hidden)

    @staticmethod
    def _logit_rows(sb: ScheduledBatch) -> tuple[list[int], list[Sequence], list[tuple[Sequence, int, int]]]:
        """Rows of the step's hidden states that need logits: the sampling rows (and their sequences), and
        (seq, first row, count) of the prompt tokens scored for prompt logprobs."""
        rows, sampling_seqs = [], []
        prompt_lp_rows: list[tuple[Sequence, int, int]] = []  # (seq, first row, count)
        offset = 0
        for seq, n in zip(sb.seqs, sb.num_new_tokens):
            start = seq.num_computed_tokens
            if start + n == seq.num_tokens:
                rows.append(offset + n - 1)
                sampling_seqs.append(seq)
            if seq.wants_prompt_logprobs:
                # row at position p scores prompt token p+1
                last = min(start + n, seq.num_prompt_tokens - 1)
                first = seq.num_prompt_logprobs - 1
                if last > first:
                    prompt_lp_rows.append((seq, offset + first - start, last - first))
            offset += n
        return rows, sampling_seqs, prompt_lp_rows

    def _sample(self, sb: ScheduledBatch, hidden: torch.Tensor) -> InFlightStep:
        rows, sampling_seqs, prompt_lp_rows = self._logit_rows(sb)
        step = InFlightStep(sb, sampling_seqs, None, 0, [], None)
        copies = []
        if rows:
            # decode: every row samples, in order — no gather needed
            picked = hidden if len(rows) == hidden.shape[0] else hidden[self._dev(rows, torch.int64)]
            logits = self.model.compute_logits(picked)
            params = [s.params for s in sampling_seqs]
            # an all-greedy batch draws no noise: its keys (~0.35 ms of hashing at 512 rows) are not needed
            keys = [] if all(p.greedy for p in params) else [row_key(s.noise_key, s.num_sampled)
                                                               for s in sampling_seqs]
            st = SamplingTensors.build(params, keys, logits.shape[-1], self.device, pin=self.pin)
            tokens = sample(logits, st)
            self.prev_tokens = tokens
            want_lp = [p.logprobs for p in params if p.logprobs is not None]
            if want_lp:
                step.top_n = max(want_lp)
                copies.append(("results", _pack_logprobs(logits, tokens, step.top_n)))
            else:
                copies.append(("results", tokens))
        for seq, first_row, count in prompt_lp_rows:
            logits = self.model.compute_logits(hidden[first_row:first_row + count])
            p0 = seq.num_prompt_logprobs  # index of the first prompt token scored here
            targets = self._dev(seq.prompt_token_ids[p0:p0 + count], torch.int64)
            copies.append((seq, _pack_logprobs(logits, targets, seq.params.prompt_logprobs)))
            seq.num_prompt_logprobs += count
        for what, dev in copies:  # one device-to-host copy per result tensor, none waited for here
            host = torch.empty(dev.shape, dtype=dev.dtype, pin_memory=self.pin)
            host.copy_(dev, non_blocking=self.pin)
            if what == "results":
                step.results = host
            else:
                step.prompt_logprobs.append((what, host))
        if self.pin:
            step.done = torch.cuda.Event()
            step.done.record()
        return step

    def collect(self, step: InFlightStep) -> StepResult:
        """Wait for a launched step's results and read them on the host."""
        if step.done is not None:
            step.done.synchronize()
        result = StepResult({}, {}, {})
        if step.results is not None:
            if step.top_n or step.results.dim() == 2:
                rows = step.results.tolist()
                for seq, row in zip(step.sampling_seqs, rows):
                    token = int(row[0])
                    result.sampled[seq] = token
                    k = seq.params.logprobs
                    if k is not None:
                        result.logprobs[seq] = _unpack_logprobs(row, step.top_n, k)
            else:
                for seq, token in zip(step.sampling_seqs, step.results.tolist()):
                    result.sampled[seq] = token
        for seq, host in step.prompt_logprobs:
            k = seq.params.prompt_logprobs
            result.prompt_logprobs[seq] = [_unpack_logprobs(row, k, k) for row in host.tolist()]
        return result


def block_table_array(tables: list[list[int]]) -> np.ndarray:
    """[len(tables), longest] int32, each row a block table padded with block 0 (eager attention reads only this
    many blocks). Filled through one mask, not row by row: a nested list into torch.tensor costs ~3x at B=512."""
    lens = np.fromiter(map(len, tables), np.int64, count=len(tables))
    out = np.zeros((len(tables), int(lens.max())), np.int32)
    out[np.arange(out.shape[1]) < lens[:, None]] = np.fromiter(itertools.chain.from_iterable(tables), np.int32,
                                                                 count=int(lens.sum()))
    return out


def _pack_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, top_n: int) -> torch.Tensor:
    """[N, 2 + 2*top_n] fp32: token id (exact below 2^24), its logprob, top-n logprobs, top-n ids."""
    chosen, top_v, top_i = compute_logprobs(logits, token_ids, top_n)
    cols = [token_ids.float()[:, None], chosen[:, None]]
    if top_n:
        cols += [top_v, top_i.float()]
    return torch.cat(cols, dim=1)


def _unpack_logprobs(row: list[float], top_n: int, k: int) -> TokenLogprobs:
    top = [(int(row[2 + top_n + j]), row[2 + j]) for j in range(min(k, top_n))]
    return TokenLogprobs(int(row[0]), row[1], top)
