"""`deltaserve proxy`'s process: the proxy app on uvicorn until SIGTERM/SIGINT."""

from __future__ import annotations

import logging

import uvicorn

from deltaserve.entrypoints.proxy.app import build_proxy_app
from deltaserve.entrypoints.proxy.config import ProxyOptions

logger = logging.getLogger(__name__)


def run_proxy(options: ProxyOptions) -> int:
    """Serve the proxy on options.host:options.port; returns the exit code."""
    app = build_proxy_app(options)
    logger.info("deltaserve proxy: prefill %s, decode %s, policy %s", ", ".join(options.prefill_urls),
                ", ".join(options.decode_urls), options.policy)
    uvicorn.run(app, host=options.host, port=options.port, log_level=options.log_level.lower(), access_log=False)
    return 0
