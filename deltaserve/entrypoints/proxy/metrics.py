"""The proxy's Prometheus metrics, in a registry of its own (several proxies may live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from deltaserve.entrypoints.proxy.policies import Backend

_LEG_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class ProxyMetrics:
    """Requests by endpoint and outcome, legs in flight per backend, and each leg's latency (the
    decode leg's to its last byte, streamed or not)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("deltaserve_proxy_requests", "P/D requests by endpoint and outcome",
                                ["endpoint", "outcome"], registry=self.registry)
        self.in_flight = Gauge("deltaserve_proxy_backend_in_flight", "legs in flight through this proxy",
                               ["role", "backend"], registry=self.registry)
        self.leg_seconds = Histogram("deltaserve_proxy_leg_seconds", "time of a leg, from send to its last byte",
                                     ["leg"], buckets=_LEG_BUCKETS, registry=self.registry)

    def backend_changed(self, backend: Backend) -> None:
        self.in_flight.labels(role=backend.role, backend=backend.url).set(backend.in_flight)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
