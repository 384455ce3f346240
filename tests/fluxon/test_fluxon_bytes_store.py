"""FluxonClient, FluxonBytesStore and FluxonTensorTier against a real local Fluxon service.

Marked ``fluxon`` (see conftest.py); a few pure tests of the value codec and the registration run
in the normal suite.
"""

from __future__ import annotations

import hashlib
import logging
import time

import numpy as np
import pytest
import torch

from cacheseek.errors import (
    ConfigError,
    CorruptValueError,
    HandleStateError,
    StoreClosedError,
    StoreError,
    StoreFullError,
    WriteNotCompleteError,
)
from cacheseek.fluxon.client import FluxonValueTooLargeError, VALUE_FIELD
from cacheseek.kv.records import ChunkRecord
from cacheseek.registry import STORES
from cacheseek.reuse.exact_prefix.keys import layer_keys
from cacheseek.reuse.exact_prefix.types import BlobHandle, Tier
from cacheseek.stores.checksum import claimed_digest
from cacheseek.stores.fluxon_bytes import (
    FluxonBytesStore,
    FluxonTensorTier,
    FluxonValueBackend,
    decode_value,
    encode_header,
)

MiB = 1 << 20


# -- pure ---------------------------------------------------------------------------------------


def test_registered_as_store_backend():
    assert STORES.get("fluxon") is FluxonTensorTier
    schema = STORES.schema("fluxon")
    s = schema()
    assert (s._target_, s.cluster_name, s.share_mem_path, s.instance_key, s.op_timeout_s, s.attach_timeout_s,
            s.read_parallelism) == (
        "cacheseek.stores.fluxon_bytes.FluxonTensorTier", "cacheseek", "/dev/shm/cacheseek-fluxon",
        "cacheseek-client", 30.0, 30.0, 4)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_a_bad_read_parallelism_is_refused_before_attaching(bad):
    with pytest.raises(ConfigError, match="store.read_parallelism"):
        FluxonTensorTier(share_mem_path="/nonexistent/segment", read_parallelism=bad)


class _FakeView:
    def __init__(self, body: bytes) -> None:
        self.array = np.frombuffer(body, dtype=np.uint8)
        self.nbytes = len(body)

    def tobytes(self) -> bytes:
        return self.array.tobytes()


@pytest.mark.parametrize("value", [
    torch.tensor([[-0.0, float("inf")], [float("nan"), 1e-40]]).to(torch.bfloat16),
    torch.arange(24, dtype=torch.int32).reshape(2, 3, 4),
    torch.zeros(0, 5),
    b"raw bytes", "text",
])
def test_value_codec_round_trips(value):
    header, body = encode_header("k", value)
    out = decode_value("k", header, _FakeView(bytes(body)))
    if isinstance(value, torch.Tensor):
        assert out.dtype == value.dtype and out.shape == value.shape
        assert out.reshape(-1).view(torch.uint8).equal(value.reshape(-1).view(torch.uint8))
    else:
        assert out == value


@pytest.mark.parametrize("where", ["body", "header", "no-checksum", "another-key"])
def test_value_codec_detects_corruption(where):
    header, body = encode_header("j" if where == "another-key" else "k", torch.arange(16, dtype=torch.bfloat16))
    body = bytearray(bytes(body))
    if where == "body":
        body[7] ^= 0x01
    elif where == "header":
        header = header.replace(b'"shape":[16]', b'"shape":[8,2]')
    elif where == "no-checksum":
        header = b'{"dtype":"bfloat16","kind":"tensor","shape":[16],"v":2}'
    with pytest.raises(CorruptValueError) as info:
        decode_value("k", header, _FakeView(bytes(body)))
    assert info.value.key == "k"


def test_value_checksum_is_returned_and_checked_against_the_record():
    header, body = encode_header("k", torch.arange(8, dtype=torch.int32))
    digest = claimed_digest(header)
    assert decode_value("k", header, _FakeView(bytes(body)), digest).tolist() == list(range(8))
    other, _ = encode_header("k", torch.arange(8, dtype=torch.int32) + 1)  # another writer's bytes
    with pytest.raises(CorruptValueError, match="is not the .* its chunk's record names"):
        decode_value("k", other, _FakeView(bytes(body)), digest)
    assert FluxonValueBackend.checks_digests


def test_value_codec_rejects_mismatched_header():
    header, _ = encode_header("k", torch.zeros(4))
    with pytest.raises(Exception, match="holds 3 bytes"):
        decode_value("k", header, _FakeView(b"abc"))


