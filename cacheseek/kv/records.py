"""Chunk records: how any process finds a chunk in a shared store by its key alone.

A chunk's identity is a pure function of its session (the namespace root, then one node key per
action, `cacheseek.reuse.exact_prefix.keys`), so every worker can compute the key of the chunk it
needs next. What it cannot compute is whether that chunk is *complete* in the store. The record is
that fact: a small value written after every value of the chunk is committed (the commit point,
last), under ``{node hex}:rec``, saying which values hold the chunk (the KV blob's geometry and,
where the store has them, each value's checksum), the parent's key and the chunk's depth.

A reader trusts nothing it reads back: `decode` checks the record's seal (xxh3-64 over its store
name and body, so a record stored under another chunk's name fails), its format, and that it
names the key that was asked for; the caller then checks the parent and depth against the path it
walked, and the store checks each value against the record's checksums as it reads. Half a chunk
(values without a record), a record without its values, or another chunk's record is a miss.

`ChunkRecords` is the contract a store offers for its records (the shared index), with defaults
that mean "not shared": `NO_RECORDS` publishes nothing and finds nothing. A store shared across
processes implements four raw operations over bytes (create-if-absent, a batched get, delete,
listing); the base class does the encoding, the checks and the counting. The first publication of
a record wins; a second writer of the same chunk (same key, same bytes) is a no-op.

The same four operations keep chunk *claims* (`cacheseek.kv.claims`): a live session about to
compute a chunk no record names claims it (`claim`), and one that finds another process's claim
waits for that chunk's record instead of computing it too (`SharedIndex.claim_or_wait`).

Torch-free; imports only `cacheseek.errors` and `cacheseek.kv.claims`.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import attrs
import xxhash

from cacheseek.errors import CorruptValueError
from cacheseek.histogram import SECONDS_BUCKETS, Histogram
from cacheseek.kv.locators import blob_keys, kv_locator
from cacheseek.kv.claims import ChunkClaim, claim_name

log = logging.getLogger(__name__)

__all__ = ["ChunkRecord", "ChunkRecords", "DictRecords", "NO_RECORDS", "RecordStats", "record_name",
           "encode_record", "decode_record", "RECORD_SUFFIX"]

RECORD_SUFFIX = ":rec"
_MAGIC = b"CSREC1\n"
_FORMAT = 1
_KEY_BYTES = 32


def record_name(node_key: bytes) -> str:
    """The store name of a chunk's record: ``{node hex}:rec``."""
    return node_key.hex() + RECORD_SUFFIX


def _key32(name: str):
    def check(_inst: Any, _attr: Any, value: Any) -> None:
        if not isinstance(value, bytes) or len(value) != _KEY_BYTES:
            raise ValueError(f"ChunkRecord.{name} must be {_KEY_BYTES} bytes, got {value!r:.40}")
    return check


def _non_negative(_inst: Any, attr: Any, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"ChunkRecord.{attr.name} must be an int >= 0, got {value!r}")


def _digests(value: Any) -> tuple[tuple[str, str], ...]:
    items = value.items() if isinstance(value, Mapping) else value
    return tuple(sorted((str(k), str(d)) for k, d in items))


@attrs.frozen(slots=True)
class ChunkRecord:
    """One committed chunk. ``node_key``: its key; ``parent_key``: its parent's (the namespace
    root for chunk 0); ``root_hash``: the namespace; ``depth``: the chunk index. The KV blob:
    ``n_layers`` layers of K and V (``pairs``; else one value per layer), ``nbytes`` in all, in
    ``storage_format``; ``latent_nbytes``: the latent's bytes. ``digests``: ``(value key,
    checksum)`` pairs where the store checksums its values (LocalDisk, the generic Fluxon tier),
    sorted; empty where it does not (the Plan tier, by decision)."""

    node_key: bytes = attrs.field(validator=_key32("node_key"))
    parent_key: bytes = attrs.field(validator=_key32("parent_key"))
    root_hash: bytes = attrs.field(validator=_key32("root_hash"))
    depth: int = attrs.field(validator=_non_negative)
    n_layers: int = attrs.field(validator=_non_negative)
    nbytes: int = attrs.field(validator=_non_negative)
    pairs: bool = True
    latent_nbytes: int = attrs.field(default=0, validator=_non_negative)
    storage_format: str = ""
    digests: tuple[tuple[str, str], ...] = attrs.field(default=(), converter=_digests)

    @property
    def name(self) -> str:
        return record_name(self.node_key)


