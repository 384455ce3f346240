"""Store sizes fitted to the workload: what ``auto`` resolves to, and which sizes are refused.

A runtime's geometry and dtype fix the bytes of one chunk (``2 * n_layers`` KV values plus one
latent); a workload says how many chunks it keeps cached at once (``cache_chunks``, e.g. the
gate's A writes ``n`` chunks and C ``n - |P|`` more). Beside a chunk's KV a store also holds what
the runtime stores with it (``beside_chunk_bytes() -> {what: bytes of one value}``, optional;
``session_encode_bytes(session_chunks)``, optional: a session's stored encodes, counted once):
its handed-out frames with every chunk, and the decoder's state after chunks ``N-1, 2N-1, ...``
(``manager.decoder_state_every=N``; the chunks at those depths among the workload's
``cache_chunk_depths``, else one in N). Together they are a `CacheNeed`; ``auto`` counts both, so
that the workload's own values never evict its chunks.

Before a store is built, the orchestrator resolves every size field the store class declares
(``size_fields(config) -> list[SizeField]``, a class method: the `SizedStore` capability):

- ``segment`` (a Plan segment, mapped and pre-faulted whole at start): ``auto`` is the workload's
  chunks at their footprint in the segment (values rounded up to the allocator's block), over the
  eviction high watermark so that the workload itself never triggers eviction, rounded up (to a
  MiB, or a page below 64 MiB), and capped at `ROOM_SHARE` of the free memory;
- ``capacity`` (a generic tier's bound; null = unbounded): ``auto`` is unbounded when the
  workload's bytes fit in `ROOM_SHARE` of the free room (memory, or the disk under the root),
  else that room;
- ``staging`` (host memory that holds writes in flight): ``auto`` is `STAGING_CHUNKS` chunks,
  capped like a segment.

A segment in the runtime's own device memory (the HBM tier's pool: `SizeField.device_room`) is
fitted to `runtime_device_room`: the device's free memory after the runtime's weights (built
first, so the free figure excludes them) and what it still allocates while it runs (its ring and
activations, `device_reserve` of the runtime factory).

A size, given or resolved, that cannot hold one chunk is a `ConfigError` with the numbers and the
fix, raised before anything is allocated; so is a segment or staging area larger than the free
memory. Every size is reported as one line (`resolve_sizes` returns them): an ``auto`` one with
what it resolved to and why, a given one with the bytes it was read as, so that a unit read
otherwise than meant shows at start instead of when the store fills.
"""

from __future__ import annotations

import math
from collections.abc import MutableMapping, Sequence
from typing import Any, Optional, Protocol

import attrs

from cacheseek.errors import ConfigError
from cacheseek import sizes
from cacheseek.sizes import AUTO, format_size, parse_size

__all__ = ["CacheNeed", "SizeField", "SizedStore", "ROOM_SHARE", "STAGING_CHUNKS", "UNFITTED", "need_for",
           "resolve_sizes", "check_capacity", "runtime_device_room"]

ROOM_SHARE = 0.8  # of the free memory (or disk) that ``auto`` may take
# What ``auto`` is per role when no workload says how many chunks it keeps (a store built directly)
UNFITTED: dict[str, Optional[int]] = {"segment": 1 << 30, "capacity": None, "staging": 256 << 20}
STAGING_CHUNKS = 2  # the Plan tier keeps two writes in flight by default (staging_slots)
_MiB = 1 << 20
_ROLES = ("segment", "capacity", "staging")
_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


