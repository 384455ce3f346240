"""The identity of a model's weights: what keeps two checkpoints out of each other's namespace.

A chunk's KV depends on every weight of the DiT, so the namespace root covers a fingerprint of
them (docs/design.md, "Keys"). It comes, first found wins, from:

1. ``namespace.model_fingerprint`` / the binding's ``model_fingerprint`` when the user names the
   checkpoint (any string that changes with the weights: a content hash, a release tag);
2. the runtime's own ``weights_fingerprint`` attribute (the synthetic and telefuser runtimes);
3. the model that created the runtime: `of_model` marks it around ``create_runtime`` (the
   TeleFuser hooks installed by ``attach`` do), and `current` fingerprints it on first use.

A module is fingerprinted once per object (`module_fingerprint`), at a real user's cost (a 14B
bf16 DiT is 28 GB: it must not cost seconds at every start):

- **from its files** when `from_files` recorded them (``attach`` does for a pipeline that
  ``init()`` loaded from ``checkpoint_dir``): `checkpoint_fingerprint` of the checkpoint, each
  file's relative path, size and content digest, plus the dtypes the module holds (a checkpoint
  loaded in bf16 and in float32 gives other KV). The content digest is the Hugging Face cache's
  own (a blob named by its sha256 or git oid), else xxh3-128 of the file, computed once and kept
  in ``$CACHESEEK_CACHE_DIR/weights`` (default ``~/.cache/cacheseek/weights``) under the file's
  identity: real path, device, inode, size, mtime and ctime in ns (a write changes ctime, which no
  user can set back). An entry that does not parse or names another identity is recomputed;
- **from its tensors** otherwise (random weights; a module built in code): `tensor_fingerprint`
  on the tensors' own device, xxh3-128 over every tensor's name, shape, dtype and byte count plus
  two 64-bit lanes computed over its raw bytes read as little-endian int64 words ``x_i`` (a tail
  of under 8 bytes is hashed as bytes): ``lane1 = sum x_i * a_{i mod B} * v_{i div B}`` and
  ``lane2 = sum g(x_i * b_{i mod B}) * u_{i div B}`` mod 2**64, with fixed random odd
  coefficients (B = 2**20) and ``g(y) = y ^ (y >> 31)``. Integer arithmetic, so every device
  gives the same value (the tests check the CPU against numpy). What it guarantees: any change
  confined to one word changes lane 1 (an odd multiple of a non-zero difference is non-zero mod
  2**64); other differences collide with probability about 2**-64 per lane unless crafted
  against the published coefficients: like xxh3, it guards against an honest mix-up of
  checkpoints, not an adversary who writes weights to collide.

Weights modified in place after the first fingerprint (a LoRA merged later) are not seen: name
such a checkpoint with ``model_fingerprint``.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import os
import re
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

__all__ = ["LANE_BLOCK", "checkpoint_fingerprint", "current", "from_files", "lane_coefficients",
           "module_fingerprint", "of_model", "tensor_fingerprint", "tensor_lanes"]

log = logging.getLogger(__name__)

LANE_BLOCK = 1 << 20  # B of the module docstring: words per coefficient row
_PIECE_ROWS = 16  # rows per pass: 128 MiB of int64 scratch
_FILE_READ = 64 << 20
_HF_BLOB = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")
_cache: "weakref.WeakKeyDictionary[Any, bytes]" = weakref.WeakKeyDictionary()
_files: "weakref.WeakKeyDictionary[Any, Path]" = weakref.WeakKeyDictionary()
_cache_lock = threading.Lock()
_coefficients: dict[Any, tuple[Any, ...]] = {}
_current: contextvars.ContextVar[Optional[Any]] = contextvars.ContextVar("cacheseek_model", default=None)


def module_fingerprint(module: Any) -> bytes:
    """16-byte fingerprint of ``module``'s weights (module docstring); cached per module object."""
    with _cache_lock:
        cached, path = _cache.get(module), _files.get(module)
    if cached is not None:
        return cached
    import torch
    import xxhash

    start = time.perf_counter()
    state = sorted(module.state_dict().items())
    if path is not None:
        dtypes = sorted({str(t.dtype) for _, t in state})
        h = xxhash.xxh3_128(b"cacheseek.weights.files.v1")
        h.update(checkpoint_fingerprint(path))
        h.update("|".join(dtypes).encode())
        how = f"from the files of {path}"
    else:
        with torch.no_grad():
            digest = tensor_fingerprint(state)
        h = xxhash.xxh3_128(b"cacheseek.weights.v3")
        h.update(digest)
        how = f"from {sum(t.numel() for _, t in state) / 1e9:.2f} B values on {_devices(state)}"
    digest = h.digest()
    log.info("weights fingerprint %s: %s in %.2f s", digest.hex()[:16], how, time.perf_counter() - start)
    with _cache_lock:
        _cache[module] = digest
    return digest


