"""Prometheus metrics of one server: requests, tokens, acceptance, step time, queue and KV pages."""

from __future__ import annotations

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               disable_created_metrics, generate_latest)

disable_created_metrics()  # no `*_created` timestamp series: they double the text and nobody graphs them

# Step times of a CPU toy model through a large model on a GPU: 1 ms .. 10 s.
STEP_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Metrics:
    """Every series lives in a registry of its own, so servers in one process do not collide.

    The engine thread writes the engine-side series after each step or command; the HTTP side
    counts responses by endpoint and status code.
    """

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, max_accept_length: int, num_kv_pages: int):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("specflow_requests", "HTTP responses by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.finished = Counter("specflow_requests_finished",
                                "engine requests (one per choice) by finish reason: stop, length, abort, error",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("specflow_prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.cached_prompt_tokens = Counter("specflow_cached_prompt_tokens",
                                            "prompt tokens of finished requests found in the prefix cache", registry=r)
        self.generation_tokens = Counter("specflow_generation_tokens", "generated tokens sent to clients",
                                         registry=r)
        self.accept_length = Histogram(
            "specflow_accept_length", "tokens committed per request per step (accepted drafts + bonus)",
            buckets=[float(k) for k in range(1, max_accept_length + 1)], registry=r)
        self.step_seconds = Histogram("specflow_step_seconds", "wall time of one engine step",
                                      buckets=STEP_SECONDS_BUCKETS, registry=r)
        self.queue_length = Gauge("specflow_queue_length", "requests waiting for a batch slot or KV pages",
                                  registry=r)
        self.running = Gauge("specflow_running_requests",
                             "requests admitted: in the running batch or being prefilled in chunks", registry=r)
        self.kv_pages_used = Gauge("specflow_kv_pages_used", "KV cache pages held by requests", registry=r)
        self.kv_pages_cached = Gauge("specflow_kv_pages_cached",
                                     "KV cache pages in the prefix cache (held by requests or not)", registry=r)
        self.kv_pages_total = Gauge("specflow_kv_pages_total", "KV cache pages in the pool", registry=r)
        self.kv_pages_total.set(num_kv_pages)

    def render(self) -> bytes:
        """The Prometheus text exposition of every series."""
        return generate_latest(self.registry)