def _seal(name: str, body: bytes) -> bytes:
    h = xxhash.xxh3_64()
    n = name.encode("utf-8")
    h.update(len(n).to_bytes(8, "little"))
    h.update(n)
    h.update(body)
    return h.hexdigest().encode("ascii")


def encode_record(record: ChunkRecord) -> bytes:
    """``MAGIC``, the 16-hex-digit seal, a newline, then the record as canonical JSON. Checksums
    of exactly the blob's values (the usual case) are written as one string in the blob's key
    order (``digest_list``: 16 hex digits each), a 480p record's 80 of them in 1.3 KB instead of
    repeating each 70-character key; any other set as ``[key, checksum]`` pairs."""
    fields = {
        "format": _FORMAT, "node": record.node_key.hex(), "parent": record.parent_key.hex(),
        "root": record.root_hash.hex(), "depth": record.depth, "n_layers": record.n_layers,
        "nbytes": record.nbytes, "pairs": record.pairs, "latent_nbytes": record.latent_nbytes,
        "storage_format": record.storage_format,
    }
    by_key = dict(record.digests)
    order = blob_keys(kv_locator(record.node_key), record.n_layers, pairs=record.pairs) if record.digests else []
    if order and set(by_key) == set(order) and all(len(by_key[k]) == 16 for k in order):
        fields["digest_list"] = "".join(by_key[k] for k in order)
    else:
        fields["digests"] = [list(d) for d in record.digests]
    body = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode("utf-8")
    return _MAGIC + _seal(record.name, body) + b"\n" + body


def decode_record(node_key: bytes, data: bytes) -> ChunkRecord:
    """The record stored for ``node_key``; `CorruptValueError` naming it when the bytes are not
    a sealed record of this format, or name another chunk."""
    name = record_name(node_key)

    def bad(problem: str) -> CorruptValueError:
        return CorruptValueError(name, f"record {problem}")

    data = bytes(data)
    if not data.startswith(_MAGIC) or len(data) < len(_MAGIC) + 17:
        raise bad("is not a CacheSeek chunk record (bad magic)")
    seal, body = data[len(_MAGIC):len(_MAGIC) + 16], data[len(_MAGIC) + 17:]
    if data[len(_MAGIC) + 16:len(_MAGIC) + 17] != b"\n" or seal != _seal(name, body):
        raise bad("fails its checksum (damaged, or another chunk's record)")
    try:
        d = json.loads(body.decode("utf-8"))
        if d["format"] != _FORMAT:
            raise bad(f"has format {d['format']!r}, this version reads {_FORMAT}")
        node = bytes.fromhex(d["node"])
        digests = [tuple(x) for x in d.get("digests", ())]
        if "digest_list" in d:
            packed = str(d["digest_list"])
            order = blob_keys(kv_locator(node), d["n_layers"], pairs=bool(d["pairs"]))
            if len(packed) != 16 * len(order):
                raise bad(f"has {len(packed) // 16} checksums for {len(order)} values")
            digests = [(k, packed[16 * i:16 * i + 16]) for i, k in enumerate(order)]
        rec = ChunkRecord(node_key=node, parent_key=bytes.fromhex(d["parent"]),
                          root_hash=bytes.fromhex(d["root"]), depth=d["depth"], n_layers=d["n_layers"],
                          nbytes=d["nbytes"], pairs=bool(d["pairs"]), latent_nbytes=d["latent_nbytes"],
                          storage_format=str(d["storage_format"]), digests=digests)
    except CorruptValueError:
        raise
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise bad(f"is unreadable ({type(exc).__name__}: {exc})") from None
    if rec.node_key != node_key:
        raise bad(f"names chunk {rec.node_key.hex()[:16]}")
    return rec


