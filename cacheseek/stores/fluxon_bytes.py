"""Fluxon as a store: `FluxonBytesStore` (bytes under string keys) and `FluxonTensorTier`.

Both attach a `FluxonClient` to a running Fluxon service (``tools/fluxon_service.py start``)
identified by ``cluster_name`` and ``share_mem_path``; every call is bounded by ``op_timeout_s``
and attaching by ``attach_timeout_s`` (`StoreTimeoutError` naming the op and key past that):
the fields of `FluxonEndpoint`, given flat, checked once.

`FluxonBytesStore` (a Python API; ``+store=fluxon`` is the tensor tier below): ``put``/``get``/``remove``/
``list_keys``. A missing key reads as None; a full store raises `StoreFullError` with Fluxon's
text; a value that cannot fit the whole segment raises `FluxonValueTooLargeError`; no running
service raises `FluxonUnavailableError` at construction, at once.

`FluxonTensorTier` (store ``fluxon``): the generic per-layer tier (`KeyValueTier`) over Fluxon. Its
capacity is the service's segment (``tools/fluxon_service.py start --dram``). Values are CPU
tensors (any dtype, bf16 included), bytes or str; each is stored as its raw bytes plus a small
JSON header (kind, dtype, shape and an xxh3 checksum, `cacheseek.stores.checksum`) in the
value's metadata field, and read back as a new contiguous CPU tensor (one copy out of the
segment), verified after that copy: a mismatch reads as a missing value (`KeyValueTier`). Keys ``{locator}:L{i}:k|v`` and ``{hex}:lat``.
Its chunk records are the client's (`cacheseek.fluxon.records.EtcdRecords`): a chunk committed by
any worker of the cluster is found by its key, and a value whose checksum is not the one its
record names (another writer's bytes) is corrupt, read as missing.

Importing this module needs neither fluxon-py nor torch.
"""

from __future__ import annotations

import logging
import math
import sys
from typing import Any, Optional

from cacheseek.errors import CorruptValueError, StoreClosedError, StoreError
from cacheseek.fluxon.client import FluxonClient
from cacheseek.fluxon.config import DEFAULT_CLUSTER_NAME, DEFAULT_SHARE_MEM_PATH
from cacheseek.fluxon.endpoint import FluxonEndpoint
from cacheseek.kv.handles import Tier
from cacheseek.registry import STORES
from cacheseek.stores import checksum
from cacheseek.codecs.tier import TierCodec
from cacheseek.stores.kv_tier import KeyValueTier, check_read_parallelism

log = logging.getLogger(__name__)

__all__ = ["FluxonBytesStore", "FluxonTensorTier", "FluxonValueBackend", "decode_value", "encode_header"]

_HEADER_VERSION = 2  # 2: the checksum covers the value's key


def _make_client(client: Any, endpoint: FluxonEndpoint) -> tuple[Any, bool]:
    """``client`` (the caller keeps owning it), else one attached to ``endpoint`` now (owned)."""
    if client is not None:
        return client, False
    return FluxonClient.attach(endpoint), True


