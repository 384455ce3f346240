"""A decoder's causal state after a chunk as one stored value, bound to the chunk's key and checked.

A streaming video decoder (the Wan VAE's ``cached_decode_withflag``) keeps a causal feature cache
between chunks: a list whose entries are a tensor, nothing, or a marker string. Stored after chunk
``j`` under ``{hex}:dec``, it lets a session that served chunks 0..j from frames restore the
decoder as a cold run left it instead of decoding those chunks' latents again. The value is one
flat uint8 tensor, on the runtime's device where the store keeps device tensors::

    magic    8 B   b"CSDECV01"
    key     32 B   the chunk's node key
    digest  16 B   xxh3-128 over key, the body check's kind, the entry table and the body's check
    count    4 B   entries
    check    1 B   the body's check: 1 two 64-bit sums (a value packed on a GPU), 2 xxh3-128 (on a CPU)
    pad      3 B
    table   32 B x count: kind (0 none, 1 marker, 2 tensor), dtype code, ndim, pad, then six u32
                   of shape (a marker: its UTF-8 text, at most 24 bytes), pad
    pad            to a multiple of `ALIGN`
    body           each tensor's bytes, C order, each padded with zeros to a multiple of `ALIGN`

A state packed on a GPU is checked where it is (1.76 GiB at 480p: a few milliseconds on the GPU,
no host round trip): the body read as int64 words ``x_i``, ``sum_i x_i * c_i mod 2^64`` for two
position-dependent odd multipliers ``c_i`` (`body_sums`). A changed word changes each sum (``c_i``
is odd, so no nonzero change of one word vanishes), a moved word changes them (``c_i`` differs per
position); two or more changed words cancel in both with a chance near 2^-128 for damage not aimed
at it. On a CPU, where torch's int64 products are ten times slower than xxh3, the body's check
is its xxh3-128. The reader computes the check the header names, over what it read.
`unpack` checks the magic, the key, the entry table against the spec the runtime expects, the
length and the digest: any mismatch is a `CorruptValueError`, a miss (the decoder is rebuilt
by replaying latents), never a wrong state loaded.
"""

from __future__ import annotations

import struct
import warnings
from collections.abc import Sequence
from typing import Any, Optional, Union

import torch
import xxhash

from cacheseek.errors import CorruptValueError
from cacheseek.kv.frames import tensor_nbytes

__all__ = ["MAGIC", "ALIGN", "DecoderStateSpec", "Snapshot", "spec_of", "snapshot", "pack", "unpack", "packed_nbytes",
           "body_sums", "empty_like_spec", "BLOCK_WORDS", "CHECKS"]

MAGIC = b"CSDECV01"
ALIGN = 64
_HEAD = struct.Struct("<8s32s16sIB3x")
_SUMS, _XXH3 = 1, 2
CHECKS = {"sums": _SUMS, "xxh3": _XXH3}  # the body's check: on a GPU the sums, on a CPU xxh3
_ENTRY = struct.Struct("<BBBx6I4x")
_MAX_NDIM = 6
_DTYPES: dict[int, torch.dtype] = {1: torch.uint8, 2: torch.float32, 3: torch.float16, 4: torch.bfloat16,
                                   5: torch.int64, 6: torch.int32}
_CODES = {v: k for k, v in _DTYPES.items()}
_NONE, _MARKER, _TENSOR = 0, 1, 2
BLOCK_WORDS = 1 << 23  # int64 words summed per step (64 MiB of body)
_K = (-7046029254386353131, -4658895280553007687, -7723592293110705685, 5573985287187734571)

Entry = Union[None, str, tuple]  # a spec entry: nothing, a marker, or ``(shape, dtype)``


