"""One rank's model caches as the offload tier sees them, and the payloads it stores: KV chunks and
KDA state images, packed to host bytes and unpacked into (possibly other) blocks, slots or units.

Payload layouts (raw bytes, no header: the stored object format adds one, see objects.py):

- KV chunk of n blocks: for every MLA layer of this rank in ascending layer id, the rows of the
  chunk's blocks in the order given, each row [block_size, latent_dim] in the cache dtype:

      [num_mla_layers, n, block_size, latent_dim]  ->  n * kv_block_bytes bytes

  where kv_block_bytes = sum over MLA layers of block_size * latent_dim * dtype bytes
  (= MLALatentSpec.bytes_per_block of this rank).
- State image: for every KDA layer of this rank in ascending layer id, its conv window
  [conv_dim, conv_width - 1] (model dtype) then its recurrent state [H, K, V] (fp32):

      state_image_bytes = sum over KDA layers of conv row bytes + recurrent row bytes
      (= KDAStateSpec.bytes_per_image of this rank)

  This is byte for byte the image that deltaserve.worker.state_store.StateCheckpointStore cuts into
  checkpoint units (it concatenates `conv_state[slot]`, `recurrent_state[slot]` per KDA layer in
  `model.kda_layers()` order, which is ascending layer id), so an image can be packed from a state
  slot or from checkpoint units and unpacked into either.

A rank without MLA (or KDA) layers, e.g. a pipeline stage holding only the other kind, packs empty
payloads; they are stored like any other, so every stage holds every key of a joint hit.

Packing runs on the calling thread's current stream and waits for it; unpacking queues its copies on
the current stream and does not wait, so a forward queued after it on that stream reads the data.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from deltaserve.core.kv_cache_spec import KDAStateSpec, MLALatentSpec
from deltaserve.offload.objects import HEADER, RANK_FINGERPRINT_DIGEST_BYTES, RANK_FINGERPRINT_PREFIX


def kv_chunk_payload_bytes(spec: MLALatentSpec, num_blocks: int) -> int:
    """Bytes of the payload of a KV chunk of `num_blocks` blocks on one rank with cache spec `spec`."""
    return num_blocks * spec.bytes_per_block


def state_image_payload_bytes(spec: KDAStateSpec) -> int:
    """Bytes of the payload of one KDA state image on one rank with state spec `spec`."""
    return spec.bytes_per_image


def stored_object_bytes(payload_bytes: int, fingerprint: str) -> int:
    """Bytes a tier holds for a payload of `payload_bytes` under `fingerprint` (header, fingerprint,
    payload): what the tiers' byte-capped LRU indexes count."""
    return HEADER.size + len(fingerprint.encode()) + payload_bytes


def _row_bytes(tensor: torch.Tensor) -> int:
    return tensor[0].numel() * tensor.element_size()


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view."""
    return tensor.reshape(-1).view(torch.uint8)


def _as_rows(data: torch.Tensor, like: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Flat uint8 `data` read as `num_rows` rows of `like` [num_rows, *like.shape[1:]] in its dtype
    (copied first when the bytes start off the dtype's alignment, which a view cannot express)."""
    if data.storage_offset() % like.element_size():
        data = data.clone()
    return data.view(like.dtype).view(num_rows, *like.shape[1:])


