"""The KV connector in the engine core: the scheduler side, and a producer's side channel.

`KVTransferEngineSide.start` builds the scheduler side (`KVConnectorScheduler`) and, on a producer,
binds the side channel that hands the ranks' cache layouts to consumers and collects their
releases. The engine core asks it each turn for the requests to free (`drain_released`), and
turns consumer loads that failed under the "fail" policy into request errors (`take_failures`).
"""

from __future__ import annotations

import logging
from typing import Any

from deltaserve.kv_transfer.config import KVTransferConfig
from deltaserve.kv_transfer.layout import RankLayout
from deltaserve.kv_transfer.scheduler_side import KVConnectorScheduler
from deltaserve.kv_transfer.side_channel import ProducerSideChannel

logger = logging.getLogger(__name__)


class KVTransferEngineSide:
    def __init__(self, config: KVTransferConfig, scheduler: KVConnectorScheduler,
                 side_channel: ProducerSideChannel | None) -> None:
        self.config = config
        self.scheduler = scheduler
        self.side_channel = side_channel
        self._failures: list[tuple[str, str]] = []
        self.num_ops = 0  # consumer: transfer descriptors its ranks posted
        self.num_staged_chunks = 0  # consumer: staged MLA chunks its ranks read

    @classmethod
    def start(cls, config: KVTransferConfig, layouts: list[RankLayout], block_size: int,
              decode_context_parallel_size: int = 1) -> KVTransferEngineSide:
        """The scheduler side over `block_size`-token blocks; a producer also binds its side channel."""
        if not layouts:
            raise ValueError("kv_transfer_config is set but no rank registered its caches for transfer")
        connector = KVConnectorScheduler(config, block_size, decode_context_parallel_size=decode_context_parallel_size)
        channel = None
        if config.is_producer:
            channel = ProducerSideChannel(config.kv_ip, config.kv_port, config.engine_id, layouts, connector.streams,
                                          connector.held)
            connector.side_channel = (channel.host, channel.port)
        logger.info("kv transfer: %s as %s (engine_id %s, backend %s)%s", config.kv_connector, config.kv_role,
                    config.engine_id, config.backend,
                    f", side channel on {channel.host}:{channel.port}" if channel is not None else "")
        return cls(config, connector, channel)

    def drain_released(self) -> list[str]:
        """Producer: requests whose consumer readers have all released them since the last call."""
        return self.side_channel.drain_released() if self.side_channel is not None else []

    def drop_stale_releases(self) -> None:
        """Producer: partial releases of requests no longer held (freed after their timeout) are dropped."""
        if self.side_channel is not None:
            held = self.scheduler.held
            self.side_channel.forget([r for r in self.side_channel.partially_released() if r not in held])

    def note_output(self, output: Any) -> None:
        """Counts a step's KVConnectorOutput (every rank's, joined)."""
        self.num_ops += output.num_ops
        self.num_staged_chunks += output.num_staged_chunks

    def note_failure(self, request_id: str, message: str) -> None:
        self._failures.append((request_id, message))

    def take_failures(self) -> list[tuple[str, str]]:
        """Consumer: (request id, why) of requests that ended because their load failed."""
        failures, self._failures = self._failures, []
        return failures

    def metrics(self) -> dict[str, Any]:
        return {"role": self.config.kv_role, "held_for_transfer": len(self.scheduler.held),
                "streams": len(self.scheduler.streams),
                "expired_transfers": self.scheduler.num_expired, "ops_posted": self.num_ops,
                "staged_chunks": self.num_staged_chunks,
                "partially_released": len(self.side_channel.partially_released()) if self.side_channel else 0}

    def close(self) -> None:
        if self.side_channel is not None:
            self.side_channel.close()
            self.side_channel = None