# -- the client ---------------------------------------------------------------------------------

@pytest.mark.fluxon
@pytest.mark.parametrize("n", [0, 1, 4096, 64 * 1024, MiB])
def test_put_get_round_trip(fluxon_client, key_prefix, n):
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
    key = f"{key_prefix}v"
    fluxon_client.put_bytes(key, data, meta=b"hdr")
    assert fluxon_client.get_bytes(key) == data
    assert fluxon_client.get_with_meta(key) == (b"hdr", data)
    fluxon_client.remove(key)


@pytest.mark.fluxon
def test_missing_key_is_a_miss(fluxon_client, key_prefix):
    key = f"{key_prefix}absent"
    assert fluxon_client.get_bytes(key) is None
    assert fluxon_client.get_view(key) is None
    assert fluxon_client.exists(key) is False
    with fluxon_client.read(key) as view:
        assert view is None
    fluxon_client.remove(key)  # idempotent on a missing key


@pytest.mark.fluxon
def test_overwrite_and_remove(fluxon_client, key_prefix):
    key = f"{key_prefix}k"
    fluxon_client.put_bytes(key, b"one")
    fluxon_client.put_bytes(key, b"two, longer")
    assert fluxon_client.get_bytes(key) == b"two, longer" and fluxon_client.exists(key)
    fluxon_client.remove(key)
    fluxon_client.remove(key)
    assert fluxon_client.get_bytes(key) is None and not fluxon_client.exists(key)


@pytest.mark.fluxon
def test_list_keys_by_prefix_and_index_repair(fluxon_client, key_prefix, caplog):
    p = key_prefix
    for k in ("a/1", "a/2", "b/1"):
        fluxon_client.put_bytes(p + k, k.encode())
    assert fluxon_client.list_keys(p + "a/") == [p + "a/1", p + "a/2"]
    assert fluxon_client.list_keys(p) == [p + "a/1", p + "a/2", p + "b/1"]
    assert fluxon_client.count_prefix(p) == 3
    fluxon_client.remove(p + "a/1")
    assert fluxon_client.list_keys(p) == [p + "a/2", p + "b/1"]
    # a stale index entry (its value evicted, or a crash between the two writes) is dropped
    index = fluxon_client.key_index
    index.etcd.put(index.path(p + "ghost"), b"")
    assert fluxon_client.list_keys(p) == [p + "a/2", p + "b/1"]
    assert not any(k.endswith(b"ghost") for k, _ in index.etcd.get_prefix(index.path(p)))
    # a key another client wrote straight through fluxon-py is counted but cannot be listed
    res = fluxon_client.native_store.put_blocking(p + "foreign", {"payload": b"x"})
    res.unwrap()
    with caplog.at_level(logging.WARNING, logger="cacheseek.fluxon.client"):
        assert fluxon_client.list_keys(p) == [p + "a/2", p + "b/1"]
    assert "not written through CacheSeek's key index" in caplog.text
    with pytest.raises(StoreError, match="not written by CacheSeek"):  # fluxon's own 'payload' field
        fluxon_client.get_bytes(p + "foreign")
    for k in ("a/2", "b/1", "foreign"):
        fluxon_client.remove(p + k)


@pytest.mark.fluxon
def test_zero_copy_view_points_into_the_read_only_segment_mapping(fluxon_client, key_prefix):
    src = np.arange(MiB, dtype=np.uint32).view(np.uint8)[:MiB].copy()
    key = f"{key_prefix}z"
    fluxon_client.put_from_ptr(key, src.ctypes.data, src.nbytes, meta=b"m")
    seg = fluxon_client.segment_mapping()
    assert seg is not None and seg.path.endswith("/mmap.file")
    assert seg.length == fluxon_client.segment_bytes and seg.perms.startswith("r") and not seg.writable
    with fluxon_client.read(key) as view:
        assert view.zero_copy and view.nbytes == MiB and view.meta == b"m"
        assert seg.contains(view.ptr, view.nbytes)
        assert view.ptr % 64 == 0  # the 51-byte field name puts the payload 64 bytes into the slot
        assert not view.array.flags.writeable
        assert np.array_equal(view.array, src)
        assert view.holder is not None
    assert view.released
    with pytest.raises(HandleStateError):
        _ = view.ptr
    with pytest.raises(HandleStateError, match="twice"):
        view.release()
    fluxon_client.remove(key)