def tensor_fingerprint(named: Any) -> bytes:
    """16-byte xxh3-128 over ``(name, tensor)`` pairs, in the order given, with each tensor's
    bytes reduced on its own device to two 64-bit lanes (module docstring)."""
    import torch
    import xxhash

    h = xxhash.xxh3_128(b"cacheseek.tensors.v1")
    lanes, tails = [], []
    for name, tensor in named:
        t = tensor.detach()
        flat = t.contiguous().reshape(-1).view(torch.uint8) if t.numel() else t.new_empty(0, dtype=torch.uint8)
        n = flat.numel()
        h.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}|{n}|".encode())
        words = n // 8
        lanes.append(tensor_lanes(flat[: words * 8], words))
        tails.append(bytes(flat[words * 8:].cpu().numpy().tobytes()) if n % 8 else b"")
    if lanes:
        by_device: dict[Any, list[int]] = {}
        for i, lane in enumerate(lanes):
            by_device.setdefault(lane.device, []).append(i)
        values: list[Any] = [None] * len(lanes)
        for idx in by_device.values():  # one copy to the host per device
            host = torch.stack([lanes[i] for i in idx]).cpu().numpy()
            for row, i in zip(host, idx):
                values[i] = row
        for value, tail in zip(values, tails):
            h.update(value.astype("<i8").tobytes())
            h.update(len(tail).to_bytes(1, "little") + tail)
    return h.digest()


