"""The stored object format and the keys: round trips, every kind of damage, and key isolation."""

import pytest

from deltaserve.offload.objects import (
    HEADER,
    CorruptObject,
    decode,
    encode,
    key_namespace,
    object_key,
    worker_id,
)
from offload.damage import FINGERPRINT, blob


@pytest.mark.parametrize("nbytes", [1, 17, 4096, 100_003])
def test_round_trip(nbytes):
    data = blob(nbytes, seed=nbytes)
    obj = encode(data, FINGERPRINT)
    assert len(obj) == HEADER.size + len(FINGERPRINT.encode()) + nbytes
    assert decode(obj, FINGERPRINT) == data


def test_round_trip_from_a_memoryview_of_floats():
    floats = memoryview(bytearray(blob(64, seed=0))).cast("f")
    assert decode(encode(floats, FINGERPRINT), FINGERPRINT) == floats.tobytes()


def damaged(kind: str) -> bytes:
    obj = bytearray(encode(blob(1000, seed=1), FINGERPRINT))
    if kind == "truncated":
        return bytes(obj[:-1])
    if kind == "header_only":
        return bytes(obj[: HEADER.size - 3])
    if kind == "bad_magic":
        obj[0] ^= 0xFF
    elif kind == "bad_version":
        obj[4] += 1
    elif kind == "trailing_bytes":
        obj += b"\x01"
    elif kind == "checksum_mismatch":
        obj[-500] ^= 0x01
    return bytes(obj)


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ("truncated", "truncated"),
        ("header_only", "truncated"),
        ("bad_magic", "bad_magic"),
        ("bad_version", "bad_version"),
        ("trailing_bytes", "trailing_bytes"),
        ("checksum_mismatch", "checksum_mismatch"),
    ],
)
def test_damage_is_named(kind, reason):
    with pytest.raises(CorruptObject) as caught:
        decode(damaged(kind), FINGERPRINT)
    assert caught.value.reason == reason
    assert isinstance(caught.value, ValueError)


def test_foreign_fingerprint_is_refused():
    obj = encode(blob(100, seed=0), "kv:mla576:fp16")
    with pytest.raises(CorruptObject, match="foreign_fingerprint.*fp16"):
        decode(obj, FINGERPRINT)


def test_fingerprint_too_long_is_refused():
    with pytest.raises(ValueError, match="fingerprint"):
        encode(b"x", "f" * 70_000)


def all_worker_ids(pp_size: int, tp_size: int, dcp_size: int) -> list[str]:
    return [
        worker_id(pp_rank=p, pp_size=pp_size, tp_rank=t, tp_size=tp_size, dcp_rank=d, dcp_size=dcp_size)
        for p in range(pp_size)
        for t in range(tp_size)
        for d in range(dcp_size)
    ]


def test_keys_of_stages_and_ranks_never_collide():
    namespace = key_namespace("kimi-linear-48b", FINGERPRINT, "bfloat16")
    block_hash = bytes(range(16))
    ranks = all_worker_ids(4, 2, 1) + all_worker_ids(2, 4, 2) + all_worker_ids(1, 8, 1)
    keys = {object_key(namespace, block_hash, kind, rank) for rank in ranks for kind in ("kv", "state")}
    assert len(keys) == 2 * len(ranks)
    assert len(set(ranks)) == len(ranks) == 8 + 16 + 8


def test_key_layout_and_hash_forms():
    namespace = key_namespace("m", "layout", "bfloat16")
    rank = worker_id(pp_rank=1, pp_size=2, tp_rank=0, tp_size=2)
    assert rank == "pp1of2-tp0of2-dcp0of1"
    key = object_key(namespace, b"\xab\xcd", "state", rank)
    assert key == f"{namespace}:pp1of2-tp0of2-dcp0of1:state:abcd"
    assert object_key(namespace, 0xABCD, "state", rank) == key
    assert object_key(namespace, "ABCD", "state", rank) == key


def test_namespaces_differ_by_model_layout_and_dtype():
    base = ("m", "layout", "bfloat16")
    variants = [base, ("m2", "layout", "bfloat16"), ("m", "layout2", "bfloat16"), ("m", "layout", "float16")]
    assert len({key_namespace(*v) for v in variants}) == 4


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (("ns", b"\x01", "kv", "pp0:tp0"), "rank"),
        (("n s", b"\x01", "kv", "r"), "namespace"),
        (("ns", b"\x01", "blocks", "r"), "kind"),
        (("ns", -5, "kv", "r"), "negative"),
        (("ns", "xyz", "kv", "r"), "hex"),
        (("ns", b"", "kv", "r"), "empty"),
    ],
)
def test_bad_key_parts_are_refused(args, field):
    with pytest.raises(ValueError, match=field):
        object_key(*args)


def test_worker_id_checks_ranks():
    with pytest.raises(ValueError, match="pp_rank=2"):
        worker_id(pp_rank=2, pp_size=2, tp_rank=0, tp_size=1)