class DecoderStateSpec:
    """What a decoder's state holds after a chunk: one entry per slot, ``None``, a marker string,
    or ``(shape, dtype)`` of a tensor. The reader needs it to size the read (a Plan store is read
    by length) and to check what it got."""

    __slots__ = ("entries",)

    def __init__(self, entries: Sequence[Entry]) -> None:
        out = []
        for e in entries:
            if e is None or isinstance(e, str):
                if isinstance(e, str) and len(e.encode()) > 24:
                    raise ValueError(f"decoder state marker {e!r} is longer than 24 bytes")
                out.append(e)
                continue
            shape, dtype = tuple(int(d) for d in e[0]), e[1]
            if dtype not in _CODES or len(shape) > _MAX_NDIM:
                raise ValueError(f"a decoder state tensor {shape} {dtype} cannot be stored "
                                 f"(dtypes {sorted(map(str, _CODES))}, at most {_MAX_NDIM} dims)")
            out.append((shape, dtype))
        self.entries = tuple(out)

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, DecoderStateSpec) and self.entries == other.entries

    def __hash__(self) -> int:
        return hash(self.entries)

    @property
    def body_nbytes(self) -> int:
        return sum(_padded(tensor_nbytes(*e)) for e in self.entries if isinstance(e, tuple))

    def __repr__(self) -> str:
        tensors = sum(isinstance(e, tuple) for e in self.entries)
        return f"DecoderStateSpec({len(self.entries)} entries, {tensors} tensors, {self.body_nbytes} B)"


def _padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _head_nbytes(n: int) -> int:
    return _padded(_HEAD.size + _ENTRY.size * n)


def packed_nbytes(spec: DecoderStateSpec) -> int:
    """Bytes of the stored value of a state of ``spec``."""
    return _head_nbytes(len(spec.entries)) + spec.body_nbytes


def spec_of(entries: Sequence[Any]) -> DecoderStateSpec:
    """The spec of a state (its entries: tensors, None, marker strings)."""
    return DecoderStateSpec([e if e is None or isinstance(e, str) else (tuple(e.shape), e.dtype) for e in entries])


def _table(spec: DecoderStateSpec) -> bytes:
    rows = []
    for e in spec.entries:
        if e is None:
            rows.append(_ENTRY.pack(_NONE, 0, 0, 0, 0, 0, 0, 0, 0))
        elif isinstance(e, str):
            text = e.encode().ljust(24, b"\0")
            rows.append(_ENTRY.pack(_MARKER, 0, len(e.encode()), *struct.unpack("<6I", text)))
        else:
            shape, dtype = e
            rows.append(_ENTRY.pack(_TENSOR, _CODES[dtype], len(shape), *(list(shape) + [0] * (_MAX_NDIM - len(shape)))))
    return b"".join(rows)


def _parse_table(raw: bytes, n: int) -> DecoderStateSpec:
    entries: list[Entry] = []
    for i in range(n):
        kind, code, ndim, *dims = _ENTRY.unpack_from(raw, i * _ENTRY.size)
        if kind == _NONE:
            entries.append(None)
        elif kind == _MARKER:
            entries.append(struct.pack("<6I", *dims)[:ndim].decode("utf-8", "replace"))
        elif kind == _TENSOR and code in _DTYPES and ndim <= _MAX_NDIM:
            entries.append((tuple(dims[:ndim]), _DTYPES[code]))
        else:
            raise ValueError(f"entry {i}: kind {kind}, dtype code {code}, ndim {ndim}")
    return DecoderStateSpec(entries)


def body_sums(body: torch.Tensor) -> tuple[int, int]:
    """The two 64-bit position-weighted sums of ``body`` (a 1-D uint8 tensor, its length a
    multiple of 8, on any device), computed where it is: word ``i = b * B + l`` (block ``b`` of
    `BLOCK_WORDS` words, offset ``l``) weighs ``m(l) * o(b)``, both odd (``m`` a tensor made once per
    device and lane, ``o`` a Python int), so each block costs one multiply and one sum per lane."""
    words = body.view(torch.int64)
    sums = []
    for lane in (0, 1):
        weights = _weights(body.device, lane, min(BLOCK_WORDS, words.numel()))
        acc = torch.zeros((), dtype=torch.int64, device=body.device)
        for b, start in enumerate(range(0, words.numel(), BLOCK_WORDS)):
            y = words[start:start + BLOCK_WORDS] * weights[:min(BLOCK_WORDS, words.numel() - start)]
            # a plain weighted sum misses high-bit errors (two sign flips add 2**63 twice = 0):
            # fold each product's high half into its low half, then spread it up again
            y = (y ^ (y >> 31)) * _K[2 * lane + 1]
            acc += y.sum() * _odd(b, lane)
        sums.append(int(acc.item()))
    return sums[0], sums[1]