def tensor_lanes(raw: Any, words: int) -> Any:
    """``[lane1, lane2]`` int64 on ``raw``'s device for its ``words`` little-endian int64 words:
    the two lanes of the module docstring, which `tensor_fingerprint` hashes for each tensor
    (public so that the formula can be checked against a plain numpy rendering)."""
    import torch

    if raw.numel() and raw.data_ptr() % 8:
        raw = raw.clone()  # an int64 view needs an aligned start
    x = raw.view(torch.int64) if words else raw.new_zeros(0, dtype=torch.int64)
    a, b, v, u = lane_coefficients(x.device, -(-words // LANE_BLOCK))
    out = torch.zeros(2, dtype=torch.int64, device=x.device)
    step = _PIECE_ROWS * LANE_BLOCK
    for start in range(0, words, step):
        piece = x[start:start + step]
        rows, rest = divmod(piece.numel(), LANE_BLOCK)
        row0 = start // LANE_BLOCK
        parts = []
        if rows:
            parts.append((piece[: rows * LANE_BLOCK].view(rows, LANE_BLOCK), a, b, v[row0:row0 + rows],
                          u[row0:row0 + rows]))
        if rest:
            parts.append((piece[rows * LANE_BLOCK:].view(1, rest), a[:rest], b[:rest],
                          v[row0 + rows:row0 + rows + 1], u[row0 + rows:row0 + rows + 1]))
        for block, ca, cb, cv, cu in parts:
            out[0] += ((block * ca).sum(1) * cv).sum()
            y = block * cb
            y ^= y >> 31
            out[1] += (y.sum(1) * cu).sum()
    return out


def lane_coefficients(device: Any, rows: int) -> tuple[Any, ...]:
    """The lanes' fixed odd coefficients on ``device``: ``a``, ``b`` per position in a row (from a
    fixed PCG64 seed), ``v``, ``u`` per row (splitmix64 of the row index: the same whatever the
    count), at least ``rows`` of them; kept per device."""
    import numpy as np
    import torch

    key = str(device)
    with _cache_lock:
        have = _coefficients.get(key)
    if have is not None and have[2].numel() >= rows:
        return have
    n_rows = max(rows, 1 << 12, 0 if have is None else 2 * have[2].numel())
    rng = np.random.Generator(np.random.PCG64(0x5EEDCAC4E))
    a, b = ((rng.bit_generator.random_raw(LANE_BLOCK) | 1).view(np.int64) for _ in range(2))
    index = np.arange(n_rows, dtype=np.uint64)
    v, u = ((_splitmix64(2 * index + k) | 1).view(np.int64) for k in (0, 1))
    made = tuple(torch.from_numpy(np.ascontiguousarray(c)).to(device) for c in (a, b, v, u))
    with _cache_lock:
        _coefficients[key] = made
    return made


def _splitmix64(x: Any) -> Any:
    import numpy as np

    z = x + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _devices(state: list) -> str:
    return ", ".join(sorted({str(t.device) for _, t in state})) or "no device"


# -- from files -----------------------------------------------------------------------------------


def from_files(module: Any, path: Any) -> None:
    """Record that ``module``'s weights were loaded from ``path`` (a file or a checkpoint
    directory): `module_fingerprint` then identifies them by `checkpoint_fingerprint`."""
    with _cache_lock:
        _files[module] = Path(path)
        _cache.pop(module, None)


def checkpoint_fingerprint(path: Any) -> bytes:
    """16-byte xxh3-128 of a checkpoint: a file, or every regular file under a directory (in
    relative-path order, hidden ones skipped), each by relative path, size and content digest
    (module docstring). ValueError when the path holds no file."""
    import xxhash

    root = Path(path)
    if root.is_file():
        files = [(root.name, root)]
    elif root.is_dir():
        files = sorted((str(p.relative_to(root)), p) for p in root.rglob("*")
                       if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts))
    else:
        files = []
    if not files:
        raise ValueError(f"checkpoint {root} holds no file to fingerprint")
    h = xxhash.xxh3_128(b"cacheseek.checkpoint.v1")
    for rel, p in files:
        h.update(f"{rel}|{p.stat().st_size}|".encode())
        h.update(_file_digest(p).encode())
    return h.digest()


def _file_digest(path: Path) -> str:
    """The content digest of one file: the Hugging Face blob name, a cached xxh3-128, or computed."""
    real = path.resolve()
    if real.parent.name == "blobs" and _HF_BLOB.fullmatch(real.name):
        return f"hf:{real.name}"
    st = real.stat()
    identity = [str(real), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
    entry = _cache_dir() / f"{_identity_name(identity)}.json"
    try:
        data = json.loads(entry.read_text())
        if (isinstance(data, dict) and data.get("format") == 1 and data.get("identity") == identity
                and isinstance(data.get("xxh3_128"), str) and re.fullmatch(r"[0-9a-f]{32}", data["xxh3_128"])):
            return f"xxh3:{data['xxh3_128']}"
    except (OSError, ValueError):
        pass
    import xxhash

    start = time.perf_counter()
    log.info("hashing %s (%.1f GB) once; later starts read the digest from %s", real, st.st_size / 1e9, entry.parent)
    h = xxhash.xxh3_128()
    with open(real, "rb") as f:
        while chunk := f.read(_FILE_READ):
            h.update(chunk)
    digest = h.hexdigest()
    log.info("hashed %s in %.1f s", real.name, time.perf_counter() - start)
    with contextlib.suppress(OSError):  # an unwritable cache costs the next start a hash, no more
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = entry.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps({"format": 1, "identity": identity, "xxh3_128": digest}))
        os.replace(tmp, entry)
    return f"xxh3:{digest}"


def _identity_name(identity: list) -> str:
    import xxhash

    return xxhash.xxh3_64_hexdigest(json.dumps(identity).encode())


def _cache_dir() -> Path:
    base = os.environ.get("CACHESEEK_CACHE_DIR")
    if base:
        return Path(base) / "weights"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg or Path.home() / ".cache") / "cacheseek" / "weights"


@contextlib.contextmanager
def of_model(module: Any) -> Iterator[None]:
    """Within the block, runtimes are created by ``module``: `current` fingerprints it."""
    token = _current.set(module)
    try:
        yield
    finally:
        _current.reset(token)


def current() -> Optional[bytes]:
    """The fingerprint of the model marked by the innermost `of_model`; None outside one, or for a
    model without a state dict (a stand-in: a real DiT is a torch module)."""
    module = _current.get()
    if module is None or not callable(getattr(module, "state_dict", None)):
        return None
    return module_fingerprint(module)
