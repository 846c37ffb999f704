"""`--kv-transfer-config`: which KV connector an engine runs and in which role (vLLM's fields)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field, fields
from typing import Any

from deltaserve.config.engine_config import json_object

CONNECTORS = {"NixlConnector": "nixl", "MooncakeConnector": "mooncake"}  # name -> transfer backend
ROLES = ("kv_producer", "kv_consumer", "kv_both")
FAILURE_POLICIES = ("recompute", "fail")


@dataclass(frozen=True)
class KVTransferConfig:
    """kv_connector: "NixlConnector" or "MooncakeConnector"; kv_role: "kv_producer" (a prefill engine:
    it keeps a finished request's KV and KDA state until its consumer has read them),
    "kv_consumer" (a decode engine: it reads them) or "kv_both"; kv_ip / kv_port: where this engine's
    side channel listens (its transfer metadata and the consumers' release notices; port 0 picks a
    free one); engine_id: this engine's name in kv_transfer_params; kv_load_failure_policy: what a
    consumer does when a load fails ("recompute" the prompt locally, or "fail" the request);
    transfer_timeout_s: how long a producer holds a request no consumer has read.
    staging_chunk_pages: on a producer, MLA staging for DCP consumers (kv_transfer/staging.py): pages of
    its block size per staging slot, 0 = off (the per-token path); staging_slots: slots per producer
    rank, held back from its cache budget; staging_stream_priority: the CUDA priority of each slot's
    gather stream (lower is higher; -1 by default, as a reference deployment waited 165 ms for its KV
    with -1 against 373 ms with 0). chunked_transfer: on a producer, a request's
    kv_transfer_params are given as soon as it is added and its consumer reads each prefill chunk's
    KV as the chunk completes, so the transfer overlaps the prefill (the proxy starts the decode leg
    on those early params); a decode with DCP refuses such a request at admission."""

    kv_connector: str
    kv_role: str
    kv_ip: str = "127.0.0.1"
    kv_port: int = 0
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    kv_load_failure_policy: str = "recompute"
    transfer_timeout_s: float = 120.0
    staging_chunk_pages: int = 0
    staging_slots: int = 16
    staging_stream_priority: int = -1
    chunked_transfer: bool = False
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kv_connector not in CONNECTORS:
            raise ValueError(f"kv_transfer_config: kv_connector={self.kv_connector!r} is unknown; choose one of "
                             f"{', '.join(CONNECTORS)}")
        if self.kv_role not in ROLES:
            raise ValueError(f"kv_transfer_config: kv_role={self.kv_role!r} must be one of {', '.join(ROLES)}")
        if self.kv_load_failure_policy not in FAILURE_POLICIES:
            raise ValueError(f"kv_transfer_config: kv_load_failure_policy={self.kv_load_failure_policy!r} must be "
                             f"one of {', '.join(FAILURE_POLICIES)}")
        if not (isinstance(self.kv_port, int) and 0 <= self.kv_port < 65536):
            raise ValueError(f"kv_transfer_config: kv_port={self.kv_port!r} must be a TCP port (0: a free one)")
        if self.transfer_timeout_s <= 0:
            raise ValueError(f"kv_transfer_config: transfer_timeout_s={self.transfer_timeout_s} must be positive")
        if not isinstance(self.staging_stream_priority, int) or isinstance(self.staging_stream_priority, bool):
            raise ValueError(f"kv_transfer_config: staging_stream_priority={self.staging_stream_priority!r} must be "
                             "an integer (a CUDA stream priority; lower is higher)")
        for name, least in (("staging_chunk_pages", 0), ("staging_slots", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"kv_transfer_config: {name}={value!r} must be an integer >= {least}")
        if not isinstance(self.chunked_transfer, bool):
            raise ValueError(f"kv_transfer_config: chunked_transfer={self.chunked_transfer!r} must be true or false")

    @property
    def backend(self) -> str:
        return CONNECTORS[self.kv_connector]

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def parse(cls, value: str | dict[str, Any] | KVTransferConfig) -> KVTransferConfig:
        """From the JSON text of --kv-transfer-config, a dict, or a config; ValueError names what is wrong."""
        if isinstance(value, KVTransferConfig):
            return value
        value = json_object(value, "kv_transfer_config")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"kv_transfer_config: unknown field(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        for name in ("kv_connector", "kv_role"):
            if name not in value:
                raise ValueError(f"kv_transfer_config needs {name!r}")
        return cls(**value)
