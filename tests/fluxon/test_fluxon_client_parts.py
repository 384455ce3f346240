"""The roles the Fluxon client is made of, each alone, over fakes or plain files (no fluxon-py,
no service): the key index, held views, the segment mappings, finding the owner, the service's
configs and the native output sent to the log."""

from __future__ import annotations

import json
import logging
import mmap
import os
import socket
import threading

import pytest

from cacheseek.fluxon.config import SEGMENT_ALIGN, master_config, owner_config
from cacheseek.fluxon.errors import FluxonUnavailableError
from cacheseek.fluxon.held_views import HeldViews
from cacheseek.fluxon.key_index import KeyIndex
from cacheseek.fluxon.native_output import native_output_to_log
from cacheseek.fluxon.owner import owner_info
from cacheseek.fluxon.segment import SegmentMapping, file_generation, mappings_of, zero_copy_mapping


# -- KeyIndex -----------------------------------------------------------------------------------


class FakeEtcd:
    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def put(self, key: str, value: bytes) -> None:
        self.data[key] = value

    def delete(self, key: str) -> None:
        self.data.pop(key, None)

    def get_prefix(self, prefix: str) -> list[tuple[bytes, bytes]]:
        return [(k.encode(), v) for k, v in sorted(self.data.items()) if k.startswith(prefix)]


def run(op, key, fn, timeout=None):
    return fn()


def test_key_index_lists_what_it_added_and_repairs_itself(caplog):
    etcd = FakeEtcd()
    index = KeyIndex(etcd, "c1", run)
    assert index.path("p/a") == "/cacheseek/key_index/c1/p/a"
    for k in ("p/b", "p/a", "q/a"):
        index.add(k)
    held = {"p/a", "p/b", "q/a"}
    asked = []

    def exists(k):
        asked.append(k)
        return k in held

    def count(prefix):
        return sum(k.startswith(prefix) for k in held)

    assert index.list_keys("p/", count, exists) == ["p/a", "p/b"] and asked == []  # counts agree
    held.discard("p/b")  # evicted by Fluxon: the stale entry is dropped
    with caplog.at_level(logging.INFO, logger="cacheseek.fluxon.key_index"):
        assert index.list_keys("p/", count, exists) == ["p/a"]
    assert "dropped 1 stale index entries" in caplog.text
    assert index.path("p/b") not in etcd.data
    held.add("p/foreign")  # written by another client straight through fluxon-py
    with caplog.at_level(logging.WARNING, logger="cacheseek.fluxon.key_index"):
        assert index.list_keys("p/", count, exists) == ["p/a"]
    assert "1 keys in Fluxon were not written through CacheSeek's key index" in caplog.text
    index.remove("q/a")
    assert list(etcd.data) == [index.path("p/a")]


# -- HeldViews ----------------------------------------------------------------------------------


class View:
    def __init__(self, key: str, ptr: int) -> None:
        self.key, self._ptr, self.released = key, ptr, False


def test_a_remove_hides_the_value_a_view_still_holds_until_none_is_held():
    held = HeldViews(threading.Lock())
    a = View("k", 0x100)
    assert held.track(a) and held.open_views() == [a]
    held.removed("k")
    assert held.hides("k", 0x100)  # the same bytes read back: the removed value, a miss
    assert not held.hides("k", 0x200)  # put again elsewhere: a real value
    assert not held.track(View("k", 0x100))
    b = View("k", 0x200)
    assert held.track(b)
    a.released = True
    held.forget(a)
    assert held.hides("k", 0x100)  # b of the same key is still held
    b.released = True
    held.forget(b)
    assert not held.hides("k", 0x100) and held.open_views() == []
    held.removed("nothing-held")
    assert not held.hides("nothing-held", 0x100)


# -- the segment as mapped ----------------------------------------------------------------------


def test_mappings_of_a_file_and_the_one_views_point_into(tmp_path):
    path = tmp_path / "mmap.file"
    path.write_bytes(b"\0" * 3 * mmap.PAGESIZE)
    with open(path, "r+b") as f:
        ro = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        rw = mmap.mmap(f.fileno(), mmap.PAGESIZE, access=mmap.ACCESS_WRITE)
    try:
        maps = mappings_of(path)
        assert len(maps) == 2 and all(m.path == os.path.realpath(path) for m in maps)
        assert sorted(m.length for m in maps) == [mmap.PAGESIZE, 3 * mmap.PAGESIZE]
        chosen = zero_copy_mapping(maps)
        assert not chosen.writable and chosen.length == 3 * mmap.PAGESIZE
        assert chosen.contains(chosen.start, 16) and not chosen.contains(chosen.end - 8, 16)
    finally:
        ro.close()
        rw.close()
    assert mappings_of(path) == [] and zero_copy_mapping([]) is None
    only_rw = [SegmentMapping("/x", 0x1000, 0x3000, "rw-s")]
    assert zero_copy_mapping(only_rw) == only_rw[0]  # no read-only one: the largest of any kind
    generation = file_generation(path)
    assert generation == file_generation(path) and 0 <= generation < 2**31
    fresh = tmp_path / "mmap.new"
    fresh.write_bytes(b"\0")  # made while the old file exists: another inode
    os.replace(fresh, path)  # a restarted owner's recreated segment
    assert file_generation(path) != generation


