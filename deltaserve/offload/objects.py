"""The stored object format of the offload tier, and the keys objects are stored under.

An object is a fixed header, the layout fingerprint, then the payload (a KV chunk or a KDA state
image, as raw bytes):

    magic b"DSOB" | format version u16 | fingerprint length u16 | crc32 of payload u32 | payload length u64
    | fingerprint (utf-8) | payload

All integers are little-endian. `decode` refuses an object that is truncated, has the wrong magic
or version, a payload whose crc32 differs, or a fingerprint other than the reader's, so nothing
written by another layout, model or dtype (or half written) is ever loaded.

Keys name content: `object_key` joins a namespace (model, layout, dtype), the worker that stored the
object (its PP, TP and DCP rank and sizes), the object kind and the chained prefix hash of the last
block the object covers. A key therefore never needs to be overwritten with different bytes: two
saves under one key carry the same content.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from typing import Literal

MAGIC = b"DSOB"
FORMAT_VERSION = 1
HEADER = struct.Struct("<4sHHIQ")  # magic, version, fingerprint length, payload crc32, payload length
MAX_FINGERPRINT_BYTES = 0xFFFF
KEY_SEPARATOR = ":"
# a rank's fingerprint (offload/rank_caches.py): this prefix, then a digest of its cache layout
RANK_FINGERPRINT_PREFIX = "rank-"
RANK_FINGERPRINT_DIGEST_BYTES = 12

ObjectKind = Literal["kv", "state"]
OBJECT_KINDS: tuple[str, ...] = ("kv", "state")


class CorruptObject(ValueError):
    """A stored object that must not be loaded; `reason` is one of "truncated", "bad_magic",
    "bad_version", "trailing_bytes", "checksum_mismatch", "foreign_fingerprint"."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def encode_header(payload: bytes | memoryview, fingerprint: str) -> bytes:
    """The header and fingerprint that precede `payload` in its stored object (the payload is not
    copied, so a caller with a scatter write can send the two parts without joining them)."""
    fingerprint_bytes = fingerprint.encode()
    if len(fingerprint_bytes) > MAX_FINGERPRINT_BYTES:
        raise ValueError(f"fingerprint is {len(fingerprint_bytes)} bytes; at most {MAX_FINGERPRINT_BYTES} fit the "
                         "header: hash the layout description into a shorter fingerprint")
    view = memoryview(payload).cast("B")
    header = HEADER.pack(MAGIC, FORMAT_VERSION, len(fingerprint_bytes), zlib.crc32(view), view.nbytes)
    return header + fingerprint_bytes


def encode(payload: bytes | memoryview, fingerprint: str) -> bytes:
    """The stored object for `payload` (any contiguous buffer, read as bytes) under `fingerprint`."""
    return encode_header(payload, fingerprint) + memoryview(payload).cast("B")


