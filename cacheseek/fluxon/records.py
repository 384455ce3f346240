"""`EtcdRecords`: a Fluxon cluster's chunk records (the shared index), kept in the cluster's etcd.

Every Fluxon cluster runs an etcd (its master and owners register there); every client learns
its endpoints when it attaches (``get_etcd_config``). A chunk's record (`cacheseek.kv.records`)
is one etcd key, ``/cacheseek/records/<cluster>/<node hex>:rec``, so every worker of the cluster,
on any host, finds a chunk by its key. fluxon-py 0.2.4 itself has no batched existence check
(``is_exist`` costs 10-50 ms a key) and its ``EtcdKvClient`` offers single gets only; etcd's
transaction does what the index needs in one round trip each:

- ``_get_many(names)``: ONE transaction of up to 128 range reads (etcd's default
  ``--max-txn-ops``; more keys take one transaction per 128), linearizable;
- ``_put_new(name, data)``: one transaction "if the key's create revision is 0, put": the first
  writer wins, a second writer's record is not stored;
- ``_delete``: one delete; ``_names``: one keys-only range read of the cluster's prefix.

The calls go straight to etcd's gRPC API on one channel: the two transactions as bytes encoded by
hand (`cacheseek.fluxon.etcd_txn`: the protobuf fluxon-py pins runs as pure Python, half of a
probe's time through the generated classes), the delete and the listing through the ``etcd3``
package's generated stubs (a dependency of fluxon-py); each with a gRPC deadline of
``op_timeout_s``: a hung etcd costs a
call at most that (``StoreTimeoutError``), a stopped one fails at once (connection refused). After
either, the next endpoint is used; once every endpoint failed in a row (a single-host service has
one), none is asked again for ``retry_after_s``: calls fail at once meanwhile (the base class makes
a failed probe a miss and a failed publication an unshared chunk), so sessions run cold without
waiting on every probe.

Lifecycle: built when a `FluxonClient` attaches (no connection is made before the first call);
`close` (idempotent) closes the channel; calls after it raise `StoreClosedError` (misses).

Importing this module needs neither grpc nor fluxon-py: the stubs are imported at construction.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Optional

import attrs

from cacheseek.errors import ConfigError, StoreClosedError, StoreError, StoreTimeoutError
from cacheseek.fluxon import etcd_txn
from cacheseek.kv.records import ChunkRecords

__all__ = ["EtcdRecords", "MAX_TXN_OPS", "RECORDS_ROOT"]

RECORDS_ROOT = "/cacheseek/records/"
MAX_TXN_OPS = 128  # etcd's default --max-txn-ops


@attrs.frozen
class _Stubs:
    """The calls on one channel: etcd's KV service (generated stubs) and the raw transaction
    (`cacheseek.fluxon.etcd_txn`: bytes in, bytes out)."""

    kv: Any
    txn: Callable[..., bytes]


class EtcdRecords(ChunkRecords):
    """The chunk records of cluster ``cluster_name`` in its etcd at ``endpoints`` (``host:port``
    each, as fluxon-py reports them); see the module docstring."""

    shared = True
    retry_after_s = 5.0  # after an unreachable or timed-out etcd, calls fail at once this long

    def __init__(self, endpoints: Sequence[str], cluster_name: str, *, op_timeout_s: float = 30.0) -> None:
        eps = [str(e) for e in endpoints or ()]
        if not eps or not all(e.rpartition(":")[0] and e.rpartition(":")[2].isdigit() for e in eps):
            raise StoreError(f"fluxon cluster {cluster_name!r}: etcd endpoints {list(endpoints or ())!r} are not "
                             "host:port entries (what the client's get_etcd_config reported)")
        if isinstance(op_timeout_s, bool) or not isinstance(op_timeout_s, (int, float)) or op_timeout_s <= 0:
            raise ConfigError("store.op_timeout_s", f"must be a positive number of seconds, got {op_timeout_s!r}")
        super().__init__()
        import grpc

        with warnings.catch_warnings():  # etcd3's generated code uses protobuf's deprecated descriptors
            warnings.simplefilter("ignore", DeprecationWarning)
            from etcd3 import etcdrpc

        self._grpc, self._rpc = grpc, etcdrpc
        self.endpoints = tuple(eps)
        self.cluster_name = cluster_name
        self.op_timeout_s = float(op_timeout_s)
        self.prefix = f"{RECORDS_ROOT}{cluster_name}/"
        self._state = threading.Lock()
        self._at = 0  # the endpoint in use
        self._channel: Any = None
        self._stubs: Optional[_Stubs] = None
        self._down_until = 0.0
        self._down_why = ""
        self._failures = 0  # endpoints that failed in a row
        self._closed = False
        self._connect()

    def _connect(self) -> None:
        """Under ``_state`` (or in the constructor): a channel to the current endpoint (lazy:
        gRPC connects on the first call), its KV stub and the raw transaction call."""
        self._channel = self._grpc.insecure_channel(self.endpoints[self._at])
        self._stubs = _Stubs(self._rpc.KVStub(self._channel), self._channel.unary_unary(etcd_txn.TXN_METHOD))

    @property
    def endpoint(self) -> str:
        return self.endpoints[self._at]

    def key(self, name: str) -> bytes:
        """The etcd key of record ``name``."""
        return (self.prefix + name).encode("utf-8")

    # -- one bounded call -----------------------------------------------------------------------
    def _call(self, op: str, send: Callable[["_Stubs", float], Any]) -> Any:
        """``send(stubs, timeout)``: one RPC, with ``op_timeout_s`` as its deadline."""
        with self._state:
            if self._closed:
                raise StoreClosedError(f"the chunk records of fluxon cluster {self.cluster_name!r} are closed")
            left = self._down_until - time.monotonic()
            if left > 0:
                raise StoreError(f"etcd {op} not sent: {self._down_why}; asked again in {left:.1f} s")
            endpoint, stubs = self.endpoints[self._at], self._stubs
        grpc = self._grpc
        try:
            reply = send(stubs, self.op_timeout_s)
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            timed_out = code == grpc.StatusCode.DEADLINE_EXCEEDED
            where = f"etcd {op} at {endpoint} (records of fluxon cluster {self.cluster_name!r})"
            if timed_out:
                what = f"{where} did not answer within {self.op_timeout_s:.1f} s (store.op_timeout_s)"
            else:
                detail = exc.details() if isinstance(exc, grpc.Call) else str(exc)
                what = f"{where} failed: {code.name if code is not None else 'RpcError'}: {detail}"
            if timed_out or code == grpc.StatusCode.UNAVAILABLE:
                self._mark_down(endpoint, what)
            raise (StoreTimeoutError(what) if timed_out else StoreError(what)) from None
        if self._failures:
            with self._state:
                self._failures = 0
        return reply

    def _mark_down(self, endpoint: str, why: str) -> None:
        """``endpoint`` is unreachable or hung: the next endpoint is used from now on; once every
        endpoint failed in a row, none is asked for ``retry_after_s``."""
        with self._state:
            if self._closed or self.endpoints[self._at] != endpoint:
                return  # closed, or another call moved on already
            self._failures += 1
            if self._failures >= len(self.endpoints):
                self._down_until = time.monotonic() + self.retry_after_s
                self._down_why = why
                self._failures = 0
            if len(self.endpoints) > 1:
                self._channel.close()
                self._at = (self._at + 1) % len(self.endpoints)
                self._connect()

    # -- the raw operations of ChunkRecords -----------------------------------------------------
    def _put_new(self, name: str, data: bytes) -> bool:
        request = etcd_txn.put_new_request(self.key(name), bytes(data))
        return etcd_txn.succeeded(self._call("put", lambda s, t: s.txn(request, timeout=t)))

    def _get_many(self, names: Sequence[str]) -> list[Optional[bytes]]:
        out: list[Optional[bytes]] = []
        for i in range(0, len(names), MAX_TXN_OPS):
            batch = names[i:i + MAX_TXN_OPS]
            request = etcd_txn.gets_request([self.key(n) for n in batch])
            reply = self._call("get", lambda s, t: s.txn(request, timeout=t))
            try:
                out += etcd_txn.values_of(reply, len(batch))
            except ValueError as exc:
                raise StoreError(f"etcd at {self.endpoint}: {exc}") from None
        return out

    def _delete(self, name: str) -> None:
        request = self._rpc.DeleteRangeRequest(key=self.key(name))
        self._call("delete", lambda s, t: s.kv.DeleteRange(request, timeout=t))

    def _names(self) -> list[str]:
        root = self.prefix.encode("utf-8")
        end = root[:-1] + bytes([root[-1] + 1])  # etcd's range of every key starting with root
        request = self._rpc.RangeRequest(key=root, range_end=end, keys_only=True)
        reply = self._call("list", lambda s, t: s.kv.Range(request, timeout=t))
        return [bytes(kv.key)[len(root):].decode("utf-8") for kv in reply.kvs]

    # -- lifetime -------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Close the channel; later calls fail (`StoreClosedError`: misses). Idempotent."""
        with self._state:
            if self._closed:
                return
            self._closed = True
            channel, self._channel, self._stubs = self._channel, None, None
        channel.close()

    def __repr__(self) -> str:
        return f"EtcdRecords(cluster={self.cluster_name!r}, etcd={self.endpoint}, closed={self._closed})"