# -- finding the owner --------------------------------------------------------------------------


def test_owner_info_is_checked_before_fluxon_is_touched(tmp_path):
    seg = tmp_path / "c1"
    with pytest.raises(FluxonUnavailableError, match="no Fluxon owner serves cluster 'c1'.*fluxon_service.py start"):
        owner_info(seg, "c1", str(tmp_path))
    seg.mkdir()
    (seg / "shared.json").write_text("{not json")
    with pytest.raises(FluxonUnavailableError, match="cannot read the owner's"):
        owner_info(seg, "c1", str(tmp_path))
    (seg / "shared.json").write_text(json.dumps({"cluster_name": "other"}))
    with pytest.raises(FluxonUnavailableError, match="belongs to cluster 'other', not 'c1'"):
        owner_info(seg, "c1", str(tmp_path))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    (seg / "shared.json").write_text(json.dumps({"cluster_name": "c1", "etcd_addresses": [f"127.0.0.1:{dead}"]}))
    with pytest.raises(FluxonUnavailableError, match="is stale: the service that wrote it is gone"):
        owner_info(seg, "c1", str(tmp_path))
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        info = {"cluster_name": "c1", "segment_len": 1 << 24, "etcd_addresses": [f"127.0.0.1:{srv.getsockname()[1]}"]}
        (seg / "shared.json").write_text(json.dumps(info))
        assert owner_info(seg, "c1", str(tmp_path)) == info


# -- the service's configs ----------------------------------------------------------------------


def test_master_and_owner_configs_share_the_cluster_and_etcd(tmp_path):
    etcd = ["127.0.0.1:2379"]
    master = master_config("c1", 5000, etcd, tmp_path / "logs")
    owner = owner_config("c1", 2 * SEGMENT_ALIGN, etcd, "/dev/shm/x", tmp_path / "large", 6000)
    assert master["cluster_name"] == owner["fluxonkv_spec"]["cluster_name"] == "c1"
    assert master["etcd_endpoints"] == owner["fluxonkv_spec"]["etcd_addresses"] == etcd
    assert master["instance_key"] == "c1-master" and owner["instance_key"] == "c1-owner"
    assert owner["contribute_to_cluster_pool_size"] == {"dram": 32 << 20, "vram": {}}
    assert owner["fluxonkv_spec"]["large_file_paths"] == [str(tmp_path / "large")]
    assert owner["fluxonkv_spec"]["p2p_listen_port"] == 6000


# -- native output ------------------------------------------------------------------------------


def test_native_output_goes_to_the_log_not_the_terminal(capfd, caplog):
    logger = logging.getLogger("cacheseek.test.native")
    with caplog.at_level(logging.INFO, logger="cacheseek.test.native"):
        with native_output_to_log(logger):
            os.write(1, b"\x1b[32mbanner\x1b[0m\n")
            os.write(2, b"config: x=1\n\n")
    out, err = capfd.readouterr()
    assert "banner" not in out and "config" not in err
    assert [r.getMessage() for r in caplog.records] == ["fluxon-py: banner", "fluxon-py: config: x=1"]


# -- EtcdRecords without an etcd ------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.fluxon_py  # grpc and etcd3 come with fluxon-py
def test_etcd_records_refused_at_once_then_not_asked_until_retry_after(caplog):
    """Nothing listens on the endpoint: the probe fails at once (a miss the caller can tell from
    an absent record), and the next calls fail without a connection attempt for retry_after_s."""
    import time

    from cacheseek.fluxon.records import EtcdRecords
    from cacheseek.kv.records import ChunkRecord

    records = EtcdRecords([f"127.0.0.1:{_free_port()}"], "c1", op_timeout_s=2.0)
    records.retry_after_s = 0.5
    assert records.shared and records.key("ab:rec") == b"/cacheseek/records/c1/ab:rec"
    key = bytes(range(32))
    t0 = time.monotonic()
    assert records.probe([key]) is None and records.find([key]) == [None]
    assert time.monotonic() - t0 < 1.5
    assert "UNAVAILABLE" in caplog.text and "not sent" in caplog.text  # the second one was not sent
    rec = ChunkRecord(node_key=key, parent_key=key, root_hash=key, depth=1, n_layers=1, nbytes=1)
    assert not records.publish(rec) and records.stats.publish_errors == 1
    records.retract(key)  # never raises
    assert records.stats.probe_errors == 2 and records.stats.retracted == 0
    time.sleep(0.6)
    caplog.clear()
    assert records.probe([key]) is None and "UNAVAILABLE" in caplog.text  # asked again after the pause
    records.close()
    records.close()
    caplog.clear()
    assert records.probe([key]) is None and "closed" in caplog.text


