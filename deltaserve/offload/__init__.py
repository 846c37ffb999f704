"""The storage layer of the offload tier: KV chunks and KDA state images as checked objects in host
memory, on disk and in Mooncake Store, behind one TieredStore.

objects.py (format and keys) -> tiers.py (Tier interface, LRU index, HostTier), disk_tier.py,
mooncake_tier.py -> tiered_store.py (write-through, promotion, integrity, degradation).
"""

from deltaserve.offload.disk_tier import DiskTier
from deltaserve.offload.mooncake_tier import MooncakeStoreTier, parse_master_address
from deltaserve.offload.objects import CorruptObject, decode, encode, key_namespace, object_key, worker_id
from deltaserve.offload.tiered_store import TieredStore
from deltaserve.offload.tiers import HostTier, Tier, TierError, TierStats

__all__ = [
    "CorruptObject",
    "DiskTier",
    "HostTier",
    "MooncakeStoreTier",
    "Tier",
    "TierError",
    "TierStats",
    "TieredStore",
    "decode",
    "encode",
    "key_namespace",
    "object_key",
    "parse_master_address",
    "worker_id",
]
