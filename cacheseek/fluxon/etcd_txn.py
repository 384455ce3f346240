"""The two etcd transactions of the chunk records, in etcd's protobuf wire format, by hand.

fluxon-py pins protobuf <= 3.20.4, which on Python 3.11 runs as pure Python: building the request
of a probe of 8 keys through the generated classes (``etcd3.etcdrpc``) cost ~0.37 ms and parsing
its reply 0.2-0.4 ms on the 2-core CI machine, half of the probe. These functions encode exactly
the bytes the generated classes would (tests/fluxon/test_fluxon_client_parts.py checks that) and
read back only what the records need, in tens of microseconds; the channel sends them as they are
(`TXN_METHOD`, no serializer).

- `gets_request(keys)`: ``TxnRequest{success: [RequestOp{request_range: RangeRequest{key}}...]}``
  (no comparison: it always succeeds), `values_of(reply, n)`: each range's first value, None where
  the key is absent (a present key with an empty value reads as ``b""``);
- `put_new_request(key, value)`: ``TxnRequest{compare: [Compare{target: CREATE, key,
  create_revision: 0}], success: [RequestOp{request_put: PutRequest{key, value}}]}``, and
  `succeeded(reply)`: whether the put ran (the key did not exist).

A reply that is not a well-formed message of that shape raises ``ValueError``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Optional

__all__ = ["TXN_METHOD", "gets_request", "put_new_request", "succeeded", "values_of"]

TXN_METHOD = "/etcdserverpb.KV/Txn"

_VARINT, _FIXED64, _LEN, _FIXED32 = 0, 1, 2, 5
_COMPARE_CREATE = 1  # Compare.CompareTarget.CREATE (result EQUAL is 0, the default)


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _len_field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | _LEN) + _varint(len(payload)) + payload


def gets_request(keys: Sequence[bytes]) -> bytes:
    """A serialized ``TxnRequest`` reading each of ``keys``, in order."""
    return b"".join(_len_field(2, _len_field(1, _len_field(1, key))) for key in keys)


def put_new_request(key: bytes, value: bytes) -> bytes:
    """A serialized ``TxnRequest`` that puts ``value`` under ``key`` only if it does not exist."""
    compare = (_varint(2 << 3 | _VARINT) + _varint(_COMPARE_CREATE) + _len_field(3, key)
               + _varint(5 << 3 | _VARINT) + _varint(0))
    put = _len_field(1, key) + _len_field(2, value)
    return _len_field(1, compare) + _len_field(2, _len_field(2, put))


def _fields(buf: memoryview) -> Iterator[tuple[int, int, object]]:
    """``(field number, wire type, value)`` of each field: an int, or a memoryview of its bytes."""
    i, end = 0, len(buf)
    while i < end:
        tag = buf[i]  # one byte below 128: the common case, read inline
        tag, i = (tag, i + 1) if tag < 0x80 else _read_varint(buf, i)
        number, wire = tag >> 3, tag & 7
        if wire == _VARINT:
            value, i = _read_varint(buf, i)
            yield number, wire, value
        elif wire == _LEN:
            n = buf[i] if i < end else 0x80
            n, i = (n, i + 1) if n < 0x80 else _read_varint(buf, i)
            if i + n > end:
                raise ValueError("etcd reply: a field runs past the end of its message")
            yield number, wire, buf[i:i + n]
            i += n
        elif wire in (_FIXED64, _FIXED32):
            i += 8 if wire == _FIXED64 else 4
            if i > end:
                raise ValueError("etcd reply: a field runs past the end of its message")
        else:
            raise ValueError(f"etcd reply: wire type {wire} is not one etcd sends")


def _read_varint(buf: memoryview, i: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        if i >= len(buf) or shift > 63:
            raise ValueError("etcd reply: a truncated or overlong varint")
        b = buf[i]
        i += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, i
        shift += 7


def _first_value(range_response: memoryview) -> Optional[bytes]:
    """``RangeResponse``: the value of its first ``KeyValue``, None without one."""
    for number, wire, kv in _fields(range_response):
        if number == 2 and wire == _LEN:
            value = b""
            for n, w, v in _fields(kv):  # type: ignore[arg-type]
                if n == 5 and w == _LEN:
                    value = bytes(v)  # type: ignore[arg-type]
            return value
    return None


def values_of(reply: bytes, n: int) -> list[Optional[bytes]]:
    """The value each range read of a `gets_request` of ``n`` keys found, in order."""
    out: list[Optional[bytes]] = []
    for number, wire, op in _fields(memoryview(reply)):
        if number == 3 and wire == _LEN:  # TxnResponse.responses: a ResponseOp
            found = [v for num, w, v in _fields(op) if num == 1 and w == _LEN]  # type: ignore[arg-type]
            if len(found) != 1:
                raise ValueError("etcd reply: a transaction response that is not a range read")
            out.append(_first_value(found[0]))  # type: ignore[arg-type]
    if len(out) != n:
        raise ValueError(f"etcd reply: {len(out)} range reads for {n} keys")
    return out


def succeeded(reply: bytes) -> bool:
    """``TxnResponse.succeeded``."""
    return any(number == 2 and wire == _VARINT and value for number, wire, value in _fields(memoryview(reply)))