class FluxonBytesStore:
    """Bytes under string keys in a running Fluxon service.

    ``endpoint``: `FluxonEndpoint`'s fields (``cluster_name``, ``share_mem_path``,
    ``instance_key``, ``op_timeout_s``, ``attach_timeout_s``, ``settle_s``), positional in that
    order or by name. ``client``: an attached `FluxonClient` to use instead of attaching a new one
    (then `close` leaves it open). ``transfer`` is accepted and ignored (the orchestrator passes
    it to every store).
    """

    def __init__(self, *endpoint: Any, client: Any = None, transfer: Any = None, **endpoint_kw: Any) -> None:
        self._client, self._owns_client = _make_client(client, FluxonEndpoint(*endpoint, **endpoint_kw))
        self._closed = False

    @property
    def client(self) -> Any:
        """The underlying `FluxonClient`."""
        return self._client

    def put(self, key: str, data: bytes) -> None:
        """Store ``data`` (bytes, bytearray or memoryview) under ``key``, replacing any value."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"FluxonBytesStore.put: data must be bytes, got {type(data).__name__}")
        self._check_open()
        self._client.put_bytes(key, data)

    def get(self, key: str) -> Optional[bytes]:
        """The bytes under ``key``, or None when it is missing."""
        self._check_open()
        return self._client.get_bytes(key)

    def exists(self, key: str) -> bool:
        self._check_open()
        return self._client.exists(key)

    def remove(self, key: str) -> None:
        """Delete ``key``; a missing key is not an error."""
        self._check_open()
        self._client.remove(key)

    def list_keys(self, prefix: str = "") -> list[str]:
        """Sorted keys under ``prefix`` (those written through CacheSeek clients)."""
        self._check_open()
        return self._client.list_keys(prefix)

    def close(self) -> None:
        """Close the client (if this store attached it). Idempotent; later calls raise
        StoreClosedError."""
        if self._closed:
            return
        self._closed = True
        if self._owns_client:
            self._client.close()

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("fluxon_bytes store is closed")

    def __enter__(self) -> "FluxonBytesStore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# -- the tensor tier ----------------------------------------------------------------------------


def _torch() -> Any:
    import torch

    return torch


def _is_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")  # no torch imported: cannot be a tensor
    return torch is not None and isinstance(value, torch.Tensor)


def encode_header(key: str, value: Any) -> tuple[bytes, Any]:
    """``(header, body)`` of the value stored under ``key``: a small sealed JSON header
    (`cacheseek.stores.checksum`: kind, dtype, shape and the xxh3 checksum of key, header and
    body) and a zero-copy bytes-like body."""
    if isinstance(value, str):
        body: Any = value.encode("utf-8")
        head: dict[str, Any] = {"v": _HEADER_VERSION, "kind": "str"}
    elif isinstance(value, (bytes, bytearray, memoryview)):
        body, head = value, {"v": _HEADER_VERSION, "kind": "bytes"}
    elif _is_tensor(value):
        if value.device.type != "cpu":
            raise StoreError(f"fluxon tier: expected a CPU snapshot, got a tensor on {value.device}")
        torch = _torch()
        t = value.detach().contiguous()
        body = t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else b""
        head = {"v": _HEADER_VERSION, "kind": "tensor", "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape)}
    else:
        raise StoreError(f"fluxon tier: cannot store a {type(value).__name__} (tensor, bytes or str only)")
    return checksum.seal(key, head, body), body


def decode_value(key: str, meta: bytes, view: Any, expect: Optional[str] = None) -> Any:
    """The value of a sealed header and its payload view, verified after the copy out of the
    segment; `CorruptValueError` on a missing or wrong checksum, an inconsistent header, or a
    checksum other than ``expect`` (the one the chunk's record names: another writer's bytes)."""
    sealed = checksum.unseal(key, meta)
    if expect is not None and sealed.claimed != expect:
        raise CorruptValueError(key, f"checksum {sealed.claimed} is not the {expect} its chunk's record names "
                                     "(another writer's bytes)")
    head = sealed.meta
    kind = head.get("kind")
    if kind in ("bytes", "str"):
        raw = view.tobytes()
        sealed.verify(raw)
        return raw if kind == "bytes" else raw.decode("utf-8")
    if kind != "tensor":
        raise CorruptValueError(key, f"unknown kind {kind!r}")
    torch = _torch()
    dtype = getattr(torch, str(head.get("dtype")), None)
    shape = head.get("shape")
    if not isinstance(dtype, torch.dtype) or not isinstance(shape, list) or not all(
            isinstance(d, int) and d >= 0 for d in shape):
        raise CorruptValueError(key, f"bad dtype or shape in its header: {head}")
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes != view.nbytes:
        raise CorruptValueError(key, f"holds {view.nbytes} bytes, its header ({head['dtype']} {shape}) "
                                     f"says {nbytes}")
    out = torch.empty(shape, dtype=dtype)
    flat = out.reshape(-1).view(torch.uint8).numpy()
    if nbytes:
        flat[:] = view.array  # the one copy out of the segment
    sealed.verify(flat)
    return out


class FluxonValueBackend:
    """`ValueBackend` over a `FluxonClient`: values are tensors, bytes or str."""

    checks_digests = True  # write returns each value's checksum; read checks one (`KeyValueTier`)

    def __init__(self, client: Any, *, owns_client: bool = True) -> None:
        self.client = client
        self._owns_client = owns_client

    def write(self, key: str, value: Any) -> str:
        """Store ``value`` under ``key`` (replacing one that is there); the value's checksum."""
        header, body = encode_header(key, value)
        self.client.put_bytes(key, body, meta=header)
        return checksum.claimed_digest(header)

    def read(self, key: str, expect: Optional[str] = None) -> Optional[Any]:
        """The value, None when missing; `CorruptValueError` when damaged or, with ``expect``,
        when its checksum is not that one."""
        with self.client.read(key) as view:
            if view is None:
                return None
            return decode_value(key, view.meta, view, expect)

    def delete(self, key: str) -> None:
        self.client.remove(key)

    def keys(self, prefix: str = "") -> list[str]:
        return self.client.list_keys(prefix)

    def close(self) -> None:
        if self._owns_client:
            self.client.close()


