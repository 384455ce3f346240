"""A session's encode (the prompt embedding, the condition video's latents) as two stored values,
bound to the encode's key and checksummed.

An encode is keyed by what determines its bits (`cacheseek.integrations.telefuser.encodes`: the
input, the encoder's weights, the kernels' identity), not by a chunk, and its shape is the
encoder's, which a reader in a fresh process does not know before it reads. A Plan-style store
is read by length, so the encode is two values: a fixed-size head, written last (the commit
point) and removed first, then the body it describes::

    {hex}:enc   head, `HEAD_NBYTES` B
        magic     8 B   b"CSENCV01"
        key      32 B   the encode's key
        digest   16 B   xxh3-128 over key, dtype code, ndim, shape, body length and body digest
        body     16 B   xxh3-128 of the body
        dtype     1 B   code (`DTYPES`)
        ndim      1 B   at most 6
        pad       6 B
        shape    24 B   6 x u32, little endian (unused dims 0)
        length    8 B   u64, the body's bytes
        pad            to `HEAD_NBYTES`, zeros
    {hex}:encb  body: the tensor's bytes, C order

`unpack_head` checks the magic, the key (a head under another encode's name is not this one's),
the digest and the shape's length; `unpack_body` the body's length and digest. Any mismatch is a
`CorruptValueError`: a miss (the encode runs), never a wrong encode handed to a session.
"""

from __future__ import annotations

import struct
from typing import Any

import attrs
import torch
import xxhash

from cacheseek.errors import CorruptValueError
from cacheseek.kv.frames import host_bytes, tensor_nbytes

__all__ = ["MAGIC", "HEAD_NBYTES", "DTYPES", "EncodeHead", "pack", "unpack_head", "unpack_body"]

MAGIC = b"CSENCV01"
HEAD_NBYTES = 128
_MAX_NDIM = 6
_HEAD = struct.Struct("<8s32s16s16sBB6x6IQ")
DTYPES: dict[int, torch.dtype] = {1: torch.uint8, 2: torch.float32, 3: torch.float16, 4: torch.bfloat16}
_CODES = {v: k for k, v in DTYPES.items()}


@attrs.frozen
class EncodeHead:
    """What a head says of its body: ``shape``, torch ``dtype``, ``nbytes`` and its xxh3-128."""

    shape: tuple
    dtype: torch.dtype
    nbytes: int
    body_digest: bytes


def _digest(key: bytes, code: int, shape: tuple, nbytes: int, body_digest: bytes) -> bytes:
    h = xxhash.xxh3_128()
    h.update(key)
    h.update(bytes([code, len(shape)]))
    h.update(struct.pack(f"<{len(shape)}IQ", *shape, nbytes))
    h.update(body_digest)
    return h.digest()


def pack(key: bytes, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The head and the body of ``tensor`` (any device) stored under ``key``: two 1-D uint8 CPU
    tensors."""
    t = tensor.detach().to("cpu").contiguous()
    code = _CODES.get(t.dtype)
    if code is None or t.dim() > _MAX_NDIM:
        raise ValueError(f"an encode {tuple(t.shape)} {t.dtype} cannot be stored "
                         f"(dtypes {sorted(map(str, _CODES))}, at most {_MAX_NDIM} dims)")
    shape = tuple(int(d) for d in t.shape)
    body = t.reshape(-1).view(torch.uint8).clone()
    body_digest = xxhash.xxh3_128(body.numpy()).digest()
    nbytes = int(body.numel())
    dims = list(shape) + [0] * (_MAX_NDIM - len(shape))
    raw = _HEAD.pack(MAGIC, key, _digest(key, code, shape, nbytes, body_digest), body_digest, code, len(shape),
                     *dims, nbytes).ljust(HEAD_NBYTES, b"\0")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8), body


def unpack_head(key: bytes, value: Any, locator: str) -> EncodeHead:
    """The head in ``value`` (bytes, or a uint8 tensor on any device); `CorruptValueError` naming
    ``locator`` when it is not the head of ``key``'s encode or fails its digest."""
    raw = host_bytes(value)
    if raw.nbytes != HEAD_NBYTES:
        raise CorruptValueError(locator, f"{raw.nbytes} bytes, an encode's head has {HEAD_NBYTES}")
    magic, stored_key, digest, body_digest, code, ndim, *rest = _HEAD.unpack(raw[:_HEAD.size].tobytes())
    dims, nbytes = rest[:_MAX_NDIM], rest[_MAX_NDIM]
    if magic != MAGIC:
        raise CorruptValueError(locator, "not an encode's head (bad magic)")
    if raw[_HEAD.size:].any():
        raise CorruptValueError(locator, "its padding is not zero")
    if stored_key != key:
        raise CorruptValueError(locator, "the head of another encode (key mismatch)")
    if code not in DTYPES or ndim > _MAX_NDIM:
        raise CorruptValueError(locator, f"dtype code {code}, {ndim} dims")
    shape = tuple(dims[:ndim])
    if _digest(key, code, shape, nbytes, body_digest) != digest:
        raise CorruptValueError(locator, "checksum mismatch")
    dtype = DTYPES[code]
    if tensor_nbytes(shape, dtype) != nbytes:
        raise CorruptValueError(locator, f"{nbytes} body bytes for {shape} {dtype}")
    return EncodeHead(shape, dtype, nbytes, body_digest)


def unpack_body(head: EncodeHead, value: Any, locator: str) -> torch.Tensor:
    """The encode in ``value`` as a CPU tensor of ``head``'s shape and dtype (its own memory);
    `CorruptValueError` naming ``locator`` when its length or digest disagrees with the head."""
    raw = host_bytes(value)
    if raw.nbytes != head.nbytes:
        raise CorruptValueError(locator, f"{raw.nbytes} bytes, the head names {head.nbytes}")
    if xxhash.xxh3_128(raw).digest() != head.body_digest:
        raise CorruptValueError(locator, "checksum mismatch")
    return torch.from_numpy(raw.copy()).view(head.dtype).reshape(head.shape)
