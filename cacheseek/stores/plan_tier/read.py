"""The Plan tier's read path: `Reader` restores a window path into the runtime's ring, reads one
latent or one layer, probes which keys are published; `GetRead` is one get plan.

Lifecycle of a get plan (`GetRead`)::

    get_start(keys, atomic_group_lens)  started (counted ``gets_started``)
    transfer(expected)   ``get_transfer``: the readable prefix, whole groups only; with
                         ``expected``, each value's length checked against its target before
                         anything is copied (`LayoutMismatchError`)
    end()                exactly once, on every path, after any copy out of its values landed:
                         ``release_views`` when transferred, else ``cancel_get_transfer``
    held                 a restore whose copies did not land within the transfer runtime's bound
                         (``TransferTimeoutError``) keeps its views: the copies may still read
                         them. `HeldReads.release` ends it once its batch is known to have
                         ended (at the next read, and at close); at close the plans still copying
                         are leaked, never released under DMA (counted: ``views_held``,
                         ``views_released_late``, ``views_leaked``). The ring is safe meanwhile:
                         the runtime's stream is ordered after the batch.

Read of depth K (`read_path`): the path checked against the target before any Plan call
(`check_path`: a miss, or a layout mismatch), and the target's copy runs as int64 arrays
(`run_arrays`, cached per window shape: a runtime restores the same few shapes); then one
get of the path's latents (``{hex}:lat``, one all-or-nothing group) and the window's KV, chunk-major
(``atomic_group_lens = [K, 2 * n_layers, 2 * n_layers, ...]``: a partial transferable prefix is a
miss and nothing is copied); then every copy run of every layer, K and V, followed by the latents,
in one batch (one validation, one submission: the engine starts on the KV while nothing else is
queued). The batch goes on the producer stream itself where the runtime moves it as fast there
(`fast_on`: the range-copy kernel takes it, or the stream is not the legacy one): the stream
orders it after the ring's zeroing and before the runtime's next read of the ring. Otherwise it
goes on the read stream after an event on the producer stream, and the producer stream waits for
the read's completion event. Either way the host synchronizes once before the views are
released.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Optional

import attrs

from cacheseek.errors import CorruptValueError, LayoutMismatchError, PlanError, PlanTableError, TransferTimeoutError
from cacheseek.errors import add_note
from cacheseek.kv.handles import BlobHandle, ChunkNode
from cacheseek.kv.locators import blob_keys, layer_keys
from cacheseek.kv.payload import LayerPayload, RestoreTarget
from cacheseek.plan.base import GetPlan, PlanClient
from cacheseek.plan.table import decode_plan_table
from cacheseek.stores.plan_tier.segments import Attached, TransferLink, ValueMemory, copy_now, nbytes
from cacheseek.stores.plan_tier.stats import Counters, settle
from cacheseek.transfer import host_out
from cacheseek.transfer.batch import CopyBatch
from cacheseek.transfer.lazy import LazyModule
from cacheseek.transfer.memory import DeviceRanges, MemoryRange
from cacheseek.transfer.pending import PendingBatch

__all__ = ["GetRead", "HeldReads", "Reader", "check_path", "run_arrays", "runs_as_arrays"]

np = LazyModule("numpy")
log = logging.getLogger(__name__)

_RESTORE_POLL_S = 2e-5
_SLEEP_FRACTION = 0.8  # of the expected time, asleep before polling: the rate varies by a few percent


@attrs.frozen(slots=True)
class _Declared:
    """A reader's memo of the device ranges of its last restore target (`Reader._declared`):
    ``ring_spans`` ``(address, bytes)`` per ring tensor, layer-major, K before V, and their
    checked ranges and addresses; ``lat_spans`` the latent targets'; ``ranges`` everything
    declared."""

    transfer: Any
    ring_spans: tuple[tuple[int, int], ...]
    ring_ranges: tuple[MemoryRange, ...]
    ring_ptrs: Any  # int64 [len(ring_spans)]
    lat_spans: Optional[tuple[tuple[int, int], ...]] = None
    ranges: Optional[DeviceRanges] = None


class GetRead:
    """One get plan of a read: ``transfer()`` once, then ``end()`` releases or cancels it."""

    def __init__(self, client: PlanClient, counters: Counters, latent_sizes: dict[str, int], plan: GetPlan,
                 value_lengths: Optional[Callable[[GetPlan], Sequence[int]]]) -> None:
        self._client = client
        self._value_lengths = value_lengths  # the client's `PlanValueLengths`, when it has it
        self._counters = counters
        self._latent_sizes = latent_sizes
        self.plan = plan
        self.transferred = False
        self.ended = False

    def transfer(self, expected: Optional[Sequence[int]] = None) -> tuple[int, int]:
        """``(table, n_transferable)``. With ``expected`` (the byte length of each key's target),
        every transferable value is checked against its target before anything is copied:
        `LayoutMismatchError` names the first that differs (the plan is still ended by `end`)."""
        table, n = self._client.get_transfer(self.plan)
        self.transferred = True
        self._counters.count(gets_transferred=1)
        if expected is not None and n:
            self._check_lengths(list(expected)[:n])
        return table, n

    def _check_lengths(self, expected: list[int]) -> None:
        keys = self.plan.keys
        if self._value_lengths is not None:
            lengths = list(self._value_lengths(self.plan))
        else:  # the store's own records of what it wrote (latents; KV sizes are on the blob)
            lengths = [self._latent_sizes.get(k, want) for k, want in zip(keys, expected)]
        if lengths[: len(expected)] == expected:  # a list compare: no Python work per value
            return
        for key, have, want in zip(keys, lengths, expected):
            if have != want:
                raise LayoutMismatchError(f"value {key} holds {have} B but its restore target takes {want} B: "
                                          "the stored layout differs from the runtime's (nothing was copied)")

    def end(self) -> None:
        if self.ended:
            return
        self.ended = True
        if self.transferred:
            self._client.release_views(self.plan)
        else:
            self._client.cancel_get_transfer(self.plan)
            self._counters.count(gets_cancelled=1)


class HeldReads:
    """Restores whose copies did not land within their wait (``held``, module docstring)."""

    def __init__(self, counters: Counters) -> None:
        self._counters = counters
        self._held: list[tuple[GetRead, PendingBatch]] = []
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self._held)

    def hold(self, read: GetRead, pending: PendingBatch) -> None:
        """Keep ``read``'s views until ``pending`` is known to have ended."""
        with self._lock:
            self._held.append((read, pending))
            self._counters.note(views_held=len(self._held))

    def release(self, *, final: bool = False) -> int:
        """End the held plans whose batches have ended; with ``final`` (the store's close) leak
        the others, counted. Returns how many are still copying."""
        with self._lock:
            held, self._held = self._held, []
        still = []
        for read, pending in held:
            if settle(pending, wait_s=0.0):
                try:
                    read.end()
                except Exception:  # noqa: BLE001 - nobody waits on this read any more
                    log.warning("plan tier: ending a late restore's get plan failed", exc_info=True)
                self._counters.count(views_released_late=1)
            else:
                still.append((read, pending))
        if final and still:
            log.error("plan tier: %d restores' copies still in flight at close: their views are leaked, "
                      "not released under DMA", len(still))
            self._counters.count(views_leaked=len(still))
        with self._lock:
            self._held.extend(() if final else still)
            self._counters.note(views_held=len(self._held))
        return len(still)


class Reader:
    """Reads through ``link``; ``latent_sizes`` is the store's record of the latents it wrote
    (the size of a latent read without ``like``, the length check of a client that reports
    none)."""

    def __init__(self, link: TransferLink, counters: Counters, latent_sizes: dict[str, int]) -> None:
        self._link = link  # read for `Attached` (attached_for) and `ValueMemory` (values) only
        self.client = link.client
        self.calls = link.calls
        self._counters = counters
        self._latent_sizes = latent_sizes
        self._ring: Optional[_Declared] = None
        self._best_rate = 0.0  # bytes/s of the fastest restore so far (submission to landing)
        self._dests: Optional[tuple] = None  # (declared, runs key, (dsts, sizes, codes)) of the last shape
        self.held = HeldReads(counters)  # restores whose copies may still run

    @property
    def values(self) -> ValueMemory:
        """Where the client's values live (known once its segments are ready)."""
        return self._link.values

    def _start(self, keys: list[str], group_lens: list[int]) -> GetRead:
        if self.held:
            self.held.release()
        read = GetRead(self.client, self._counters, self._latent_sizes, self.client.get_start(keys, group_lens),
                       self.calls.value_lengths)
        self._counters.count(gets_started=1)
        return read

    @contextlib.contextmanager
    def reading(self, keys: list[str], group_lens: list[int]) -> Iterator[GetRead]:
        """One get plan, ended when the block leaves (a failure to end it is a note on the
        block's own error)."""
        read = self._start(keys, group_lens)
        try:
            yield read
        except BaseException as exc:
            try:
                read.end()
            except Exception as end_error:
                add_note(exc, f"ending the get plan failed too: {end_error!r}")
            raise
        read.end()

    def lengths(self, read: GetRead) -> list[int]:
        """Byte lengths of a transferred read's values: the client's, else the latent records."""
        if self.calls.value_lengths is not None:
            return [int(n) for n in self.calls.value_lengths(read.plan)]
        lengths = [self._latent_sizes.get(k) for k in read.plan.keys]
        if any(n is None for n in lengths):
            raise LayoutMismatchError("value lengths unknown: pass lengths= to copy_values_from")
        return lengths  # type: ignore[return-value]

    # -- a whole window path --------------------------------------------------------------------
    def read_path(self, path: Sequence[ChunkNode], window: Sequence[ChunkNode], target: RestoreTarget) -> bool:
        t0 = time.perf_counter()
        self._counters.count(reads=1)
        found = check_path(list(path), list(window), target)
        if found is None:
            self._counters.count(read_misses=1)
            return False
        latent_keys, blobs = found
        moved = self._read_window(latent_keys, blobs, target, self._link.attached_for(target.kv[0][0]))
        if moved is None:
            self._counters.count(read_misses=1)
            return False
        self._counters.count(read_hits=1, get_bytes=moved, get_seconds=time.perf_counter() - t0)
        return True

    def _read_window(self, latent_keys: list[str], blobs: list[BlobHandle], target: RestoreTarget,
                     attached: Attached) -> Optional[int]:
        """The get and the batch of a read (module docstring). Bytes moved, or None on a miss (a
        missing latent or a partial transferable prefix: nothing is copied)."""
        transfer = attached.transfer
        width = 2 * target.n_layers
        keys = latent_keys + [k for blob in blobs for k in blob_keys(blob.locator, target.n_layers)]
        lat_sizes = [nbytes(t) for t in target.latents]
        read = self._start(keys, [len(latent_keys)] + [width] * len(blobs))
        producer: Any = None
        pending: Optional[PendingBatch] = None
        error: Optional[BaseException] = None
        try:
            table, n = read.transfer(lat_sizes + [target.chunk_value_nbytes] * (len(keys) - len(latent_keys)))
            if n < len(keys):
                return None
            values = np.array(decode_plan_table(table, n, arena=self.calls.arena()), dtype=np.int64)
            declared = self._declared(transfer, target)
            batch = self._window_batch(values, len(latent_keys), len(blobs), target, declared)
            ranges = declared.ranges
            if attached.read_stream is None:  # a runtime without streams: synchronous, on the caller's stream
                transfer.copy_batch(batch.descriptors(), device_ranges=ranges)
                return batch.nbytes
            if attached.fast_on is not None and attached.fast_on(batch):  # the producer stream orders it: no events
                pending = transfer.submit_batch(batch, stream=None, device_ranges=ranges)
                self._wait(pending)
                return batch.nbytes
            producer = transfer.record_event(None)  # the ring's zeroing and earlier work land first
            pending = transfer.submit_batch(batch, stream=attached.read_stream, device_ranges=ranges,
                                            after=[producer])
            transfer.stream_wait(None, pending)  # the runtime reads the ring after the copies
            self._wait(pending)  # the one synchronize before the views are released
            return batch.nbytes
        except BaseException as exc:
            error = exc
            raise
        finally:
            landed = settle(pending, error, wait_s=0.0 if isinstance(error, TransferTimeoutError) else None)
            if producer is not None:
                transfer.release_event(producer)
            if not landed:  # the copies may still read the views: keep them (module docstring)
                self.held.hold(read, pending)
                if error is not None:
                    add_note(error, "the restore's Plan views stay held until its copies are known to have ended")
            else:
                try:
                    read.end()
                except Exception as end_error:
                    if error is None:
                        raise
                    add_note(error, f"ending the get plan failed too: {end_error!r}")

    def _wait(self, pending: PendingBatch) -> None:
        """Wait for a restore's batch: asleep for most of the time the fastest restore so far
        would take for its bytes, then polling every `_RESTORE_POLL_S` (a restore lands in
        milliseconds: the default schedule's coarser polls would add a tenth of one to it)."""
        expected = _SLEEP_FRACTION * pending.nbytes / self._best_rate if self._best_rate else 0.0
        expected -= time.perf_counter() - pending.submitted_at  # the submission itself took that long
        pending.wait(poll_s=_RESTORE_POLL_S, expected_s=max(expected, 0.0))
        if pending.seconds:
            self._best_rate = max(self._best_rate, pending.nbytes / pending.seconds)

    def _window_batch(self, values: Any, n_latents: int, n_chunks: int, target: RestoreTarget,
                      declared: _Declared) -> CopyBatch:
        """The restore's copies from the value pointers of one get (``n_latents`` latents, then
        ``n_chunks`` chunks of ``2 * n_layers`` values): every copy run, chunk-major, then layer,
        K before V, into the ring; then each latent. Only the sources change between restores into
        the same ring and latent targets (`_destinations` keeps the rest)."""
        kv = values[n_latents:].reshape(n_chunks, 2 * target.n_layers)
        run_slot, src_off, _, _ = run_arrays(target)
        dsts, sizes, codes = self._destinations(target, declared)
        srcs = np.concatenate([(kv[run_slot] + src_off[:, None]).ravel(), values[:n_latents]])
        return CopyBatch(dsts, srcs, sizes, codes)

    def _destinations(self, target: RestoreTarget, declared: _Declared) -> tuple:
        """``(dsts, sizes, codes)`` of a restore into ``declared``'s ring and latent targets with
        ``target``'s runs, int64/int8 ``[runs * 2 * n_layers + latents]``, read-only; kept for the
        next restore of the same shape."""
        key = (tuple(target.runs), tuple(target.window_depths), int(target.token_bytes))
        kept = self._dests
        if kept is not None and kept[0] is declared and kept[1] == key:
            return kept[2]
        _, _, dst_off, run_bytes = run_arrays(target)
        width = 2 * target.n_layers
        dsts = np.concatenate([(declared.ring_ptrs[None, :] + dst_off[:, None]).ravel(),
                               np.array([p for p, _ in declared.lat_spans], dtype=np.int64)])
        sizes = np.concatenate([np.repeat(run_bytes, width),
                                np.array([n for _, n in declared.lat_spans], dtype=np.int64)])
        codes = np.full(len(dsts), self.values.from_values.code, dtype=np.int8)
        for a in (dsts, sizes, codes):
            a.flags.writeable = False
        self._dests = (declared, key, (dsts, sizes, codes))
        return dsts, sizes, codes

    def _declared(self, transfer: Any, target: RestoreTarget) -> _Declared:
        """The device ranges a restore declares (the ring's tensors, the latent targets, the value
        pool) and the ring's addresses. Each tensor is checked by ``transfer.device_range`` once
        per ring and once per set of latent targets: a runtime restores into the same ring every
        session, and declaring its 80 tensors anew would cost more than submitting the copies.
        Another ring (or another tensor at the same address with another size) is checked again."""
        rings = [t for pair in target.kv for t in pair]
        ring_spans = tuple((t.data_ptr(), t.nbytes) for t in rings)
        lat_spans = tuple((t.data_ptr(), t.nbytes) for t in target.latents)
        memo = self._ring
        if memo is None or memo.transfer is not transfer or memo.ring_spans != ring_spans:
            memo = _Declared(transfer, ring_spans, tuple(transfer.device_range(t) for t in rings),
                             np.array([p for p, _ in ring_spans], dtype=np.int64))
        if memo.lat_spans != lat_spans or memo.ranges is None:
            ranges = DeviceRanges.of(list(memo.ring_ranges) + [transfer.device_range(t) for t in target.latents]
                                     + self.values.device_ranges)
            memo = attrs.evolve(memo, lat_spans=lat_spans, ranges=ranges)
        self._ring = memo
        return memo

    # -- one latent, one layer, a probe ---------------------------------------------------------
    def get_latent(self, locator: str, like: Any, size: Optional[int]) -> Any:
        """``PlanTierStore.get_skeleton``."""
        size = nbytes(like) if like is not None else size
        size = self._latent_sizes.get(locator) if size is None else size
        if size is None:
            raise LayoutMismatchError(f"size of latent {locator} unknown: pass like= or nbytes=")
        with self.reading([locator], [1]) as read:
            table, n = read.transfer([size] if like is not None else None)
            if n == 0:
                return None
            (src,) = self._value_pointers(read, table, [size], raw=like is None)
            if like is None:
                return self._raw(src, size)
            out = like.new_empty(like.shape)
            self._copy_into([out], [src])
            return out

    def get_layer(self, handle: BlobHandle, layer: int, like: Optional[LayerPayload]) -> Optional[LayerPayload]:
        """``PlanTierStore.get_layer``."""
        size = handle.nbytes // (2 * handle.n_layers)
        sizes = [size, size] if like is None else [nbytes(t) for t in like]
        with self.reading(list(layer_keys(handle.locator, layer)), [2]) as read:
            table, n = read.transfer(sizes if like is not None else None)
            if n < 2:
                return None
            srcs = self._value_pointers(read, table, sizes, raw=like is None)
            if like is None:
                return self._raw(srcs[0], size), self._raw(srcs[1], size)
            k, v = (t.new_empty(t.shape) for t in like)
            self._copy_into([k, v], srcs)
            return k, v

    def _copy_into(self, outs: list, srcs: list[int]) -> None:
        """The values at ``srcs`` into the new tensors ``outs``: one batch, synchronized."""
        attached = self._link.attached_for(outs[0])
        transfer, values = attached.transfer, attached.values
        batch = CopyBatch.of([t.data_ptr() for t in outs], srcs, [nbytes(t) for t in outs], values.from_values)
        copy_now(transfer, batch, [transfer.device_range(t) for t in outs] + values.device_ranges,
                 producer=None, on=attached.read_stream)

    def _value_pointers(self, read: GetRead, table: int, sizes: Sequence[int], *, raw: bool) -> list[int]:
        """The value pointers of a transferred read of ``len(sizes)`` values, checked before any
        byte is read: a bad table is a `PlanError` naming the key. With ``raw`` (the caller reads
        ``sizes`` bytes itself, with no transfer runtime to check the addresses), each value must
        also hold exactly its size (when the client reports lengths) and lie whole inside a
        segment mapping of the client: else `CorruptValueError` naming the key."""
        keys = read.plan.keys[: len(sizes)]
        try:
            srcs = decode_plan_table(table, len(sizes), arena=self.calls.arena())
        except PlanTableError as exc:
            raise PlanError(f"read of {keys[0]!r}: {exc}") from exc
        if not raw:
            return srcs  # the transfer runtime checks every copy against the registered mappings
        lengths = list(self.calls.value_lengths(read.plan)) if self.calls.value_lengths is not None else None
        spans = self.values.spans
        for i, (key, src, size) in enumerate(zip(keys, srcs, sizes)):
            if lengths is not None and lengths[i] != size:
                raise CorruptValueError(key, f"holds {lengths[i]} B where {size} B were written")
            if not any(r.contains(src, size) for r in spans):
                raise CorruptValueError(
                    key, f"[{src:#x}, +{size}) does not lie inside a segment mapping of the Plan client")
        return srcs

    def _raw(self, src: int, size: int) -> Any:
        """The bytes of a value this store holds a view of, owned by the caller: ``bytes``, or for
        a value in a CUDA pool a pinned uint8 CPU tensor (`host_out.from_device`)."""
        if self.values.on_device:  # published values were synchronized before their commit
            return host_out.from_device(self.client.value_tensor(src, size))  # type: ignore[attr-defined]
        return ctypes.string_at(src, size)

    def contains(self, keys: Sequence[str]) -> list[bool]:
        """Which of ``keys`` are published, in order, copying no value: a get plan of one-key
        groups, transferred and released at once; its transferable prefix ends at the first
        missing key, and the probe resumes after it."""
        keys = list(keys)
        out = [False] * len(keys)
        i = 0
        while i < len(keys):
            rest = keys[i:]
            with self.reading(rest, [1] * len(rest)) as read:
                _, n = read.transfer()
            out[i : i + n] = [True] * n
            i += n + 1
        return out


def check_path(
    path: Sequence[ChunkNode], window: Sequence[ChunkNode], target: RestoreTarget
) -> Optional[tuple[list[str], list[BlobHandle]]]:
    """The path's latent keys and the window's blob handles; None on a miss (a node without
    latent or ready blob). Raises `LayoutMismatchError` when sizes, depths or runs disagree
    with the target."""
    n_layers, value_nbytes = target.n_layers, target.chunk_value_nbytes
    if n_layers == 0 or len(target.latents) != len(path):
        raise LayoutMismatchError(
            f"{len(target.latents)} latent targets and {n_layers} layers for a path of {len(path)}"
        )
    depths = [n.depth for n in window]
    if depths != list(target.window_depths):
        raise LayoutMismatchError(
            f"window depths {depths} differ from the target's {list(target.window_depths)}"
        )
    latent_keys = [n.skeleton.latent_locator for n in path if n.skeleton is not None]
    blobs = [n.blob for n in window if n.blob is not None and n.blob.ready]
    if len(latent_keys) != len(path) or len(blobs) != len(window):
        return None
    for blob in blobs:
        if blob.n_layers != n_layers or blob.nbytes != 2 * n_layers * value_nbytes:
            raise LayoutMismatchError(
                f"blob {blob.locator} holds {blob.n_layers} layers in {blob.nbytes} B; the "
                f"runtime expects {n_layers} layers of K and V of {value_nbytes} B each"
            )
    for run in target.runs:
        if run.chunk_depth not in depths or run.src_token + run.n_tokens > target.chunk_tokens:
            raise LayoutMismatchError(
                f"copy run {run} is outside the window or a {target.chunk_tokens}-token chunk"
            )
    return latent_keys, blobs


@functools.lru_cache(maxsize=64)
def runs_as_arrays(runs: tuple, window_depths: tuple, token_bytes: int) -> tuple:
    """A restore's runs as four read-only int64 arrays of length n_runs (window slot, source and
    destination byte offsets, bytes), cached per window shape: every restore of that shape shares them."""
    slot = {depth: j for j, depth in enumerate(window_depths)}
    tokens = np.array([(r.src_token, r.dst_token, r.n_tokens) for r in runs], dtype=np.int64).reshape(-1, 3)
    arrays = [np.array([slot[r.chunk_depth] for r in runs], dtype=np.int64)]
    arrays += [np.ascontiguousarray(tokens[:, i]) * token_bytes for i in range(3)]
    for a in arrays:
        a.flags.writeable = False  # shared by every restore of this shape
    return tuple(arrays)


def run_arrays(target: RestoreTarget) -> tuple:
    """``(window slot, source offset, ring offset, bytes)`` of each copy run of ``target``, int64
    ``[n_runs]`` each (cached: a runtime restores the same few shapes of window)."""
    return runs_as_arrays(tuple(target.runs), tuple(target.window_depths), int(target.token_bytes))