class RankCaches:
    """The offloadable caches of one rank.

    mla: layer id -> paged latents [num_blocks, block_size, latent_dim];
    kda: layer id -> (conv state [num_slots, conv_dim, conv_width - 1],
                      recurrent state [num_slots, H, K, V] fp32);
    checkpoint_units: the KDA checkpoint pool [num_units, unit_bytes] uint8, or None.
    All tensors contiguous, on one device.
    """

    def __init__(self, mla: Mapping[int, torch.Tensor], kda: Mapping[int, tuple[torch.Tensor, torch.Tensor]],
                 checkpoint_units: torch.Tensor | None = None) -> None:
        self.mla = dict(sorted(mla.items()))
        self.kda = dict(sorted(kda.items()))
        self.checkpoint_units = checkpoint_units
        tensors = list(self.mla.values()) + [t for pair in self.kda.values() for t in pair]
        if checkpoint_units is not None:
            tensors.append(checkpoint_units)
        devices = {t.device for t in tensors}
        if len(devices) > 1:
            raise ValueError(f"RankCaches: caches on several devices {sorted(map(str, devices))}; one rank's "
                             "caches must share its device")
        self.device = devices.pop() if devices else torch.device("cpu")
        if any(not t.is_contiguous() for t in tensors):
            raise ValueError("RankCaches: every cache tensor must be contiguous (rows are copied as bytes)")
        self.num_blocks = self._common_rows("MLA latent caches", list(self.mla.values()))
        self.num_state_slots = self._common_rows("KDA states", [t for pair in self.kda.values() for t in pair])
        if checkpoint_units is not None and (checkpoint_units.dtype != torch.uint8 or checkpoint_units.dim() != 2):
            raise ValueError(f"RankCaches: checkpoint_units is {checkpoint_units.dtype} {tuple(checkpoint_units.shape)}"
                             "; expected uint8 [num_units, unit_bytes]")
        self.kv_block_bytes = sum(_row_bytes(t) for t in self.mla.values())
        self.state_image_bytes = sum(_row_bytes(conv) + _row_bytes(rec) for conv, rec in self.kda.values())

    @classmethod
    def from_model(cls, model: Any, checkpoint_units: torch.Tensor | None = None) -> RankCaches:
        """From a model whose caches are bound: `model.layers[key].self_attn` holds `kv_cache`
        (MLA layers) or `conv_state` and `recurrent_state` (KDA layers, `layer.is_kda`)."""
        mla, kda = {}, {}
        for key, layer in model.layers.items():
            attn = layer.self_attn
            if layer.is_kda:
                kda[int(key)] = (attn.conv_state, attn.recurrent_state)
            else:
                mla[int(key)] = attn.kv_cache
        return cls(mla, kda, checkpoint_units)

    @staticmethod
    def _common_rows(what: str, tensors: list[torch.Tensor]) -> int:
        rows = {t.shape[0] for t in tensors}
        if len(rows) > 1:
            raise ValueError(f"RankCaches: {what} have different row counts {sorted(rows)}; they must share "
                             "block (or state slot) ids")
        return rows.pop() if rows else 0

    # Sizes and layout ------------------------------------------------------------------------
    def kv_chunk_bytes(self, num_blocks: int) -> int:
        """Bytes of the payload of a KV chunk of `num_blocks` blocks."""
        return num_blocks * self.kv_block_bytes

    def layout(self) -> str:
        """What the payloads hold: every layer's id, row shape and dtype (not the row counts, which
        differ between engines of one layout)."""
        parts = [f"mla{i}:{list(t.shape[1:])}:{t.dtype}" for i, t in self.mla.items()]
        parts += [f"kda{i}:{list(conv.shape[1:])}:{conv.dtype}:{list(rec.shape[1:])}:{rec.dtype}"
                  for i, (conv, rec) in self.kda.items()]
        return ";".join(parts)

    def fingerprint(self) -> str:
        """A short digest of `layout()`, for the TieredStore that checks every object it reads."""
        return RANK_FINGERPRINT_PREFIX + hashlib.blake2b(self.layout().encode(),
                                                         digest_size=RANK_FINGERPRINT_DIGEST_BYTES).hexdigest()

    # KV chunks -------------------------------------------------------------------------------
    def pack_kv(self, block_ids: Sequence[int]) -> memoryview:
        """The KV chunk payload of `block_ids` (see the module docstring), as host bytes."""
        return self.host_bytes(self.snapshot_kv(block_ids), self.kv_chunk_bytes(len(block_ids)))

    def snapshot_kv(self, block_ids: Sequence[int]) -> list[torch.Tensor]:
        """The KV chunk payload of `block_ids` as pieces copied on the device (queued on the current
        stream, so they hold the rows as the work queued before them leaves them): `host_bytes` of
        them, once that work has run, is `pack_kv`'s payload whatever later work writes the blocks."""
        if not self.mla:  # a stage without MLA layers stores empty chunks
            return []
        index = self._index(block_ids, self.num_blocks, "block id")
        return [_as_bytes(cache.index_select(0, index)) for cache in self.mla.values()]

    def unpack_kv(self, payload: bytes | memoryview, block_ids: Sequence[int]) -> None:
        """Writes a KV chunk payload into blocks `block_ids` of every MLA layer."""
        self._check_size("KV chunk", payload, self.kv_chunk_bytes(len(block_ids)))
        if not self.mla:
            return
        index = self._index(block_ids, self.num_blocks, "block id")
        data, offset = self._to_device(payload), 0
        for cache in self.mla.values():
            rows = data[offset : offset + len(block_ids) * _row_bytes(cache)]
            cache.index_copy_(0, index, _as_rows(rows, cache, len(block_ids)))
            offset += rows.numel()

    # State images ----------------------------------------------------------------------------
    def pack_state(self, state_slot: int) -> memoryview:
        """The state image payload of `state_slot`, as host bytes."""
        self._check_slot(state_slot)
        rows = (_as_bytes(t[state_slot]) for pair in self.kda.values() for t in pair)
        return self.host_bytes(rows, self.state_image_bytes)

    def unpack_state(self, payload: bytes | memoryview, state_slot: int) -> None:
        """Overwrites state slot `state_slot` of every KDA layer with a state image payload."""
        self._check_size("state image", payload, self.state_image_bytes)
        self._check_slot(state_slot)
        data, offset = self._to_device(payload), 0
        for tensor in (t for pair in self.kda.values() for t in pair):
            tensor[state_slot].copy_(_as_rows(data[offset : offset + _row_bytes(tensor)], tensor, 1)[0])
            offset += _row_bytes(tensor)

    def pack_state_units(self, unit_ids: Sequence[int]) -> memoryview:
        """The state image held in checkpoint units `unit_ids` (the image's first bytes in the first
        unit), as host bytes."""
        return self.host_bytes(self.snapshot_state_units(unit_ids), self.state_image_bytes)

    def snapshot_state_units(self, unit_ids: Sequence[int]) -> list[torch.Tensor]:
        """The state image in checkpoint units `unit_ids`, copied on the device as `snapshot_kv`."""
        units = self._units_for(unit_ids)
        index = self._index(unit_ids, units.shape[0], "checkpoint unit id")
        return [units.index_select(0, index).reshape(-1)[: self.state_image_bytes]]

    def unpack_state_units(self, payload: bytes | memoryview, unit_ids: Sequence[int]) -> None:
        """Writes a state image payload into checkpoint units `unit_ids`, as StateCheckpointStore.save
        lays it out (zero padding after the image in the last unit)."""
        self._check_size("state image", payload, self.state_image_bytes)
        units = self._units_for(unit_ids)
        index = self._index(unit_ids, units.shape[0], "checkpoint unit id")
        padded = units.new_zeros(len(unit_ids) * units.shape[1])
        padded[: self.state_image_bytes] = self._to_device(payload)
        units.index_copy_(0, index, padded.view(len(unit_ids), units.shape[1]))

    # Helpers ---------------------------------------------------------------------------------
    def check_block_ids(self, block_ids: Sequence[int]) -> None:
        """Raises ValueError naming the first of `block_ids` that is not a block of these caches (any id
        goes on a rank without MLA layers: it has no blocks, and its chunks are empty)."""
        if self.mla:
            self._check_ids(block_ids, self.num_blocks, "block id")

    def check_state_target(self, state_slot: int | None, unit_ids: Sequence[int] | None) -> None:
        """Raises ValueError unless exactly one of a valid state slot and valid unit ids is given."""
        if (state_slot is None) == (unit_ids is None):
            raise ValueError(f"give a state image's state_slot={state_slot} or its unit_ids={unit_ids}, "
                             "exactly one")
        if state_slot is not None:
            self._check_slot(state_slot)
        else:
            assert unit_ids is not None
            self._check_ids(unit_ids, self._units_for(unit_ids).shape[0], "checkpoint unit id")

    def _units_for(self, unit_ids: Sequence[int]) -> torch.Tensor:
        units = self.checkpoint_units
        if units is None:
            raise ValueError("RankCaches: no checkpoint_units were given, so images cannot move through units")
        if len(unit_ids) * units.shape[1] < self.state_image_bytes:
            raise ValueError(f"{len(unit_ids)} checkpoint units of {units.shape[1]} bytes cannot hold a "
                             f"{self.state_image_bytes}-byte state image")
        return units

    def _check_slot(self, state_slot: int) -> None:
        if not 0 <= state_slot < self.num_state_slots:
            raise ValueError(f"state_slot={state_slot} is outside the {self.num_state_slots} KDA state slots")

    @staticmethod
    def _check_ids(ids: Sequence[int], num_rows: int, what: str) -> None:
        for i in ids:
            if not 0 <= i < num_rows:
                raise ValueError(f"{what} {i} is outside [0, {num_rows})")

    @staticmethod
    def _check_size(what: str, payload: bytes | memoryview, expected: int) -> None:
        nbytes = memoryview(payload).nbytes
        if nbytes != expected:
            raise ValueError(f"a {what} payload of {nbytes} bytes where this rank's layout takes {expected}")

    def _index(self, ids: Sequence[int], num_rows: int, what: str) -> torch.Tensor:
        """[len(ids)] long on the caches' device, sent without waiting for the device (pinned)."""
        self._check_ids(ids, num_rows, what)
        index = torch.tensor(list(ids), dtype=torch.long)
        if self.device.type == "cuda":
            index = index.pin_memory()
        return index.to(self.device, non_blocking=True)

    def host_bytes(self, pieces: Iterable[torch.Tensor], nbytes: int) -> memoryview:
        """Copies flat uint8 device tensors, back to back, into one fresh host buffer of `nbytes`
        (pinned on CUDA) on the current stream and waits for the copies; the buffer is the returned
        view's own."""
        on_cuda = self.device.type == "cuda"
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=on_cuda)
        offset = 0
        for piece in pieces:
            host[offset : offset + piece.numel()].copy_(piece, non_blocking=on_cuda)
            offset += piece.numel()
        assert offset == nbytes, f"packed {offset} bytes, the layout takes {nbytes}"
        if on_cuda:
            torch.cuda.current_stream(self.device).synchronize()
        return memoryview(host.numpy())

    def _to_device(self, payload: bytes | memoryview) -> torch.Tensor:
        """The payload as a flat uint8 tensor on the caches' device (via a pinned buffer on CUDA; the
        host-to-device copy is queued on the current stream)."""
        on_cuda = self.device.type == "cuda"
        host = torch.empty(memoryview(payload).nbytes, dtype=torch.uint8, pin_memory=on_cuda)
        host.numpy()[:] = np.frombuffer(payload, dtype=np.uint8)
        return host.to(self.device, non_blocking=True) if on_cuda else host