def decode(data: bytes | memoryview, fingerprint: str) -> bytes:
    """The payload of a stored object, after checking it is whole, intact and of this layout.

    Raises CorruptObject naming what is wrong.
    """
    view = memoryview(data).cast("B")
    if view.nbytes < HEADER.size:
        raise CorruptObject("truncated", f"{view.nbytes} bytes, shorter than the {HEADER.size}-byte header")
    magic, version, fingerprint_length, checksum, payload_length = HEADER.unpack_from(view)
    if magic != MAGIC:
        raise CorruptObject("bad_magic", f"starts with {bytes(magic)!r}, not {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise CorruptObject("bad_version", f"format version {version}, this reader knows {FORMAT_VERSION}")
    payload_start = HEADER.size + fingerprint_length
    expected_length = payload_start + payload_length
    if view.nbytes != expected_length:
        reason = "truncated" if view.nbytes < expected_length else "trailing_bytes"
        raise CorruptObject(reason, f"{view.nbytes} bytes where the header announces {expected_length}")
    stored_fingerprint = bytes(view[HEADER.size : payload_start]).decode(errors="replace")
    if stored_fingerprint != fingerprint:
        raise CorruptObject("foreign_fingerprint",
                            f"stored under layout {stored_fingerprint!r}, expected {fingerprint!r}")
    payload = view[payload_start:]
    if zlib.crc32(payload) != checksum:
        raise CorruptObject("checksum_mismatch",
                            f"crc32 of the {payload_length}-byte payload differs from the header's")
    return payload.tobytes()


def rank_object_bytes(payload_bytes: int) -> int:
    """Bytes a tier holds for a payload of `payload_bytes` that a rank stored (header, its
    fingerprint, payload): what the tiers' byte-capped indexes count."""
    return HEADER.size + len(RANK_FINGERPRINT_PREFIX) + 2 * RANK_FINGERPRINT_DIGEST_BYTES + payload_bytes


def key_namespace(model: str, layout: str, dtype: str) -> str:
    """A short namespace for keys: a digest of the model, the cache layout and the dtype, so that
    engines serving different models or layouts never read each other's objects (the fingerprint
    inside each object checks the layout again when it is read)."""
    digest = hashlib.blake2b("\0".join((model, layout, dtype)).encode(), digest_size=10).hexdigest()
    return f"ds{FORMAT_VERSION}-{digest}"


def worker_id(*, pp_rank: int, pp_size: int, tp_rank: int, tp_size: int, dcp_rank: int = 0, dcp_size: int = 1) -> str:
    """The PP-aware id of the worker that stores an object, e.g. "pp1of2-tp0of4-dcp0of1".

    Each pipeline stage holds other layers and each TP/DCP rank other heads or tokens, so each
    stores its own objects; the sizes are part of the id so that a TP=2 rank 0 never reads what a
    TP=4 rank 0 wrote.
    """
    for axis, rank, size in (("pp", pp_rank, pp_size), ("tp", tp_rank, tp_size), ("dcp", dcp_rank, dcp_size)):
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"worker_id: {axis}_rank={rank} must lie in [0, {axis}_size={size})")
    return f"pp{pp_rank}of{pp_size}-tp{tp_rank}of{tp_size}-dcp{dcp_rank}of{dcp_size}"


def prefix_hash_hex(chained_prefix_hash: bytes | int | str) -> str:
    """The chained prefix hash as lower-case hex: bytes as their hex, a non-negative int as its hex
    digits, a str as given (it must already be hex)."""
    if isinstance(chained_prefix_hash, bytes):
        if not chained_prefix_hash:
            raise ValueError("chained_prefix_hash is empty bytes")
        return chained_prefix_hash.hex()
    if isinstance(chained_prefix_hash, int):
        if chained_prefix_hash < 0:
            raise ValueError(f"chained_prefix_hash={chained_prefix_hash} is negative; pass the unsigned digest")
        return format(chained_prefix_hash, "x")
    text = chained_prefix_hash.lower()
    if not text or any(c not in "0123456789abcdef" for c in text):
        raise ValueError(f"chained_prefix_hash={chained_prefix_hash!r} is not a hex string")
    return text


def object_key(namespace: str, chained_prefix_hash: bytes | int | str, kind: ObjectKind, rank: str) -> str:
    """The key of one stored object: "namespace:rank:kind:hash".

    `namespace` comes from key_namespace, `rank` from worker_id, `kind` is "kv" (a chunk of KV
    blocks ending at the hashed block) or "state" (the KDA state image at that block's end).
    """
    if kind not in OBJECT_KINDS:
        raise ValueError(f"object_key: kind={kind!r} must be one of {OBJECT_KINDS}")
    for field, value in (("namespace", namespace), ("rank", rank)):
        if not value or KEY_SEPARATOR in value or any(c.isspace() for c in value):
            raise ValueError(f"object_key: {field}={value!r} must be non-empty, "
                             f"without whitespace or {KEY_SEPARATOR!r}")
    return KEY_SEPARATOR.join((namespace, rank, kind, prefix_hash_hex(chained_prefix_hash)))
