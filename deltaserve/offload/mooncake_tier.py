"""MooncakeStoreTier: encoded objects in Mooncake Store, the tier shared across engines and nodes.

Client: `mooncake.store.MooncakeDistributedStore` from mooncake-transfer-engine(-non-cuda), set up
with `setup(local_host, "P2PHANDSHAKE", segment_bytes, buffer_bytes, "tcp", "", "MASTER:PORT")`:
P2P handshake needs no metadata server, so `mooncake://MASTER:PORT` (the master's --rpc_port) is
all an engine is told. The client lends `segment_bytes` of its own host memory to the store's
pool (0 lends none: a pure client; the client refuses a segment between 0 and 16 MiB) and stages
transfers through a `buffer_bytes` local buffer, at least 16 MiB.

Capacity and eviction are the store's: the master evicts at its high watermark, so `used_bytes`
and `capacity_bytes` are None here, and a put the store has no room for (NO_AVAILABLE_HANDLE) is
"did not fit", not a failure. Return codes are Mooncake's ErrorCode (mooncake-store/include/types.h):
RPC and transfer errors raise TierError, so the TieredStore degrades the tier while the master is down.

`get` answers b"" both for a missing key and for a failed call, so an empty answer is followed by
`is_exist` to tell a miss (0) from a master that is down (negative). Deletes are forced: a key is
removed only when its object failed to decode, and the lease another reader may hold on it
(OBJECT_HAS_LEASE) protects bytes nobody should read.
"""

from __future__ import annotations

import socket

from deltaserve.offload.tiers import Tier, TierError

OK = 0
NO_AVAILABLE_HANDLE = -200  # no space left in the store's segments
INVALID_PARAMS = -600  # e.g. an object larger than any segment
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
# Codes at or below this are transport, RPC, HA and file errors: the store itself is unreachable or broken.
FIRST_SERVICE_ERROR = -800
MIN_SEGMENT_BYTES = 16 << 20
URL_SCHEME = "mooncake://"


def parse_master_address(url: str) -> str:
    """"mooncake://HOST:PORT" or "HOST:PORT" -> "HOST:PORT", checked."""
    address = url[len(URL_SCHEME) :] if url.startswith(URL_SCHEME) else url
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or "/" in address:
        raise ValueError(f"kv_offloading_remote={url!r}: expected mooncake://MASTER_HOST:RPC_PORT")
    return address


class MooncakeStoreTier(Tier):
    """Encoded objects in a Mooncake Store whose master listens at `master` ("mooncake://HOST:PORT").

    `local_host` is the address other store clients reach this one at (its segment is read by
    them); use the node's LAN address when engines run on several nodes. The master's port is
    tried with a plain TCP connect first (`connect_timeout_s`), because the client's own setup
    retries an unreachable master for about 90 s (MC_STORE_CLIENT_SETUP_RETRIES) before failing.
    """

    def __init__(self, master: str, *, local_host: str = "127.0.0.1", segment_bytes: int = MIN_SEGMENT_BYTES,
                 buffer_bytes: int = MIN_SEGMENT_BYTES, connect_timeout_s: float = 2.0,
                 name: str = "mooncake") -> None:
        super().__init__(name)
        if 0 < segment_bytes < MIN_SEGMENT_BYTES or buffer_bytes < MIN_SEGMENT_BYTES:
            raise ValueError(f"MooncakeStoreTier: segment_bytes={segment_bytes} must be 0 or >= {MIN_SEGMENT_BYTES}, "
                             f"buffer_bytes={buffer_bytes} >= {MIN_SEGMENT_BYTES} (the Mooncake client's minimum)")
        self.master_address = parse_master_address(master)
        host, _, port = self.master_address.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=connect_timeout_s).close()
        except OSError as exc:
            raise TierError(f"Mooncake Store master {self.master_address} unreachable ({exc}): is mooncake_master "
                            "running there with --rpc_port set to that port?") from exc
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise TierError("MooncakeStoreTier needs the Mooncake Store client: "
                            "pip install mooncake-transfer-engine-non-cuda (or the CUDA build)") from exc
        self._client = MooncakeDistributedStore()
        rc = self._client.setup(local_host, "P2PHANDSHAKE", segment_bytes, buffer_bytes, "tcp", "",
                                self.master_address)
        if rc != OK:
            raise TierError(f"Mooncake Store setup with master {self.master_address} from {local_host} returned {rc}: "
                            "is mooncake_master running there with --rpc_port set to that port?")
        self._closed = False

    def _put(self, key: str, data: bytes) -> bool:
        rc = self._client.put(key, data)
        if rc in (OK, OBJECT_ALREADY_EXISTS):
            return True
        self._raise_if_service_error("put", key, rc)
        return False  # NO_AVAILABLE_HANDLE, INVALID_PARAMS (too large) and the like: not stored

    def _get(self, key: str) -> bytes | None:
        data = self._client.get(key)
        if data:
            return data
        rc = self._client.is_exist(key)
        self._raise_if_service_error("get", key, rc)
        return None  # missing, or present but not readable now (lease expired mid-read): a miss

    def _contains(self, key: str) -> bool:
        rc = self._client.is_exist(key)
        self._raise_if_service_error("is_exist", key, rc)
        return rc == 1

    def _contains_many(self, keys: list[str]) -> list[bool]:
        if not keys:
            return []
        answers = self._client.batch_is_exist(keys)
        if any(rc < 0 for rc in answers):
            raise TierError(f"{self.name} tier: batch_is_exist of {len(keys)} keys failed at master "
                            f"{self.master_address} (answers {sorted(set(answers))})")
        return [rc == 1 for rc in answers]

    def _delete(self, key: str) -> bool:
        rc = self._client.remove(key, True)
        if rc == OBJECT_NOT_FOUND:
            return False
        self._raise_if_service_error("remove", key, rc)
        return rc == OK

    def close(self) -> None:
        """Unmounts this client's segment (its objects leave the store). With the master down this
        waits for the client's RPC timeouts, a few seconds."""
        if not self._closed:
            self._closed = True
            self._client.close()

    def _raise_if_service_error(self, call: str, key: str, rc: int) -> None:
        if rc <= FIRST_SERVICE_ERROR:
            raise TierError(f"{self.name} tier: {call}({key!r}) returned Mooncake error {rc} "
                            f"(master {self.master_address} unreachable or failing)")