@pytest.mark.fluxon_py  # grpc and etcd3 come with fluxon-py
def test_etcd_records_need_host_port_endpoints():
    from cacheseek.errors import ConfigError, StoreError
    from cacheseek.fluxon.records import EtcdRecords

    for bad in ([], ["localhost"], ["http://h:1x"]):
        with pytest.raises(StoreError, match="host:port"):
            EtcdRecords(bad, "c1")
    with pytest.raises(ConfigError, match="op_timeout_s"):
        EtcdRecords(["127.0.0.1:1"], "c1", op_timeout_s=0)


@pytest.mark.fluxon_py  # grpc and etcd3 come with fluxon-py
def test_etcd_records_move_to_the_next_endpoint_and_pause_once_every_one_failed(caplog):
    from cacheseek.fluxon.records import EtcdRecords

    first, second = f"127.0.0.1:{_free_port()}", f"127.0.0.1:{_free_port()}"
    records = EtcdRecords([first, second], "c1", op_timeout_s=2.0)
    key = bytes(32)
    assert records.probe([key]) is None and records.endpoint == second and first in caplog.text
    caplog.clear()
    assert records.probe([key]) is None and records.endpoint == first and second in caplog.text  # asked
    caplog.clear()
    assert records.probe([key]) is None and "not sent" in caplog.text  # both failed in a row: paused
    records.close()


# -- the records' etcd transactions, encoded by hand ------------------------------------------------


def _etcdrpc():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from etcd3 import etcdrpc
        from etcd3.etcdrpc import kv_pb2
    return etcdrpc, kv_pb2


@pytest.mark.fluxon_py  # grpc and etcd3 come with fluxon-py
def test_hand_encoded_transactions_are_the_generated_classes_bytes():
    from cacheseek.fluxon import etcd_txn

    rpc, _ = _etcdrpc()
    keys = [b"/cacheseek/records/c/" + bytes([i]) * 70 for i in range(3)] + [b"k" * 300]
    want = rpc.TxnRequest(success=[rpc.RequestOp(request_range=rpc.RangeRequest(key=k)) for k in keys])
    assert etcd_txn.gets_request(keys) == want.SerializeToString()
    value = bytes(range(256)) * 40
    want = rpc.TxnRequest(
        compare=[rpc.Compare(key=keys[3], target=rpc.Compare.CREATE, result=rpc.Compare.EQUAL, create_revision=0)],
        success=[rpc.RequestOp(request_put=rpc.PutRequest(key=keys[3], value=value))])
    assert etcd_txn.put_new_request(keys[3], value) == want.SerializeToString()


@pytest.mark.fluxon_py  # grpc and etcd3 come with fluxon-py
def test_hand_decoded_replies_read_what_the_generated_classes_wrote():
    from cacheseek.fluxon import etcd_txn

    rpc, kv_pb2 = _etcdrpc()
    header = rpc.ResponseHeader(cluster_id=2**63 + 5, member_id=7, revision=123456, raft_term=3)

    def found(value: bytes):
        kv = kv_pb2.KeyValue(key=b"k" * 90, value=value, create_revision=99, mod_revision=2**40, version=1, lease=5)
        return rpc.ResponseOp(response_range=rpc.RangeResponse(header=header, kvs=[kv], count=1))

    absent = rpc.ResponseOp(response_range=rpc.RangeResponse(header=header))
    reply = rpc.TxnResponse(header=header, succeeded=True,
                            responses=[found(b"x" * 9000), absent, found(b""), found(b"rec")]).SerializeToString()
    assert etcd_txn.values_of(reply, 4) == [b"x" * 9000, None, b"", b"rec"]
    assert etcd_txn.succeeded(reply)
    assert not etcd_txn.succeeded(rpc.TxnResponse(header=header, succeeded=False).SerializeToString())
    with pytest.raises(ValueError, match="3 range reads for 4 keys"):
        etcd_txn.values_of(rpc.TxnResponse(responses=[absent] * 3).SerializeToString(), 4)
    with pytest.raises(ValueError, match="not a range read"):
        etcd_txn.values_of(rpc.TxnResponse(responses=[rpc.ResponseOp(response_put=rpc.PutResponse())])
                           .SerializeToString(), 1)
    for bad in (reply[:-3], b"\xff" * 12):
        with pytest.raises(ValueError, match="etcd reply"):
            etcd_txn.values_of(bad, 4)
