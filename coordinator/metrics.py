"""Prometheus metrics of the coordinator, plus each worker's figures as reported in its heartbeats."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self, workers_view, placed_again=dict):
        """workers_view: a callable returning the live WorkerInfo list; placed_again: one returning how many
        requests were placed again after their worker died, by when (both read at scrape time)."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("pdserve_time_to_first_token_seconds", "Time to first token", buckets=_LATENCY_BUCKETS,
                              registry=r)
        self.itl = Histogram("pdserve_inter_token_latency_seconds", "Time between streamed tokens",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("pdserve_e2e_request_latency_seconds", "Request latency, arrival to last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("pdserve_generation_tokens", "Generated tokens", registry=r)
        self.requests = Counter("pdserve_requests", "Requests by outcome", ["outcome"], registry=r)
        r.register(_WorkerCollector(workers_view))
        r.register(_PlacementCollector(placed_again))


class _PlacementCollector:
    def __init__(self, placed_again):
        self.placed_again = placed_again

    def collect(self):
        c = CounterMetricFamily("pdserve_requests_placed_again", "Requests placed again because their worker "
                                "died, before their first token or mid-stream", labels=["when"])
        for when, n in self.placed_again().items():
            c.add_metric([when], n)
        yield c


class _WorkerCollector:
    def __init__(self, workers_view):
        self.workers_view = workers_view

    def collect(self):
        labels = ["role", "worker"]
        g = {
            "queue": GaugeMetricFamily("pdserve_queue_depth", "Requests waiting in a worker", labels=labels),
            "prefill_q": GaugeMetricFamily("pdserve_queued_prefill_tokens", "Prompt tokens waiting", labels=labels),
            "running": GaugeMetricFamily("pdserve_running_requests", "Requests in the running batch", labels=labels),
            "usage": GaugeMetricFamily("pdserve_kv_pool_usage_ratio", "Share of KV pages in use (cached excluded)",
                                       labels=labels),
            "cached": GaugeMetricFamily("pdserve_kv_cached_pages", "KV pages held by the prefix cache", labels=labels),
            "peers": GaugeMetricFamily("pdserve_kv_transfer_peers", "Peers the KV transfer engines hold mappings "
                                       "or connections for", labels=labels),
            "backlog": GaugeMetricFamily("pdserve_worker_outbox_backlog", "Messages a worker holds for a peer that "
                                         "falls behind (a coordinator slower than its workers)", labels=labels),
            "tp": GaugeMetricFamily("pdserve_worker_tp_size", "Tensor-parallel ranks (GPUs) of the worker",
                                    labels=labels),
            "draining": GaugeMetricFamily("pdserve_worker_draining", "1 while the worker drains to stop (it gets "
                                          "no new requests), else 0", labels=labels),
        }
        c = {
            "hit": CounterMetricFamily("pdserve_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache",
                                       labels=labels),
            "query": CounterMetricFamily("pdserve_prefix_cache_query_tokens", "Prompt tokens looked up",
                                         labels=labels),
            "tbytes": CounterMetricFamily("pdserve_kv_transfer_bytes", "KV bytes sent", labels=labels),
            "tsec": CounterMetricFamily("pdserve_kv_transfer_seconds", "Time spent in KV sends", labels=labels),
            "tcount": CounterMetricFamily("pdserve_kv_transfers", "KV sends completed", labels=labels),
            "tfail": CounterMetricFamily("pdserve_kv_transfer_failures", "KV sends failed", labels=labels),
            "retract": CounterMetricFamily("pdserve_retracted_requests", "Requests retracted for lack of KV pages",
                                           labels=labels),
        }
        for w in self.workers_view():
            lv = [w.role, w.worker_id]
            ld = w.load
            g["queue"].add_metric(lv, ld.waiting + ld.pending_allocations)
            g["prefill_q"].add_metric(lv, ld.queued_prefill_tokens)
            g["running"].add_metric(lv, ld.running)
            used = ld.total_pages - ld.free_pages - ld.cached_pages
            g["usage"].add_metric(lv, used / ld.total_pages if ld.total_pages else 0.0)
            g["cached"].add_metric(lv, ld.cached_pages)
            g["peers"].add_metric(lv, ld.transfer_peers)
            g["backlog"].add_metric(lv, ld.outbox_backlog)
            g["tp"].add_metric(lv, w.layout.tp_size)
            g["draining"].add_metric(lv, float(w.state == "draining"))
            c["hit"].add_metric(lv, ld.prefix_hit_tokens)
            c["query"].add_metric(lv, ld.prefix_query_tokens)
            c["tbytes"].add_metric(lv, ld.transfer_bytes)
            c["tsec"].add_metric(lv, ld.transfer_seconds)
            c["tcount"].add_metric(lv, ld.transfer_count)
            c["tfail"].add_metric(lv, ld.transfer_failures)
            c["retract"].add_metric(lv, ld.retracted)
        yield from g.values()
        yield from c.values()