@STORES.register("fluxon", objects=("client", "transfer"))
class FluxonTensorTier(KeyValueTier):
    """The generic per-layer tier over Fluxon (`KeyValueTier` over a `FluxonValueBackend`).

    The connection keys are `FluxonEndpoint`'s (``store.cluster_name``...), checked there once; ``write_back``/``queue_depth`` as in
    `KeyValueTier`; ``client`` shares an attached `FluxonClient` (left open by `close`). The
    capacity is the service's segment as the client sees it. ``records``: the cluster's chunk
    records (`EtcdRecords` in the service's etcd, the client's): every worker attached to the
    cluster finds the chunks this one committed by their keys; each value's checksum is in its
    chunk's record and checked on read. ``read_parallelism``: values of one restore read at once
    (`KeyValueTier.get_layers`): a value on another host's owner is pulled over the link on its
    first read, which waits on Fluxon's transfer rather than on this process, so overlapping
    reads pays (experiments/shared_index, "Cross-host first read"). ``codec``/``codec_device``:
    how K and V are encoded (`cacheseek.codecs`): fewer bytes over the link.
    """

    tier = Tier.FLUXON_DRAM
    capacity_fix = "restart the Fluxon service with a larger --dram, or let the manager evict"

    def __init__(
        self,
        cluster_name: str = DEFAULT_CLUSTER_NAME,
        share_mem_path: str = DEFAULT_SHARE_MEM_PATH,
        instance_key: str = "cacheseek-client",
        op_timeout_s: float = 30.0,
        attach_timeout_s: float = 30.0,
        *,
        write_back: bool = False,
        queue_depth: int = 4,
        settle_s: float = 2.0,
        read_parallelism: int = 4,
        codec: str = "none",
        codec_device: str = "auto",
        client: Any = None,
        transfer: Any = None,
    ) -> None:
        endpoint = FluxonEndpoint(cluster_name, share_mem_path, instance_key, op_timeout_s, attach_timeout_s, settle_s)
        check_read_parallelism(read_parallelism)  # before attaching: a bad config attaches nothing
        TierCodec(codec, codec_device)
        client, owns = _make_client(client, endpoint)
        segment = getattr(client, "segment_bytes", None)
        super().__init__(FluxonValueBackend(client, owns_client=owns), write_back=write_back,
                         queue_depth=queue_depth, name="fluxon", read_parallelism=read_parallelism,
                         capacity_bytes=segment if isinstance(segment, int) and segment > 0 else None,
                         records=client.records, codec=codec, codec_device=codec_device)

    def keys(self, prefix: str = "") -> list[str]:
        self._check_open()
        return self.backend.keys(prefix)