@attrs.define
class RecordStats:
    """Counters of one store's records: what the shared index did for this process.
    ``probe_seconds``: the latency of each batched probe (the last 4096), for percentiles;
    ``probe_latency``: all of them, bucketed (the metrics endpoint's histogram)."""

    probes: int = 0
    probe_keys: int = 0
    found: int = 0
    corrupt: int = 0
    probe_errors: int = 0
    published: int = 0
    already_there: int = 0
    publish_errors: int = 0
    retracted: int = 0
    claims: int = 0  # claims this process took (it computes the chunk)
    claims_held_elsewhere: int = 0  # claims found held by another process (the caller may wait)
    claim_errors: int = 0
    probe_seconds: list = attrs.field(factory=list, repr=False)
    probe_latency: Histogram = attrs.field(factory=lambda: Histogram(SECONDS_BUCKETS), repr=False)

    def copy(self) -> "RecordStats":
        """A copy (the caller holds the records' lock)."""
        return attrs.evolve(self, probe_seconds=list(self.probe_seconds), probe_latency=self.probe_latency.copy())

    def as_dict(self) -> dict[str, Any]:
        out = attrs.asdict(self, filter=lambda a, _: a.name != "probe_latency")
        lat = sorted(out.pop("probe_seconds"))
        out["probe_p50_ms"] = _pct(lat, 0.50)
        out["probe_p99_ms"] = _pct(lat, 0.99)
        return out


def _pct(sorted_s: list, q: float) -> Optional[float]:
    if not sorted_s:
        return None
    return round(1e3 * sorted_s[min(len(sorted_s) - 1, int(q * len(sorted_s)))], 4)


