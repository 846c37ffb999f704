"""`deltaserve proxy`: the prefill/decode (P/D) disaggregation proxy in front of deltaserve servers.

Each completion runs in two legs: a prefill server computes the prompt (one token, and keeps the
KV and KDA state for the decode server to fetch), then a decode server generates from the token ids
and the `kv_transfer_params` the prefill leg returned.
"""

from deltaserve.entrypoints.proxy.app import build_proxy_app
from deltaserve.entrypoints.proxy.config import ProxyOptions
from deltaserve.entrypoints.proxy.server import run_proxy

__all__ = ["ProxyOptions", "build_proxy_app", "run_proxy"]
