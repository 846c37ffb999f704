"""Shared by the offload tests: random payloads, the layout fingerprint, and damaged objects."""

import random

from deltaserve.offload.objects import encode

FINGERPRINT = "kv:mla576:bf16:block16|state:kda:h32k128v128:fp32"
DAMAGES = ("truncated", "bit_flip", "foreign_fingerprint", "garbage")


def blob(nbytes: int, seed: int) -> bytes:
    """`nbytes` random bytes, the same for the same seed (payloads are never zeros)."""
    return random.Random(seed).randbytes(nbytes)


def damaged_object(payload: bytes, damage: str) -> bytes:
    """The stored object of `payload` with one kind of damage from DAMAGES."""
    obj = bytearray(encode(payload, FINGERPRINT))
    if damage == "truncated":
        return bytes(obj[: len(obj) // 2])
    if damage == "bit_flip":
        obj[-1] ^= 0x01
        return bytes(obj)
    if damage == "foreign_fingerprint":
        return encode(payload, "kv:mla576:fp8")
    if damage == "garbage":
        return blob(64, seed=len(payload))
    raise ValueError(f"damage={damage!r} is not one of {DAMAGES}")
