"""Engine.shutdown and `with Engine(...) as engine:` (issue 21): shutdown frees what the engine holds and stops its
tensor-parallel workers, so a second tensor-parallel engine can start in the same process; it is idempotent, and
an engine that was shut down refuses requests with an error that says so."""
import gc
import weakref

import pytest

from moeserve import Engine, EngineConfig, SamplingParams
from moeserve.frontend.offline_engine import EngineShutdownError

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 17, 42, 9], [300, 12, 7]]


def config(model, **kw):
    return EngineConfig(model=str(model), device="cpu", dtype="float32", block_size=4, num_kv_blocks=64,
                        max_num_seqs=4, dist_timeout=60, **kw)


def test_two_tensor_parallel_engines_one_after_the_other(tiny_models):
    model = tiny_models["qwen3_moe"]
    ref = [o.token_ids for o in Engine(config(model)).generate(PROMPTS, GREEDY)]
    for _ in range(2):  # the second would find the first's process group without shutdown
        with Engine(config(model, tensor_parallel_size=2)) as engine:
            workers = [w.proc for w in engine.runner.workers]
            assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == ref
        assert all(not p.is_alive() for p in workers)


def test_shutdown_frees_the_model_is_idempotent_and_later_calls_say_why(tiny_models):
    engine = Engine(config(tiny_models["mixtral"], enable_lora=True))
    engine.add_request(PROMPTS[0], GREEDY)  # unfinished: dropped
    engine.step()
    model = weakref.ref(engine.runner.model)
    engine.shutdown()
    engine.shutdown()
    gc.collect()
    assert model() is None  # weights (and with them the KV cache and graphs of the runner) are freed
    assert not engine.has_unfinished()
    for call in (lambda: engine.generate(PROMPTS, GREEDY), lambda: engine.add_request(PROMPTS[0]), engine.step,
                 engine.stats, lambda: engine.load_lora("a", "/nowhere"), lambda: engine.lora_version("a")):
        with pytest.raises(EngineShutdownError, match="this engine has been shut down"):
            call()


def test_a_signal_while_a_worker_starts_arrives_after_the_start():
    """The engine core's start-abandon signal raises from its handler: one landing inside a worker's start would cut
    the child's start-up data short (it died printing `EOFError: Ran out of input`, seen under load in the SIGTERM
    test). Held while a worker starts, it arrives once the worker is started and tracked."""
    import os
    import signal

    from moeserve.worker.parallel_runner import _signals_held

    class Abandoned(Exception):
        pass

    def raise_abandoned(signum, frame):
        raise Abandoned

    previous = signal.signal(signal.SIGUSR1, raise_abandoned)
    started = []
    try:
        with pytest.raises(Abandoned):
            with _signals_held():
                os.kill(os.getpid(), signal.SIGUSR1)
                started.append("worker")  # what the handler would have cut short
        assert started == ["worker"]
        assert signal.getsignal(signal.SIGUSR1) is raise_abandoned  # the handler is back
    finally:
        signal.signal(signal.SIGUSR1, previous)
