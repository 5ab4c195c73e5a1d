"""Prometheus metrics: request latencies measured by the server, everything else read from engine.stats_per_core()
(EngineStats records, moeserve/messages.py; one per engine core).

Each app has its own CollectorRegistry, so several servers (tests) in one process never share
counters. Engine numbers are not copied into prometheus objects: a collector turns the stats
fetched for this scrape into metric families, one per field (a field that is None is left out).
"""
from __future__ import annotations

import re
from dataclasses import fields

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from moeserve.frontend.dp_client import PER_CORE_FIELDS, sum_engine_stats
from moeserve.messages import EngineStats

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1.0, 2.5)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0, 300.0)

# EngineStats field -> (metric name, kind, help)
_KNOWN = {
    "requests_total": ("moeserve_engine_requests", "counter", "Requests accepted by the engine"),
    "requests_rejected": ("moeserve_engine_requests_rejected", "counter", "Requests the engine refused"),
    "aborted_total": ("moeserve_engine_requests_aborted", "counter", "Requests aborted before finishing"),
    "prompt_tokens_total": ("moeserve_prompt_tokens", "counter", "Prompt tokens of accepted requests"),
    "generation_tokens_total": ("moeserve_generation_tokens", "counter", "Generated tokens"),
    "steps_total": ("moeserve_engine_steps", "counter", "Engine steps run"),
    "num_preemptions": ("moeserve_preemptions", "counter", "Sequences preempted for lack of KV blocks"),
    "num_running": ("moeserve_num_requests_running", "gauge", "Requests running on the engine"),
    "num_waiting": ("moeserve_num_requests_waiting", "gauge", "Requests waiting in the queue"),
    "kv_usage": ("moeserve_kv_cache_usage_ratio", "gauge", "Fraction of KV-cache blocks in use"),
    "kv_blocks_free": ("moeserve_kv_blocks_free", "gauge", "Free KV-cache blocks"),
    "kv_blocks_total": ("moeserve_kv_blocks_total", "gauge", "Usable KV-cache blocks"),
    "prefix_cache_queries": ("moeserve_prefix_cache_queries", "counter",
                             "Prompt tokens looked up in the prefix cache"),
    "prefix_cache_hits": ("moeserve_prefix_cache_hits", "counter", "Prompt tokens found in the prefix cache"),
    "prefix_cache_hit_rate": ("moeserve_prefix_cache_hit_rate", "gauge",
                              "Prefix-cache hits / queries (tokens) since start"),
    "prefix_cache_blocks": ("moeserve_prefix_cache_blocks", "gauge",
                            "KV-cache blocks holding a cached prefix (in use or evictable)"),
    "prefix_cache_evictions": ("moeserve_prefix_cache_evictions", "counter",
                               "Cached prefix blocks evicted to make room"),
    "lora_loads_total": ("moeserve_lora_loads", "counter", "LoRA adapters copied into a device slot"),
    "lora_evictions_total": ("moeserve_lora_evictions", "counter", "LoRA adapters evicted from a device slot"),
    "lora_rereads_total": ("moeserve_lora_rereads", "counter",
                           "LoRA adapters read from disk again after they fell out of the host cache"),
    "lora_adapters_known": ("moeserve_lora_adapters", "gauge", "LoRA adapters registered"),
    "lora_slots_used": ("moeserve_lora_slots_used", "gauge", "Device LoRA slots holding an adapter"),
    "lora_slots_total": ("moeserve_lora_slots", "gauge", "Device LoRA slots"),
}
_COUNTER_WORDS = ("load", "evict", "hit", "miss", "replay", "compile")


def _metric_name(key: str) -> str:
    return "moeserve_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)


def parse_graph_key(key) -> tuple[str, str]:
    """(batch_size, variant) labels of a graph-replay key: a (bs, variant) pair, a GraphKey-like
    object, or its string form such as "GraphKey(batch_size=8, variant='lora')" or "bs8/nolora"."""
    if isinstance(key, tuple) and len(key) == 2:
        return str(key[0]), str(getattr(key[1], "value", key[1]))
    if hasattr(key, "batch_size") and hasattr(key, "variant"):
        v = key.variant
        return str(key.batch_size), str(getattr(v, "value", getattr(v, "name", v)))
    text = str(key)
    bs = re.search(r"\d+", text)
    variant = re.search(r"no[_-]?lora|lora|base|none", text, re.IGNORECASE)
    return (bs.group(0) if bs else text), (variant.group(0).lower() if variant else "unknown")