@pytest.mark.fluxon
def test_store_full_and_values_larger_than_the_segment(fluxon_client, key_prefix):
    seg = fluxon_client.segment_bytes
    assert seg == 64 * MiB
    # larger than the whole segment: refused before Fluxon is asked
    t0 = time.monotonic()
    with pytest.raises(FluxonValueTooLargeError, match="whole segment is 67108864 bytes"):
        fluxon_client.put_bytes(f"{key_prefix}huge", bytes(seg + 1))
    assert time.monotonic() - t0 < 1.0
    # smaller than the segment, but its power-of-two slot is not: Fluxon refuses, mapped clearly
    with pytest.raises(FluxonValueTooLargeError, match="power-of-two slots"):
        fluxon_client.put_bytes(f"{key_prefix}almost", bytes(seg - 100))
    assert not fluxon_client.exists(f"{key_prefix}almost")
    # fill it with 8 MiB values (16 MiB slots each) until Fluxon reports no space. Fluxon evicts
    # older values in the background under pressure, so more than 4 may get in before a put
    # outruns the eviction; the evicted ones are no longer listed.
    keys, chunk = [], bytes(8 * MiB)
    try:
        with pytest.raises(StoreFullError) as err:
            for i in range(16):
                key = f"{key_prefix}fill{i}"
                fluxon_client.put_bytes(key, chunk)
                keys.append(key)
        assert "No space left" in str(err.value) and "StorageFullError(6000)" in str(err.value)
        assert 1 <= len(keys) < 16
        listed = fluxon_client.list_keys(key_prefix)
        assert listed and set(listed) <= set(keys)  # the failed key is not indexed
    finally:
        for key in keys:
            fluxon_client.remove(key)
    # removal frees the space asynchronously (about 1 s here): it becomes usable again
    deadline = time.monotonic() + 10
    while True:
        try:
            fluxon_client.put_bytes(f"{key_prefix}after", chunk)
            break
        except StoreFullError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    fluxon_client.remove(f"{key_prefix}after")


# -- the stores ---------------------------------------------------------------------------------


@pytest.mark.fluxon
def test_bytes_store_attaches_itself_and_close_releases_views(fluxon_service, key_prefix):
    store = FluxonBytesStore(fluxon_service.cluster_name, fluxon_service.share_mem_path,
                             op_timeout_s=10.0, attach_timeout_s=60.0)
    try:
        store.put(f"{key_prefix}a", b"alpha")
        store.put(f"{key_prefix}b", bytearray(b"beta"))
        with pytest.raises(TypeError):
            store.put(f"{key_prefix}c", "text")  # type: ignore[arg-type]
        assert store.get(f"{key_prefix}a") == b"alpha" and store.get(f"{key_prefix}zz") is None
        assert store.list_keys(key_prefix) == [f"{key_prefix}a", f"{key_prefix}b"]
        store.remove(f"{key_prefix}a")
        store.remove(f"{key_prefix}a")
        assert store.list_keys(key_prefix) == [f"{key_prefix}b"]
        view = store.client.get_view(f"{key_prefix}b")
        assert view is not None and bytes(view.array) == b"beta"
    finally:
        store.client.remove(f"{key_prefix}b")
        store.close()
    assert view.released  # close released it before unmapping the segment
    view.release()  # already released by close: no-op
    with pytest.raises(StoreClosedError):
        store.get(f"{key_prefix}b")
    with pytest.raises(StoreClosedError):
        store.client.put_bytes("x", b"y")
    store.close()


@pytest.mark.fluxon
def test_bytes_store_on_a_shared_client_leaves_it_open(fluxon_client, key_prefix):
    store = FluxonBytesStore(client=fluxon_client)
    store.put(f"{key_prefix}k", b"v")
    assert store.get(f"{key_prefix}k") == b"v" and store.exists(f"{key_prefix}k")
    store.remove(f"{key_prefix}k")
    store.close()
    with pytest.raises(StoreClosedError):
        store.get(f"{key_prefix}k")
    assert not fluxon_client.closed


