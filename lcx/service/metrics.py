"""The Prometheus metrics of ``lcx serve`` (``GET /metrics``), in a registry of their own per app.

Names (a contract: dashboards and checks read them): ``lcx_kv_pages_used``, ``lcx_kv_pages_total``,
``lcx_kv_bytes_used``, ``lcx_requests_running``, ``lcx_requests_waiting``, ``lcx_prompt_tokens_total``,
``lcx_prompt_tokens_cached_total``, ``lcx_generation_tokens_total``, ``lcx_requests_finished_total{reason}``,
``lcx_time_to_first_token_seconds`` and ``lcx_inter_token_latency_seconds`` (histograms); under
``--speculative-draft`` ``lcx_spec_draft_tokens_total`` and ``lcx_spec_accepted_tokens_total`` (draft tokens
verified / accepted: their ratio is the acceptance rate; 0 without speculation).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Metrics:
    """The service's metrics; ``observe_server`` reads the gauges off a ``Server`` (engine thread)."""

    def __init__(self, page_bytes: int, pages_total: int):
        self.registry = CollectorRegistry()
        r, self.page_bytes = self.registry, page_bytes
        self.pages_used = Gauge("lcx_kv_pages_used", "KV pages held by a kept prefix or reserved by a sequence",
                                registry=r)
        self.pages_total = Gauge("lcx_kv_pages_total", "KV pages in the pool", registry=r)
        self.bytes_used = Gauge("lcx_kv_bytes_used", "bytes of the KV pages in use", registry=r)
        self.running = Gauge("lcx_requests_running", "requests holding a row", registry=r)
        self.waiting = Gauge("lcx_requests_waiting", "requests queued for a row or pages", registry=r)
        self.prompt_tokens = Counter("lcx_prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.cached_tokens = Counter("lcx_prompt_tokens_cached", "prompt tokens read from kept or stored pages "
                                     "instead of prefilled", registry=r)
        self.generation_tokens = Counter("lcx_generation_tokens", "tokens generated", registry=r)
        self.finished = Counter("lcx_requests_finished", "requests ended, by reason", ["reason"], registry=r)
        self.ttft = Histogram("lcx_time_to_first_token_seconds", "arrival to first token", buckets=TTFT_BUCKETS,
                              registry=r)
        self.itl = Histogram("lcx_inter_token_latency_seconds", "between consecutive tokens of a request",
                             buckets=ITL_BUCKETS, registry=r)
        self.spec_drafted = Counter("lcx_spec_draft_tokens", "draft tokens verified (--speculative-draft)",
                                    registry=r)
        self.spec_accepted = Counter("lcx_spec_accepted_tokens", "draft tokens accepted (--speculative-draft)",
                                     registry=r)
        self._spec_seen = (0, 0)  # the server's counts when last observed
        self.pages_total.set(pages_total)

    def observe_server(self, server) -> None:
        """The gauges from the server's host counts (``Server.pages_used``: kept prefix pages + the running
        requests' reservations): no device read."""
        used = server.pages_used()
        self.pages_used.set(used)
        self.bytes_used.set(used * self.page_bytes)
        self.running.set(server.running)
        self.waiting.set(server.waiting)
        counts = (getattr(server, "drafted_tokens", 0), getattr(server, "accepted_tokens", 0))
        self.spec_drafted.inc(counts[0] - self._spec_seen[0])
        self.spec_accepted.inc(counts[1] - self._spec_seen[1])
        self._spec_seen = counts

    def render(self) -> bytes:
        return generate_latest(self.registry)


__all__ = ["Metrics"]