class EngineStatsCollector:
    """Turns the last engine.stats_per_core() into metric families at collect time: one core's stats as they are;
    several cores' summed (sum_engine_stats), except the fields a sum would misstate (PER_CORE_FIELDS), which are
    each core's own with an `engine` label ("0", "1", ...)."""

    def __init__(self):
        self.per_core: list[EngineStats] | None = None  # None: the engine is not running

    def describe(self):
        return []  # dynamic families: nothing to check at registration

    def collect(self):
        if not self.per_core:
            return
        if len(self.per_core) == 1:
            yield from _families(self.per_core[0])
            return
        yield from _families(sum_engine_stats(self.per_core), skip=PER_CORE_FIELDS)
        for key in PER_CORE_FIELDS:
            values = [getattr(s, key) for s in self.per_core]
            if any(v is None for v in values):
                continue
            if isinstance(values[0], dict):
                fam = GaugeMetricFamily(_metric_name(key), f"engine stat {key}", labels=["engine", "key"])
                for core, value in enumerate(values):
                    for k, v in value.items():
                        fam.add_metric([str(core), str(k)], float(v))
            else:
                name, _, doc = _describe(key)
                fam = GaugeMetricFamily(name, doc, labels=["engine"])
                for core, value in enumerate(values):
                    fam.add_metric([str(core)], float(value))
            yield fam


def _describe(key: str) -> tuple[str, str, str]:
    """(metric name, kind, help) of an EngineStats field."""
    known = _KNOWN.get(key)
    if known is not None:
        return known
    # e.g. LoRA load / eviction counters: exported under their own names
    counter = key.endswith("_total") and any(w in key for w in _COUNTER_WORDS)
    return _metric_name(key[:-len("_total")] if counter else key), ("counter" if counter else "gauge"), \
        f"engine stat {key}"


def _families(stats: EngineStats, skip: tuple[str, ...] = ()):
    for f in fields(stats):
        key, value = f.name, getattr(stats, f.name)
        if key in skip:
            continue
        if key == "graph_replays" and isinstance(value, dict):
            fam = CounterMetricFamily("moeserve_graph_replays", "CUDA-graph replays per decode graph",
                                      labels=["batch_size", "variant"])
            for gkey, count in sorted(value.items(), key=lambda kv: str(kv[0])):
                fam.add_metric(list(parse_graph_key(gkey)), float(count))
            yield fam
            continue
        if isinstance(value, dict):  # other per-key numbers: one labelled gauge
            items = [(str(k), v) for k, v in value.items() if _is_number(v)]
            if items:
                fam = GaugeMetricFamily(_metric_name(key), f"engine stat {key}", labels=["key"])
                for k, v in items:
                    fam.add_metric([k], float(v))
                yield fam
            continue
        if not _is_number(value):
            continue
        name, kind, doc = _describe(key)
        cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
        yield cls(name, doc, value=float(value))


def _is_number(v) -> bool:
    return isinstance(v, (int, float))  # bools too, as 0/1


class ServerMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter("moeserve_requests", "HTTP generation requests by endpoint and status code "
                                "(499: client disconnected)", ["endpoint", "status"], registry=self.registry)
        self.ttft = Histogram("moeserve_time_to_first_token_seconds", "Time from request arrival to its first "
                              "token", buckets=TTFT_BUCKETS, registry=self.registry)
        self.tpot = Histogram("moeserve_time_per_output_token_seconds", "Mean time between output tokens "
                              "of a request, after the first", buckets=TPOT_BUCKETS, registry=self.registry)
        self.e2e = Histogram("moeserve_e2e_request_latency_seconds", "Time from request arrival to its last "
                             "token", buckets=E2E_BUCKETS, registry=self.registry)
        self._request_children: dict[tuple[str, int], object] = {}
        self.engine = EngineStatsCollector()
        self.registry.register(self.engine)

    def count_request(self, endpoint: str, status: int) -> None:
        child = self._request_children.get((endpoint, status))
        if child is None:  # labels() locks and builds its key each call; a refusal flood counts thousands
            child = self._request_children[endpoint, status] = self.requests.labels(endpoint=endpoint,
                                                                                   status=str(status))
        child.inc()

    def observe_choice(self, arrival: float, first_token: float | None, finished: float, num_tokens: int) -> None:
        if first_token is not None:
            self.ttft.observe(first_token - arrival)
            if num_tokens > 1:
                self.tpot.observe((finished - first_token) / (num_tokens - 1))
        self.e2e.observe(finished - arrival)

    def render(self, per_core: list[EngineStats] | None) -> bytes:
        """The metrics text; `per_core`: each engine core's stats (None: the engine is not running)."""
        self.engine.per_core = per_core
        return generate_latest(self.registry)
