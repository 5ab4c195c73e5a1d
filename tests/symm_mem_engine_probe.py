"""Test helper, run as a script in a fresh interpreter: one TP=2 engine with the symmetric-memory all-reduce.

Symmetric memory serves the first tensor-parallel engine of a process (parallel_state._symm_mem_rendezvoused), so
the GPU tests that need it start it here, not in pytest's process. Writes JSON: the backend each rank chose, the
outputs of the traffic waves, graph replays, and how shutdown went (bounded: a hang is what its order prevents).

    python symm_mem_engine_probe.py MODEL ADAPTER DTYPE EXPERT_PARALLEL EAGER OUT.json
"""
import json
import logging
import sys
import threading

import torch

from moeserve import Engine, EngineConfig, SamplingParams

WAVES = [[None, None, None], ["ad", None, "ad"], [None], ["ad"], [None, None, None, None, None]]


def prompts(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (int(k),), generator=g).tolist() for k in torch.randint(3, 12, (n,), generator=g)]


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def main(model, adapter, dtype, expert_parallel, eager, out_path) -> None:
    records = _Records()
    logging.getLogger("moeserve").addHandler(records)
    engine = Engine(EngineConfig(model=model, device="cuda", dtype=dtype, block_size=16, max_num_seqs=8,
                                 max_lora_rank=8, lora_modules={"ad": adapter}, tensor_parallel_size=2,
                                 enable_expert_parallel=expert_parallel == "1", enforce_eager=eager == "1",
                                 cuda_graph_bs=[1, 2, 4, 8], num_kv_blocks=256, dist_timeout=60))
    runner = engine.runner
    result = {"backends": {0: runner.tp.all_reduce_backend, **runner.worker_all_reduce_backends()}}
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    outs = [engine.generate(prompts(len(w), seed=i), sp, lora=w) for i, w in enumerate(WAVES)]
    result["waves"] = [[{"tokens": o.token_ids, "logprobs": [lp.logprob for lp in o.logprobs]} for o in wave]
                       for wave in outs]
    result["replays"] = sum(runner.graph_runner.replay_counts().values()) if runner.graph_runner else 0
    worker = runner.workers[0].proc
    leaving = threading.Thread(target=runner.shutdown, daemon=True)
    leaving.start()
    leaving.join(180)  # the teardown's own watchdog aborts after dist_timeout (60 s): far inside this bound
    result["shutdown_returned"] = not leaving.is_alive()
    result["teardown_aborted"] = any("teardown did not finish" in m for m in records.messages)
    worker.join(30)
    result["worker_exitcode"] = worker.exitcode
    result["group_left"] = not torch.distributed.is_initialized()
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
