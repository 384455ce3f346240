"""`PlanTierStore` (store ``fluxon_plan``): the store interfaces over the Plan tier's roles;
every method checks the store is open and hands the call to one role. Its warm-up: `Warmup`
(`cacheseek.stores.plan_tier.warmup`).

It is a `TierStore` and a `PathReadStore` (``accepts_device_views``): the manager hands it
detached views of the ring tail on write and a `RestoreTarget` on read (docs/design.md section 2).

Lifecycle::

    PlanTierStore(...)   the client built (or given), then warmed up (`Warmup`): its segments
                         ready and registered, streams made, staging allocated (`TransferLink`)
    put_async / put_skeleton / copy_values_from   -> `Writer` (overlapped: `Completion`)
    read_path / get_skeleton / get_layer / contains -> `Reader`
    usage / free / free_skeleton                  -> `SegmentCapacity`
    ready / wait_ready / session_starting         -> `Warmup` (and its `SessionStarts`)
    records   the client's chunk records (a Fluxon cluster's; none for the embedded one)
    close()   flush; the completion thread stopped; staging dropped; streams destroyed;
              segments unregistered; what the store built closed. Idempotent; any other call
              after it raises `StoreClosedError`.

No checksum on this tier, by decision: its values live in host DRAM (ECC on server machines) that
only the GPU's copy engines write and read, in batches at PCIe speed (about 50 GiB/s a
direction). A checksum would need the CPU to read every byte of a 3.57 GiB chunk on the hot
path (xxh3 at about 10-30 GB/s on one core: 0.15-0.4 s, against the 70 ms copy), or a checksum
kernel on the device in the middle of the batch, to guard a medium with no silent-corruption path
of its own (no disk, no socket). Values that vanish (evicted, a restarted owner) are caught as
misses (``contains``) and invalidated by the manager; the tiers whose media can corrupt (LocalDisk
files, the generic Fluxon tier) carry checksums (`cacheseek.stores.checksum`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

import attrs

from cacheseek.errors import ConfigError, StoreClosedError, StoreTimeoutError
from cacheseek.kv.handles import BlobHandle, ChunkNode, Tier
from cacheseek.kv.payload import LayerPayload, RestoreTarget
from cacheseek.plan.base import PlanClient
from cacheseek.registry import STORES
from cacheseek.sizes import AUTO, Size, parse_size
from cacheseek.sizing import SizeField
from cacheseek.stores.base import PathReadStore
from cacheseek.stores.plan_tier.capacity import SegmentCapacity, StagingSlots
from cacheseek.stores.plan_tier.read import Reader
from cacheseek.stores.plan_tier.segments import (ClientOptions, TransferLink, build_client, client_records,
                                                 client_size_fields)
from cacheseek.stores.plan_tier.stats import Counters, PlanTierStats, collect
from cacheseek.stores.plan_tier.warmup import Warmup, WarmupOptions
from cacheseek.stores.plan_tier.write import Completion, Writer
from cacheseek.stores.startup import StartToken
from cacheseek.transfer.protocol import TransferRuntime

__all__ = ["PlanTierStore"]


def _positive(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"store.{name}", f"must be an int >= 1, got {value!r}")
    return value


def _positive_seconds(name: str, value: Any) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= 1:
        raise ConfigError(f"store.{name}", f"must be seconds in (0, 1], got {value!r}")
    return float(value)


@attrs.frozen(slots=True)
class _WriteOptions:
    """The write path's options, checked (`PlanTierStore`'s docstring says what each does)."""

    staging_slots: int = attrs.field(converter=lambda v: _positive("staging_slots", v))
    write_pieces_in_flight: int = attrs.field(converter=lambda v: _positive("write_pieces_in_flight", v))
    staging_slot_bytes: int = attrs.field(converter=lambda v: parse_size(v, "store.staging_slot_bytes"))
    max_inflight_bytes: int = attrs.field(converter=lambda v: parse_size(v, "store.max_inflight_bytes"))
    write_piece_bytes: int = attrs.field(converter=lambda v: parse_size(v, "store.write_piece_bytes"))
    write_poll_s: float = attrs.field(converter=lambda v: _positive_seconds("write_poll_s", v))


@STORES.register("fluxon_plan", objects=("transfer", "plan_client", "geometry_bytes"))
class PlanTierStore(PathReadStore):
    """KV tier over a Plan client and a transfer runtime.

    ``client``: a `PLAN_CLIENTS` name, built with ``segment_bytes`` (``"auto"``: fitted to the
    workload by the orchestrator, 1 GiB when built directly), ``prefault_threads``, ``backing``,
    ``hugepages``, ``shm_dir`` (where its schema has them) and ``client_options`` (`ClientOptions`
    or a dict of them: the given ones, typed by Hydra); or pass a built client as ``plan_client`` (the caller then keeps owning it). ``transfer``: a
    built `TransferRuntime` (the caller keeps owning it); else ``transfer_kind`` from `TRANSFERS`
    is built for ``device`` now, or for the device of the first tensors seen.
    ``overlap``: None = on for a CUDA runtime, off for the host runtime; on needs a runtime with
    the `AsyncTransfer` capability. ``staging_slots`` x ``staging_slot_bytes`` (0: sized by the
    first chunk) of device memory hold the snapshots of in-flight writes; ``max_inflight_bytes``
    (0: no bound beyond the slots) bounds the bytes of pending writes. ``write_piece_bytes``: the
    overlapped D2H goes out in pieces of about this size, ``write_pieces_in_flight`` at a time,
    from the completion thread (0: one batch from put_async; why: `Completion`), which polls a
    piece's event every ``write_poll_s`` once it is due (each wake takes the GIL from the
    runtime's launching thread: experiments/write_polls). ``warmup``,
    ``register_piece_bytes``, ``warmup_yield_s`` and, in a background warm-up, the default
    ``prefault_threads``: `WarmupOptions`.
    """

    __module__ = "cacheseek.stores.plan_tier"  # its public path: configs and results name it there

    knows_contents = True
    frees_latents = True
    copies_values = True
    storage_format = "cacheseek.plan.raw.v1"  # bare bytes; shapes and dtypes come from the runtime
    tier = Tier.FLUXON_DRAM

    def __init__(
        self,
        client: str = "embedded",
        segment_bytes: Size = AUTO,
        prefault_threads: int = 0,
        backing: str = "shared",
        hugepages: bool = True,
        shm_dir: Optional[str] = None,
        transfer_kind: str = "auto",
        device: Optional[str] = None,
        commit_timeout_s: float = 30.0,
        overlap: Optional[bool] = None,
        staging_slots: int = 2,
        staging_slot_bytes: Size = 0,
        max_inflight_bytes: Size = 0,
        write_piece_bytes: Size = "32MiB",
        write_pieces_in_flight: int = 2,
        write_poll_s: float = 0.0002,
        client_options: Optional[ClientOptions] = ClientOptions(),
        warmup: str = "foreground",
        register_piece_bytes: Union[Size, str, None] = "auto",
        warmup_yield_s: float = 2.0,
        *,
        transfer: Optional[TransferRuntime] = None,
        plan_client: Optional[PlanClient] = None,
        geometry_bytes: Optional[tuple[int, int]] = None,
    ) -> None:
        writes = _WriteOptions(staging_slots, write_pieces_in_flight, staging_slot_bytes, max_inflight_bytes,
                               write_piece_bytes, write_poll_s)
        options = WarmupOptions.of(warmup, register_piece_bytes, prefault_threads, warmup_yield_s)
        self.commit_timeout_s = commit_timeout_s
        self.transfer_kind = transfer_kind
        self._closed = False
        self._counters = Counters()
        self._warmup = Warmup(options, self._counters)
        self.starts = self._warmup.starts  # the sessions starting now, which the warm-up yields to
        self.owns_client = plan_client is None  # whether it built its Plan client (and closes it)
        if plan_client is None:
            plan_client = build_client(client, dict(segment_bytes=segment_bytes, prefault_threads=options.prefault_threads,
                                                    backing=backing, hugepages=hugepages, shm_dir=shm_dir),
                                       client_options, geometry_bytes=geometry_bytes)
        self._client: PlanClient = plan_client
        self.records = client_records(plan_client)
        self._latent_sizes: dict[str, int] = {}
        self._link = TransferLink(plan_client, transfer, transfer_kind=transfer_kind, device=device,
                                  overlap=overlap, counters=self._counters, on_attach=lambda like: self._slots.fill(like),
                                  piece_bytes=options.piece_bytes, piece_pause_s=options.piece_pause_s,
                                  yield_to=self._warmup.yield_to)
        self._slots = StagingSlots(writes.staging_slots, writes.staging_slot_bytes, writes.max_inflight_bytes,
                                   timeout_s=commit_timeout_s, allocate=self._link.staging_tensor,
                                   counters=self._counters, pending_writes=lambda: self._completion.pending)
        self._completion = Completion(self._slots, self._counters, pieces_in_flight=writes.write_pieces_in_flight,
                                      poll_s=writes.write_poll_s, timeout_s=commit_timeout_s)
        self._reader = Reader(self._link, self._counters, self._latent_sizes)
        self._writer = Writer(self._link, self._slots, self._completion, self._counters, self._latent_sizes,
                              piece_bytes=writes.write_piece_bytes, timeout_s=commit_timeout_s)
        self._capacity = SegmentCapacity(plan_client, self._counters, self._latent_sizes, self.records)
        try:
            self._warmup.start(lambda: self._link.warm_up(device))
        except BaseException:
            self._teardown()
            if self.owns_client:
                self._client.close()
            raise

    @classmethod
    def size_fields(cls, config: dict[str, Any]) -> list[SizeField]:
        """`SizedStore`: the embedded client's ``segment_bytes``, or the host staging
        (``client_options.staging_bytes``) of a client that stages writes, against free memory."""
        return client_size_fields(config)

    # -- what it is attached to -----------------------------------------------------------------
    @property
    def transfer(self) -> Optional[TransferRuntime]:
        return self._link.transfer

    @property
    def plan_client(self) -> PlanClient:
        return self._client

    @property
    def overlap(self) -> bool:
        """Whether writes return before their copies land (resolved once a runtime is known)."""
        return self._link.overlap

    @property
    def values_on_device(self) -> bool:
        """Whether the client's values live in device memory (the HBM tier): copies in and out
        of them are D2D and the segment is a declared device range, not a registered mapping."""
        return self._link.values.on_device

    @property
    def ready(self) -> bool:
        return self._warmup.ready

    def wait_ready(self, timeout_s: Optional[float] = None) -> bool:
        """Block until a background warm-up ended, at most ``timeout_s``; whether it is ready.
        The warm-up stops waiting for a first session."""
        return self._warmup.wait(timeout_s)

    def session_starting(self) -> StartToken:
        """While the token is held, and at most ``warmup_yield_s``, a background warm-up does no
        further step (its setup, a segment piece); `NO_TOKEN` once the warm-up ended."""
        return self._warmup.session_starting()

    @property
    def stats(self) -> PlanTierStats:
        self._warmup.note_state()
        inflight, peak, staging = self._slots.snapshot()
        timers_fn, transfer = self._link.calls.segment_timers, self._link.transfer
        return collect(self._counters, usage=self.usage(), timers=timers_fn() if timers_fn is not None else None,
                       pending_writes=self._completion.pending, inflight_bytes=inflight, peak_inflight_bytes=peak,
                       staging_bytes=staging, transfer=transfer.stats.as_dict() if transfer is not None else {})

    completion_thread = property(lambda self: self._completion.thread,
                                 doc="The thread that finishes overlapped writes, once started (None before).")

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("Plan tier store used after close()")

    def _check_writable(self) -> None:
        self._check_open()
        if self._warmup.warming(writes=1):
            raise self._warmup.refuse_write()

    # -- write ----------------------------------------------------------------------------------
    def put_async(self, locator: str, payload: Sequence[LayerPayload], *, tier: Tier,
                  on_ready: Optional[Callable[[BlobHandle], None]] = None, stream: Any = None) -> BlobHandle:
        """Write one chunk's KV (per layer ``(k, v)`` views ``[1, chunk_tokens, H, D]``,
        contiguous, on the runtime device) under ``{locator}:L{i}:k/v``; ``stream``: where the
        views were produced (None: the current stream). The handle comes back ready, or PENDING
        with overlap. Raises a `StoreError` (handle.error set) for a failure found before it
        returns."""
        self._check_writable()
        return self._writer.put_async(locator, payload, tier=tier, on_ready=on_ready, stream=stream)

    def put_skeleton(self, locator: str, latent: Any, *, stream: Any = None) -> None:
        """Write one latent (a contiguous tensor on the runtime device) as the value ``locator``
        (``{hex}:lat``), synchronously. Raises a `StoreError`."""
        self._check_writable()
        self._writer.put_latent(locator, latent, stream=stream)

    def copy_values_from(
        self, source: "PlanTierStore", keys: Sequence[str], lengths: Optional[Sequence[int]] = None
    ) -> Optional[int]:
        """Copy the published values ``keys`` of another Plan-style store into this one under the
        same keys: one get plan on ``source``, one batch straight from its values into this
        store's reserved values (H2D, D2H, D2D or H2H), one synchronize, then commit: publication
        last. How tiers promote and demote without a staging copy. ``lengths``: each value's byte length (default:
        what ``source`` knows of them). All or nothing: None, with nothing written, when a key is
        missing from ``source``; a `StoreError` (nothing written) on any failure. Both stores'
        memory must be known to this store's transfer runtime (the tiered store shares one).
        Returns the bytes copied."""
        self._check_open()
        source._check_open()
        if not source.ready:
            return None
        self._check_writable()
        return self._writer.copy_from(source._reader, keys, lengths)

    # -- read -----------------------------------------------------------------------------------
    def read_path(
        self, path: Sequence[ChunkNode], window: Sequence[ChunkNode], target: RestoreTarget
    ) -> bool:
        """`PathReadStore.read_path`; `LayoutMismatchError` when the blob handles or the runs
        disagree with ``target``."""
        self._check_open()
        if self._warmup.warming(reads=1):
            return False
        return self._reader.read_path(path, window, target)

    def get_skeleton(self, locator: str, like: Any = None, *, nbytes: Optional[int] = None) -> Any:
        """The latent stored under ``locator``, or None when absent. With ``like`` (a tensor on the
        runtime device), a new tensor of its shape and dtype filled with the value; without, the
        raw bytes (size from ``nbytes`` or from this store's own `put_skeleton`). Restores read
        latents through `read_path`."""
        self._check_open()
        if not self._warmup.ready:
            return None
        return self._reader.get_latent(locator, like, nbytes)

    def get_layer(
        self, handle: BlobHandle, layer: int, *, like: Optional[LayerPayload] = None
    ) -> Optional[LayerPayload]:
        """One layer's ``(k, v)``, or None when either is missing. With ``like`` (a ``(k, v)``
        pair of tensors on the runtime device) new tensors of their shapes and dtypes; without,
        raw bytes of ``handle.nbytes / (2 * n_layers)`` each (K and V of one size). The manager
        restores through `read_path`; this is the generic per-layer read."""
        self._check_open()
        if not self._warmup.ready:
            return None
        return self._reader.get_layer(handle, layer, like)

    def contains(self, keys: Sequence[str]) -> list[bool]:
        self._check_open()
        if not self._warmup.ready:
            return [False] * len(keys)
        return self._reader.contains(keys)

    # -- capacity and reclamation (the manager's eviction and consistency checks) ----------------
    def usage(self) -> Any:
        """The client's `PlanUsage` (segment bytes in use, its capacity, values), or None when the
        client does not report it or the store is closed."""
        return None if self._closed or not self._warmup.ready else self._capacity.usage()

    def free(self, handle: BlobHandle) -> None:
        """`SegmentCapacity.free`; the latent stays."""
        self._check_open()
        if self._warmup.ready:  # nothing was written before (and a miss while warming is no loss)
            self._capacity.free(handle)

    def free_skeleton(self, locator: str) -> None:
        self._check_open()
        if self._warmup.ready:
            self._capacity.free_latent(locator)

    # -- lifetime -------------------------------------------------------------------------------
    def flush(self, timeout_s: Optional[float] = None) -> None:
        """Wait until every pending write has committed or failed (a failure is on its handle and
        in `stats`; nothing is raised). Returns at once without overlap. Bounded: at most
        ``timeout_s`` seconds (default: ``commit_timeout_s`` per pending write, at least 4 of them);
        `StoreTimeoutError` past it, naming how many writes are pending (they go on). The values
        written beside chunks first (`TierStore.flush_beside`)."""
        self.flush_beside(timeout_s)
        self._completion.flush(timeout_s)

    def close(self) -> None:
        if self._closed:
            return
        self._warmup.join(max(60.0, self.commit_timeout_s))  # never tear down under the warm-up
        self.close_beside()  # nor under a value being written beside a chunk (raises: nothing torn down)
        try:
            self.flush()
        finally:
            self._closed = True
            self._slots.close()
            # Never tear streams, registrations or the client down under a live completion thread.
            self._completion.stop()
            if self._reader.held.release(final=True):  # a late restore's copies: views leaked
                raise StoreTimeoutError("plan tier: a restore's copies are still in flight at close; its "
                                        "views, registrations and client are left in place (leaked)")
            try:
                self._teardown()
            finally:
                if self.owns_client:
                    self._client.close()

    def _teardown(self) -> None:
        self._slots.drop()
        self._link.close()

    def __repr__(self) -> str:
        return (f"PlanTierStore(client={type(self._client).__name__}, transfer={self._link.transfer!r}, "
                f"overlap={self._link.overlap})")