def _payload(n_layers: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = [(torch.randn(1, 4, 2, 4, generator=g).to(torch.bfloat16),
            torch.randn(1, 4, 2, 4, generator=g).to(torch.bfloat16)) for _ in range(n_layers)]
    out[0][0].view(-1)[:4] = torch.tensor([-0.0, float("inf"), float("nan"), 1e-40]).to(torch.bfloat16)
    return out


def _same_bits(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.fluxon
@pytest.mark.parametrize("write_back", [False, True])
def test_tensor_tier_round_trip_partial_layer_skeleton_free(fluxon_client, key_prefix, write_back):
    tier = FluxonTensorTier(client=fluxon_client, write_back=write_back, queue_depth=2)
    node = hashlib.sha256(key_prefix.encode()).digest()  # a chunk's locator names its node key
    loc = f"{node.hex()}:kv"
    payload = _payload(3)
    ready = []
    h = tier.put_async(loc, [(k.clone(), v.clone()) for k, v in payload], tier=Tier.FLUXON_DRAM,
                       on_ready=ready.append)
    tier.flush()
    assert isinstance(h, BlobHandle) and h.ready and ready == [h] and h.error is None
    assert h.nbytes == sum(k.nbytes + v.nbytes for k, v in payload) and h.n_layers == 3
    assert sorted(h.digests) == sorted(k for i in range(3) for k in layer_keys(loc, i))  # for the record
    assert tier.records is fluxon_client.records and tier.records.shared
    tier.records.publish(ChunkRecord(node_key=node, parent_key=bytes(32), root_hash=bytes(32), depth=0,
                                     n_layers=3, nbytes=h.nbytes, digests=h.digests))
    for i, (k, v) in enumerate(payload):
        got = tier.get_layer(h, i)
        assert got is not None and _same_bits(got[0], k) and _same_bits(got[1], v)
    assert tier.read_parallelism == 4  # a restore's reads overlap (get_layers)
    for got, (k, v) in zip(tier.get_layers([(h, i) for i in range(3)]), payload, strict=True):
        assert got is not None and _same_bits(got[0], k) and _same_bits(got[1], v)
    # a partially present layer is a miss, not a crash
    fluxon_client.remove(layer_keys(loc, 1)[1])
    assert tier.get_layer(h, 1) is None and tier.get_layer(h, 0) is not None
    assert [x is None for x in tier.get_layers([(h, 0), (h, 1)])] == [False, True]
    lat = torch.randn(1, 16, 3, 6, 10).to(torch.bfloat16)
    tier.put_skeleton(f"{key_prefix}lat", lat)
    assert _same_bits(tier.get_skeleton(f"{key_prefix}lat"), lat)
    assert tier.get_skeleton(f"{key_prefix}nolat") is None
    assert tier.keys(key_prefix) == [f"{key_prefix}lat"]
    assert set(tier.keys(node.hex())) == {*layer_keys(loc, 0), layer_keys(loc, 1)[0], *layer_keys(loc, 2)}
    tier.free(h)
    tier.free(h)  # idempotent
    assert tier.get_layer(h, 0) is None
    assert tier.keys(node.hex()) == [] and tier.records.find([node]) == [None]  # the record went first
    fluxon_client.remove(f"{key_prefix}lat")
    tier.close()
    assert not fluxon_client.closed  # a shared client stays open


@pytest.mark.fluxon
def test_tensor_tier_refuses_to_free_a_write_in_flight(fluxon_client, key_prefix):
    tier = FluxonTensorTier(client=fluxon_client)
    h = BlobHandle(tier=Tier.FLUXON_DRAM, locator=f"{key_prefix}x:kv", nbytes=0, n_layers=1)
    with pytest.raises(WriteNotCompleteError):
        tier.free(h)
    tier.close()


@pytest.mark.fluxon
def test_tensor_tier_failed_write_is_reported_and_cleaned(fluxon_client, key_prefix):
    """A chunk that Fluxon refuses fails on its handle (never ready) and leaves nothing behind."""
    tier = FluxonTensorTier(client=fluxon_client)
    big = torch.zeros(40 * MiB // 2, dtype=torch.bfloat16)  # 40 MiB: a 64 MiB slot each
    assert tier.capacity_bytes == fluxon_client.segment_bytes  # the service's segment
    with pytest.raises(StoreFullError, match="larger --dram"):  # 80 MiB > 64 MiB: refused at once
        tier.put_async(f"{key_prefix}big:kv", [(big, big)], tier=Tier.FLUXON_DRAM)
    tier.capacity_bytes = None  # let it through to Fluxon, which refuses it itself
    h = tier.put_async(f"{key_prefix}big:kv", [(big, big)], tier=Tier.FLUXON_DRAM)
    assert not h.ready and isinstance(h.error, StoreFullError)
    assert tier.stats.failed_writes == 1
    assert tier.keys(key_prefix) == []
    tier.close()


def test_value_field_name_length():
    assert len(VALUE_FIELD) == 51  # 13 + 51 = 64: payload alignment within the slot