class ChunkRecords:
    """A store's chunk records (see the module docstring). This base is the "not shared" store:
    ``shared`` False, `publish` keeps nothing, `find` finds nothing, `retract` has nothing to
    drop. A shared store's records subclass it and implement ``_put_new``, ``_get_many``,
    ``_delete`` and ``_names``; their failures (`StoreError`, timeouts) are a miss for `find`
    and an unshared chunk for `publish`, counted, never raised."""

    shared = False

    def __init__(self) -> None:
        self.stats = RecordStats()
        self._lock = threading.Lock()

    def _count(self, **deltas: int) -> None:
        """Add to ``stats`` counters by name, under the records' lock."""
        with self._lock:
            for name, n in deltas.items():
                setattr(self.stats, name, getattr(self.stats, name) + n)

    def stats_snapshot(self) -> RecordStats:
        """A consistent copy of ``stats`` (what a metrics scrape reads)."""
        with self._lock:
            return self.stats.copy()

    # -- the raw operations a shared store implements --------------------------------------------

    def _put_new(self, name: str, data: bytes) -> bool:
        """Store ``data`` under ``name`` unless something is there; whether it was stored."""
        return False

    def _get_many(self, names: Sequence[str]) -> list[Optional[bytes]]:
        """The bytes under each name (None: absent), in one round trip where the medium can."""
        return [None] * len(names)

    def _delete(self, name: str) -> None:
        """Remove ``name``; a missing one is not an error."""

    def _names(self) -> list[str]:
        """Every record name stored (for reconciling values with records)."""
        return []

    # -- what the manager calls -------------------------------------------------------------------

    def publish(self, record: ChunkRecord) -> bool:
        """Make ``record``'s chunk findable (its values are committed: call this last). False
        when it could not be stored (logged, counted): the chunk is then this process's only.
        A record already there for the same chunk counts as published (the first writer won)."""
        if not self.shared:
            return False
        try:
            stored = self._put_new(record.name, encode_record(record))
        except Exception as exc:  # noqa: BLE001 - an unshared chunk, never a failed session
            self._count(publish_errors=1)
            log.warning("could not publish the record of chunk %s: %s", record.node_key.hex()[:16], exc)
            return False
        self._count(published=int(stored), already_there=int(not stored))
        return True

    def find(self, node_keys: Sequence[bytes]) -> list[Optional[ChunkRecord]]:
        """The record of each key (None: not findable), in one batched, bounded probe. A record
        that fails its checks is removed (it can never become valid) and reads as None; a probe
        that fails reads as None for every key."""
        found = self.probe(node_keys)
        return [None] * len(node_keys) if found is None else found

    def probe(self, node_keys: Sequence[bytes]) -> Optional[list[Optional[ChunkRecord]]]:
        """`find`, except that a probe that failed (the medium unreachable, a timeout: counted,
        logged) is None, not a list of misses: the caller cannot tell which chunks are there."""
        n = len(node_keys)
        if not self.shared or n == 0:
            return [None] * n
        names = [record_name(k) for k in node_keys]
        t0 = time.perf_counter()
        try:
            raw = self._get_many(names)
        except Exception as exc:  # noqa: BLE001 - cannot tell: a miss
            self._count(probe_errors=1)
            log.warning("chunk-record probe of %d keys failed (read as misses): %s", n, exc)
            return None
        finally:
            dt = time.perf_counter() - t0
            with self._lock:
                self.stats.probes += 1
                self.stats.probe_keys += n
                lat = self.stats.probe_seconds
                lat.append(dt)
                self.stats.probe_latency.observe(dt)
                if len(lat) > 4096:
                    del lat[: len(lat) - 4096]
        out: list[Optional[ChunkRecord]] = []
        for key, name, data in zip(node_keys, names, raw):
            if data is None:
                out.append(None)
                continue
            try:
                out.append(decode_record(key, data))
            except CorruptValueError as exc:
                log.warning("%s; removing it", exc)
                self._count(corrupt=1)
                self.retract(key, counted=False)
                out.append(None)
        self._count(found=sum(r is not None for r in out))
        return out

    def retract(self, node_key: bytes, *, counted: bool = True) -> None:
        """Make the chunk unfindable (before any of its values is removed). Never raises: a
        record left behind names values that are gone, which a reader finds out (a miss)."""
        if not self.shared:
            return
        try:
            self._delete(record_name(node_key))
        except Exception as exc:  # noqa: BLE001
            log.warning("could not remove the record of chunk %s: %s", node_key.hex()[:16], exc)
            return
        if counted:
            self._count(retracted=1)

    # -- claims (see the module docstring) --------------------------------------------------------

    def claim(self, node_key: bytes) -> Optional[ChunkClaim]:
        """Claim the write of a chunk no record names yet. None when this process holds the
        claim now (it computes the chunk; `drop_claim` once its record is published), and also
        when the store is not shared or the claim could not be stored (compute without one);
        else the claim another process holds (an unreadable one reads as stale)."""
        if not self.shared:
            return None
        name = claim_name(node_key)
        try:
            for _ in range(2):  # a holder may release between our put and our read: try once more
                mine = ChunkClaim.mine()
                if self._put_new(name, mine.encode()):
                    self._count(claims=1)
                    return None
                (data,) = self._get_many([name])
                if data is not None:
                    self._count(claims_held_elsewhere=1)
                    return ChunkClaim.decode(data) or ChunkClaim("?", 0, "", 0.0)
        except Exception as exc:  # noqa: BLE001 - no claim: the caller computes, as without claims
            self._count(claim_errors=1)
            log.warning("could not claim chunk %s: %s", node_key.hex()[:16], exc)
        return None

    def holder(self, node_key: bytes) -> Optional[ChunkClaim]:
        """The claim on a chunk (None: none, or it cannot be read now)."""
        if not self.shared:
            return None
        try:
            (data,) = self._get_many([claim_name(node_key)])
        except Exception:  # noqa: BLE001 - cannot tell: no claim
            return None
        return None if data is None else ChunkClaim.decode(data) or ChunkClaim("?", 0, "", 0.0)

    def drop_claim(self, node_key: bytes) -> None:
        """Remove the chunk's claim (this process's, once its record is published, or a stale
        one). Never raises: a claim left behind goes stale."""
        if not self.shared:
            return
        try:
            self._delete(claim_name(node_key))
        except Exception as exc:  # noqa: BLE001
            log.warning("could not remove the claim of chunk %s: %s", node_key.hex()[:16], exc)

    def node_keys(self) -> list[bytes]:
        """The key of every chunk with a record (a listing; for reconciling values, not lookups)."""
        out = []
        for name in self._names():
            if name.endswith(RECORD_SUFFIX):
                try:
                    key = bytes.fromhex(name[: -len(RECORD_SUFFIX)])
                except ValueError:
                    continue
                if len(key) == _KEY_BYTES:
                    out.append(key)
        return out


NO_RECORDS = ChunkRecords()
"""The records of a store no other process can read (HBM, an embedded Plan client): nothing."""


class DictRecords(ChunkRecords):
    """Records in a dict of this process: shared by every manager (trie) on one in-memory store,
    as the workers of one process share it."""

    shared = True

    def __init__(self) -> None:
        super().__init__()
        self._data: dict[str, bytes] = {}
        self._data_lock = threading.Lock()

    def _put_new(self, name: str, data: bytes) -> bool:
        with self._data_lock:
            if name in self._data:
                return False
            self._data[name] = data
            return True

    def _get_many(self, names: Sequence[str]) -> list[Optional[bytes]]:
        with self._data_lock:
            return [self._data.get(n) for n in names]

    def _delete(self, name: str) -> None:
        with self._data_lock:
            self._data.pop(name, None)

    def _names(self) -> list[str]:
        with self._data_lock:
            return list(self._data)