_WEIGHTS: dict[tuple[str, int], torch.Tensor] = {}


def _weights(device: torch.device, lane: int, n: int) -> torch.Tensor:
    """``m(l)`` for ``l < n`` of ``lane`` on ``device`` (kept, grown to `BLOCK_WORDS` words at most)."""
    key = (str(device), lane)
    w = _WEIGHTS.get(key)
    if w is None or w.numel() < n:
        i = torch.arange(n, dtype=torch.int64, device=device)
        w = _WEIGHTS[key] = _mix(i, _K[2 * lane], _K[2 * lane + 1])
    return w


def _odd(b: int, lane: int) -> int:
    """``o(b)`` of ``lane``: an odd 64-bit weight of block ``b`` (signed, as torch multiplies)."""
    h = ((b + 1) * (_K[2 * lane] & _MASK)) & _MASK
    h ^= h >> 31
    h = (h * (_K[2 * lane + 1] & _MASK)) & _MASK | 1
    return h - (1 << 64) if h >= 1 << 63 else h


_MASK = (1 << 64) - 1


def _mix(i: torch.Tensor, a: int, b: int) -> torch.Tensor:
    h = i * a
    h = h ^ (h >> 29)
    h = h * b
    h = h ^ (h >> 32)
    return h | 1


def _body_check(body: torch.Tensor, check: int) -> bytes:
    if check == _SUMS:
        return struct.pack("<qq", *body_sums(body))
    return xxhash.xxh3_128(body.cpu().numpy()).digest()


def _digest(key: bytes, check: int, table: bytes, body_check: bytes) -> bytes:
    h = xxhash.xxh3_128()
    h.update(key)
    h.update(bytes([check]))
    h.update(table)
    h.update(body_check)
    return h.digest()


class Snapshot:
    """A state copied for storing, not yet sealed (`snapshot`): ``value`` holds every tensor's
    bytes in the body (the copies queued on the device's current stream, ``ready`` recorded
    after them on a GPU), the header still empty. `seal` finishes it on any thread."""

    __slots__ = ("key", "spec", "value", "check", "ready")

    def __init__(self, key: bytes, spec: DecoderStateSpec, value: torch.Tensor, check: int, ready: Any) -> None:
        self.key, self.spec, self.value, self.check, self.ready = key, spec, value, check, ready

    @property
    def device(self) -> torch.device:
        return self.value.device

    def seal(self) -> torch.Tensor:
        """The stored value (`pack`'s): waits for the body's copies, computes the body's check
        over the bytes now in ``value`` (on a GPU on a side stream of its own, waited for), writes
        the header. Call it once."""
        value, head = self.value, _head_nbytes(len(self.spec.entries))
        if value.device.type != "cuda":
            return _seal(self, value, head)
        with torch.cuda.device(value.device):
            stream = torch.cuda.Stream(value.device)
            stream.wait_event(self.ready)
            with torch.cuda.stream(stream):
                out = _seal(self, value, head)
            stream.synchronize()
        return out


def _seal(snap: Snapshot, value: torch.Tensor, head: int) -> torch.Tensor:
    table = _table(snap.spec)
    digest = _digest(snap.key, snap.check, table, _body_check(value[head:], snap.check))
    header = (_HEAD.pack(MAGIC, snap.key, digest, len(snap.spec.entries), snap.check) + table).ljust(head, b"\0")
    value[:head].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
    return value


def snapshot(key: bytes, entries: Sequence[Any], device: Any = None, *, check: Optional[str] = None) -> Snapshot:
    """The state ``entries`` (tensors, None, marker strings) of chunk ``key`` copied, once, into
    the body of a value on ``device`` (default: the first tensor's): the decoder overwrites its
    state as it decodes on, so this is the part of a write that cannot wait. On a GPU the copies
    are queued on the current stream (the decoder's: its next decode runs after them) and an
    event marks them; nothing waits here. `Snapshot.seal` does the rest. ``check``: as `pack`."""
    spec = spec_of(entries)
    tensors = [e for e in entries if isinstance(e, torch.Tensor)]
    if device is None:
        device = tensors[0].device if tensors else torch.device("cpu")
    head = _head_nbytes(len(spec.entries))
    out = torch.empty(head + spec.body_nbytes, dtype=torch.uint8, device=device)
    off = head
    for t in tensors:
        n = t.numel() * t.element_size()
        out[off:off + n].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
        if _padded(n) > n:
            out[off + n:off + _padded(n)].zero_()
        off += _padded(n)
    code = CHECKS[check] if check is not None else (_XXH3 if out.device.type == "cpu" else _SUMS)
    ready = None
    if out.device.type == "cuda":
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(out.device))
    return Snapshot(key, spec, out, code, ready)


