"""The storage layer of the offload tier: KV chunks and KDA state images as checked objects in host
memory, on disk and in Mooncake Store, behind one TieredStore.

objects.py (format and keys) -> tiers.py (Tier interface, LRU index, HostTier), disk_tier.py,
mooncake_tier.py -> tiered_store.py (write-through, promotion, integrity, degradation).

The rank side: rank_caches.py (a rank's caches, KV chunk and state image payloads) and fence.py (the
producer fence) -> rank_store.py (RankOffloader: bounded saves on a saver thread, all-or-nothing loads).

The engine core's side: tier_index.py (TierIndex: what the tier holds, LRU by the largest stage's
bytes, joint hits on the chunk grid past what HBM holds).
"""

from deltaserve.offload.disk_tier import DiskTier
from deltaserve.offload.fence import Fence
from deltaserve.offload.mooncake_tier import MooncakeStoreTier, parse_master_address
from deltaserve.offload.objects import CorruptObject, decode, encode, key_namespace, object_key, worker_id
from deltaserve.offload.rank_caches import (
    RankCaches,
    kv_chunk_payload_bytes,
    state_image_payload_bytes,
    stored_object_bytes,
)
from deltaserve.offload.rank_store import OffloadStats, RankOffloader
from deltaserve.offload.tier_index import TierHit, TierIndex
from deltaserve.offload.tiered_store import TieredStore
from deltaserve.offload.tiers import HostTier, Tier, TierError, TierStats

__all__ = [
    "CorruptObject",
    "DiskTier",
    "Fence",
    "HostTier",
    "MooncakeStoreTier",
    "OffloadStats",
    "RankCaches",
    "RankOffloader",
    "Tier",
    "TierError",
    "TierHit",
    "TierIndex",
    "TierStats",
    "TieredStore",
    "decode",
    "encode",
    "key_namespace",
    "kv_chunk_payload_bytes",
    "object_key",
    "parse_master_address",
    "state_image_payload_bytes",
    "stored_object_bytes",
    "worker_id",
]
