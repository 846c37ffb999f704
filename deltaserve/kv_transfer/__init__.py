"""Transfer engines for prefill/decode disaggregation: one small interface, a NIXL and a Mooncake agent.

`make_agent(backend, name)` builds one; `available_backends()` says which libraries import here.
"""

from deltaserve.kv_transfer.transfer_engine import (
    BACKENDS,
    TransferAgent,
    TransferError,
    TransferHandle,
    TransferOp,
    available_backends,
    make_agent,
)

__all__ = [
    "BACKENDS",
    "TransferAgent",
    "TransferError",
    "TransferHandle",
    "TransferOp",
    "available_backends",
    "make_agent",
]
