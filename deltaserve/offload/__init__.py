"""The offload tier: KV chunks and KDA state images of the prefix cache in host memory, on disk and
in Mooncake Store, behind HBM (the modules are imported by path: the scheduler's side stays free of
torch).

Storage: objects.py (format and keys) -> tiers.py (Tier interface, LRU index, HostTier),
disk_tier.py, mooncake_tier.py -> tiered_store.py (write-through, promotion, integrity, degradation).

The rank side: rank_caches.py (a rank's caches, KV chunk and state image payloads) and fence.py (the
producer fence) -> rank_store.py (RankOffloader: bounded saves on a saver thread, all-or-nothing
loads) -> worker_side.py (OffloadWorker: a step's saves and loads on this rank, its reports).

The engine core's side: tier_index.py (TierIndex: what the tier holds, LRU by the largest stage's
bytes, joint hits on the chunk grid past what HBM holds) -> scheduler_side.py (OffloadScheduler:
write-through saves, bounded; tier hits ordered as loads). metadata.py: what the two sides exchange,
and the join of every rank's report.
"""