@attrs.frozen(slots=True)
class CacheNeed:
    """What one workload asks of a store: ``chunks`` chunks of ``values`` (bytes of each value of
    one chunk, KV first, the latent last), for ``geometry`` in ``dtype``; ``why`` says where the
    chunk count comes from, in a few words for the report ("the gate: A writes 4, C 2").
    ``beside``: the values stored beside the chunks, ``(what, bytes of one, how many)`` (the
    frames of every chunk, the decoder states at resume points)."""

    values: tuple[int, ...] = attrs.field(converter=tuple)
    chunks: int
    geometry: str
    dtype: str
    why: str
    beside: tuple[tuple[str, int, int], ...] = attrs.field(default=(), converter=tuple)

    @property
    def chunk_bytes(self) -> int:
        return sum(self.values)

    def beside_bytes(self, alignment: int = 1) -> int:
        """Bytes of every value stored beside the chunks, each rounded up to ``alignment``."""
        a = max(1, alignment)
        return sum(count * (-(-nbytes // a) * a) for _, nbytes, count in self.beside)

    def total(self, alignment: int = 1) -> int:
        """Bytes of the workload's chunks and of what is stored beside them."""
        return self.chunks * self.footprint(alignment) + self.beside_bytes(alignment)

    def describe_beside(self, alignment: int = 1) -> str:
        """The values beside the chunks in words ("" when none)."""
        parts = [f"{count} {what} of {format_size(-(-nbytes // max(1, alignment)) * max(1, alignment))}"
                 for what, nbytes, count in self.beside if count]
        return " and ".join(parts)

    def footprint(self, alignment: int = 1) -> int:
        """Bytes of one chunk in a store that rounds each value up to ``alignment``."""
        a = max(1, alignment)
        return sum(-(-v // a) * a for v in self.values)

    def describe(self, alignment: int = 1) -> str:
        kv = len(self.values) - 1
        return (f"a {self.geometry} chunk is {format_size(self.footprint(alignment))} "
                f"({kv} KV values of {format_size(self.values[0])} and a latent, {self.dtype})")


@attrs.frozen(slots=True)
class SizeField:
    """One size of a store's config: ``path`` under ``store.`` (dots for nested keys), its
    ``role`` (segment, capacity or staging), the free ``room`` it must fit (None = unknown) and
    what that room is (``room_label``), the store's value ``alignment``, and ``default`` (what a
    missing key means). ``total``: all the medium has (the machine's memory, the disk's size;
    None = unknown): a size above it is refused whatever the role. ``device_room``: the room is the runtime device's, filled in by the
    orchestrator (`runtime_device_room`)."""

    path: str
    role: str = attrs.field(validator=attrs.validators.in_(_ROLES))
    room: Optional[int] = None
    room_label: str = "free memory"
    alignment: int = 1
    default: Any = AUTO
    device_room: bool = False
    total: Optional[int] = None


class SizedStore(Protocol):
    """A store class whose config holds sizes that `resolve_sizes` resolves and checks."""

    @classmethod
    def size_fields(cls, config: dict[str, Any]) -> list[SizeField]: ...


def need_for(runtime_factory: Any, workload: Any, decoder_state_every: int = 0) -> Optional[CacheNeed]:
    """The `CacheNeed` of ``workload`` on ``runtime_factory`` (geometry and dtype, what it stores
    beside a chunk), or None when the workload does not say how many chunks it keeps
    (``cache_chunks``). ``decoder_state_every``: the manager's (0: no decoder state stored)."""
    chunks = getattr(workload, "cache_chunks", None)
    geometry = getattr(runtime_factory, "geometry", None)
    if chunks is None or geometry is None:
        return None
    dtype = str(getattr(runtime_factory, "dtype", "bfloat16"))
    item = _ITEMSIZE.get(dtype, 2)
    kv = geometry.kv_nbytes_per_chunk(item)
    values = [kv] * (2 * geometry.n_layers) + [geometry.latent_nbytes(item)]
    why = getattr(workload, "cache_chunks_why", None) or type(workload).__name__
    chunks = int(chunks)
    beside_fn = getattr(runtime_factory, "beside_chunk_bytes", None)
    beside = dict(beside_fn(decoder_state_every)) if beside_fn is not None else {}
    counts = {"frames": chunks, "decoder state": _resume_points(workload, chunks, decoder_state_every)}
    encodes_fn = getattr(runtime_factory, "session_encode_bytes", None)
    if encodes_fn is not None:  # the workloads run one prompt and one image: one session's encodes
        depths = getattr(workload, "cache_chunk_depths", None)
        beside["session's encodes"] = encodes_fn(max(depths) + 1 if depths else chunks)
        counts["session's encodes"] = 1
    stored = tuple((what, int(nbytes), counts[what]) for what, nbytes in beside.items() if nbytes and counts[what])
    return CacheNeed(values=values, chunks=chunks, geometry=geometry.name, dtype=dtype, why=why, beside=stored)


def _resume_points(workload: Any, chunks: int, every: int) -> int:
    """How many of the workload's chunks get a decoder state at ``every``: those at depths
    ``N-1, 2N-1, ...`` among its ``cache_chunk_depths`` (0-based, one per chunk kept), else one
    chunk in ``every``, rounded up."""
    if every <= 0:
        return 0
    depths = getattr(workload, "cache_chunk_depths", None)
    if depths is None:
        return -(-chunks // every)
    return sum(1 for d in depths if (int(d) + 1) % every == 0)


def runtime_device_room(runtime_factory: Any, need: Optional[CacheNeed]) -> tuple[int, str]:
    """The free memory of the runtime's device once its weights are there, less what the runtime
    says it still needs (``device_reserve(chunks) -> [(what, bytes)]``, optional), and the words
    for the report."""
    device = str(getattr(runtime_factory, "device", "cpu"))
    reserve = getattr(runtime_factory, "device_reserve", None)
    parts = list(reserve(need.chunks if need is not None else 1)) if reserve is not None else []
    free = sizes.device_free_bytes(device)  # after device_reserve: it builds the weights first
    held = sum(b for _, b in parts)
    room = max(0, free - held)
    if not parts:
        return room, f"free memory on {device}"
    what = ", ".join(f"{name} {format_size(b)}" for name, b in parts)
    return room, f"free memory on {device} ({format_size(free)} with the weights loaded, less the runtime's {what})"


def _get(cfg: MutableMapping[str, Any], path: str, default: Any) -> Any:
    node: Any = cfg
    for part in path.split("."):
        if not isinstance(node, MutableMapping) or part not in node:
            return default
        node = node[part]
    return node


def _set(cfg: MutableMapping[str, Any], path: str, value: Any) -> None:
    parts = path.split(".")
    node = cfg
    for part in parts[:-1]:
        if node.get(part) is None:
            node[part] = {}
        node = node[part]
    node[parts[-1]] = value


def _auto(field: SizeField, need: Optional[CacheNeed], high_watermark: float) -> tuple[Optional[int], str]:
    """The value ``auto`` resolves to, and the reason in words."""
    room = None if field.room is None else int(field.room * ROOM_SHARE)
    room_words = "" if room is None else f"{ROOM_SHARE:.0%} of {format_size(field.room)} {field.room_label}"
    if need is None:
        fallback = UNFITTED[field.role]
        if fallback is not None and room is not None:
            fallback = min(fallback, room)
        return fallback, "the workload does not say how many chunks it keeps"
    chunk = need.footprint(field.alignment)
    what = f"{need.chunks} chunks of {format_size(chunk)} ({need.why})"
    beside = need.describe_beside(field.alignment)
    if beside:
        what = f"{what} and beside them {beside}"
    if field.role == "capacity":
        want = need.total(field.alignment)
        if room is None or want <= room:
            return None, f"{what} fit in {room_words or 'the room there is'}"
        return room, f"{what} do not fit: capped at {room_words}"
    if field.role == "staging":
        want = STAGING_CHUNKS * chunk
        why = f"{STAGING_CHUNKS} writes in flight of {format_size(chunk)}"
    else:
        want = math.ceil(need.total(field.alignment) / high_watermark)
        why = f"{what}, below the {high_watermark:.0%} eviction watermark"
    unit = _MiB if want >= 64 * _MiB else 4096  # whole MiB for real sizes, pages for test geometries
    want = -(-want // unit) * unit
    if room is not None and want > room:
        return room, f"{why}, capped at {room_words}"
    if field.device_room and room is not None:
        why = f"{why}; room: {room_words}"
    return want, why


def resolve_sizes(cfg: MutableMapping[str, Any], fields: Sequence[SizeField], need: Optional[CacheNeed],
                  *, high_watermark: float = 0.9) -> list[str]:
    """Resolve ``auto`` and units in ``cfg`` (a store's config, changed in place) to byte counts;
    refuse sizes that cannot hold one chunk or exceed the room. Returns one line per size."""
    notes = []
    for field in fields:
        name = f"store.{field.path}"
        given = _get(cfg, field.path, field.default)
        if given is None and field.role != "capacity":  # an option left unset (`ClientOptions`)
            given = field.default
        value = parse_size(given, name, allow_auto=True, allow_none=field.role == "capacity")
        auto = value == AUTO
        if auto:
            value, why = _auto(field, need, high_watermark)
            notes.append(f"{name}=auto -> {format_size(value)} ({why})")
        else:
            how = sizes.describe_given(given)
            notes.append(f"{name}={'null' if given is None else given} -> {_as_read(value)} (as given"
                         f"{'; ' + how if how else ''})")
        if value is not None and need is not None:
            _check_holds_a_chunk(name, value, field, need, high_watermark, auto)
        if value is not None and field.total and value > field.total:
            medium = "disk" if "disk" in field.room_label else "memory"
            raise ConfigError(name, f"{format_size(value)} is more than this machine's whole {medium} "
                              f"({format_size(field.total)}; {format_size(field.room)} of it {field.room_label})",
                              f"use {name}=auto (fitted to the workload and the room), or a size below "
                              f"{format_size(field.total)}")
        if value is not None and field.role != "capacity" and field.room is not None and value > field.room:
            raise ConfigError(name, f"{format_size(value)} is more than the {format_size(field.room)} of "
                              f"{field.room_label} (it is mapped and faulted in whole at start)",
                              f"use {name}=auto or a size below {format_size(int(field.room * ROOM_SHARE))}")
        _set(cfg, field.path, value)
    return notes


def _as_read(value: Optional[int]) -> str:
    """A given size as it was read: the bytes, and the binary size when that is shorter."""
    if value is None:
        return "unbounded"
    short = format_size(value)
    return f"{value} bytes" if short.endswith(" B") else f"{short} = {value} bytes"


def _check_holds_a_chunk(name: str, value: int, field: SizeField, need: CacheNeed, high_watermark: float,
                         auto: bool) -> None:
    chunk = need.footprint(field.alignment)
    if value >= chunk:
        return
    if auto:
        raise ConfigError(name, f"auto found only {format_size(value)} of room ({ROOM_SHARE:.0%} of the "
                          f"{format_size(field.room)} of {field.room_label}), and {need.describe(field.alignment)}",
                          "free memory, or run a smaller geometry (runtime.geometry=tiny)")
    fitted, _ = _auto(attrs.evolve(field, room=None), need, high_watermark)
    fit = f"auto ({format_size(fitted)} holds {need.chunks} chunks, {need.why})" if fitted else "auto"
    raise ConfigError(name, f"{format_size(value)} cannot hold one chunk: {need.describe(field.alignment)}",
                      f"use {name}={fit}, or at least {format_size(chunk)}")


def check_capacity(capacity: Optional[int], need: Optional[CacheNeed], what: str, fix: str) -> None:
    """After a store is built: its reported ``capacity`` (e.g. a Fluxon service's segment) must
    hold one chunk. ``what`` names it, ``fix`` says how to get a bigger one."""
    if capacity is None or need is None or capacity >= need.chunk_bytes:
        return
    raise ConfigError(what, f"{format_size(capacity)} cannot hold one chunk: {need.describe()}", fix)