def pack(key: bytes, entries: Sequence[Any], device: Any = None, *, check: Optional[str] = None) -> torch.Tensor:
    """The stored value of a decoder state (``entries``: tensors, None, marker strings) for the
    chunk ``key``: a 1-D uint8 tensor on ``device`` (default: the first tensor's). Copies the
    tensors once (the state is the decoder's own, replaced as it decodes on). ``check``: a
    `CHECKS` name; default ``sums`` where the value is on a GPU (never copied to the host to be
    checked), else ``xxh3``. `snapshot` then `Snapshot.seal`, at once."""
    return snapshot(key, entries, device, check=check).seal()


def unpack(key: bytes, value: Any, spec: DecoderStateSpec, locator: str, device: Any,
           *, owned: bool = False) -> list:
    """The state in ``value`` (bytes, or a uint8 tensor on any device) on ``device``: its entries,
    tensors as views of one buffer of ``device`` (a copy of ``value`` unless ``owned``: a fresh
    tensor on ``device`` that nothing else holds). `CorruptValueError` naming ``locator`` when it is
    not this chunk's state of ``spec``, or fails its digest."""
    if not isinstance(value, torch.Tensor):
        with warnings.catch_warnings():  # a read-only buffer: read, never written
            warnings.simplefilter("ignore", UserWarning)
            value = torch.frombuffer(memoryview(value), dtype=torch.uint8) if len(value) else torch.empty(0, dtype=torch.uint8)
    value = value.detach().reshape(-1).view(torch.uint8)
    if value.numel() < _HEAD.size:
        raise CorruptValueError(locator, f"{value.numel()} bytes, shorter than a decoder state header")
    magic, stored_key, digest, n, check = _HEAD.unpack(value[:_HEAD.size].cpu().numpy().tobytes())
    if magic != MAGIC:
        raise CorruptValueError(locator, "not a decoder state value (bad magic)")
    if stored_key != key:
        raise CorruptValueError(locator, "the decoder state of another chunk (key mismatch)")
    if check not in (_SUMS, _XXH3):
        raise CorruptValueError(locator, f"unknown body check {check}")
    if n != len(spec.entries):
        raise CorruptValueError(locator, f"{n} entries, the decoder holds {len(spec.entries)}")
    head = _head_nbytes(n)
    if value.numel() != head + spec.body_nbytes:
        raise CorruptValueError(locator, f"{value.numel()} bytes, {head + spec.body_nbytes} expected for {spec}")
    table = value[_HEAD.size:_HEAD.size + _ENTRY.size * n].cpu().numpy().tobytes()
    try:
        stored = _parse_table(table, n)
    except ValueError as exc:
        raise CorruptValueError(locator, f"unreadable entry table ({exc})") from None
    if stored != spec:
        raise CorruptValueError(locator, f"a state of another shape ({stored}), the decoder holds {spec}")
    device = torch.device(device)
    if value.device != device:
        value = value.to(device)
    elif not owned:
        value = value.clone()
    body = value[head:]
    if _digest(key, check, table, _body_check(body, check)) != digest:
        raise CorruptValueError(locator, "checksum mismatch")
    out: list = []
    off = 0
    for e in spec.entries:
        if not isinstance(e, tuple):
            out.append(e)
            continue
        n_bytes = tensor_nbytes(*e)
        out.append(body[off:off + n_bytes].view(e[1]).view(e[0]))
        off += _padded(n_bytes)
    return out


def empty_like_spec(spec: DecoderStateSpec, device: Any) -> Optional[torch.Tensor]:
    """A stand-in of the packed size for a store read into a fresh tensor by length (``like``):
    one byte expanded, no memory of that size allocated."""
    return torch.empty(1, dtype=torch.uint8, device=device).expand(packed_nbytes(spec))
