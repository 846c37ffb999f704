"""What `deltaserve proxy` is told: its backends, its policy, its address, keys and timeouts."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from deltaserve.entrypoints.proxy.policies import POLICIES


@dataclass
class ProxyOptions:
    """The proxy's configuration; `validate()` refuses what it cannot serve, naming the flag.

    api_key: clients must send `Authorization: Bearer KEY` on /v1/ routes (None: open).
    backend_api_key: what the proxy sends to the backends as `Authorization: Bearer KEY`; None forwards
        the client's own Authorization header as it came (so one key can serve the proxy and backends).
    timeout_s: the longest a leg may wait for its backend to answer (or, streaming, between chunks).
    """

    prefill_urls: list[str]
    decode_urls: list[str]
    host: str = "127.0.0.1"
    port: int = 8000
    policy: str = "round_robin"
    api_key: str | None = None
    backend_api_key: str | None = None
    timeout_s: float = 600.0
    connect_timeout_s: float = 10.0
    max_connections: int = 1024
    log_level: str = "info"

    def validate(self) -> ProxyOptions:
        for flag, urls in (("--prefill", self.prefill_urls), ("--decode", self.decode_urls)):
            if not urls:
                raise ValueError(f"{flag}: give at least one server URL, e.g. {flag} http://127.0.0.1:8100")
            for url in urls:
                parts = urlsplit(url)
                if parts.scheme not in ("http", "https") or not parts.netloc:
                    raise ValueError(f"{flag} {url!r}: not an http(s) URL; send e.g. http://127.0.0.1:8100")
        self.prefill_urls = [url.rstrip("/") for url in self.prefill_urls]
        self.decode_urls = [url.rstrip("/") for url in self.decode_urls]
        if self.policy not in POLICIES:
            raise ValueError(f"--policy {self.policy!r}: choose one of {', '.join(sorted(POLICIES))}")
        if self.timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise ValueError(f"--timeout={self.timeout_s}: leg timeouts must be > 0 seconds")
        return self
