"""`PlanTierStore` (store ``fluxon_plan``): KV and latents moved straight between the runtime's
tensors and a Plan store's registered host segments, in batches, with no CPU staging.

It is a `TierStore` and a `PathReadStore` (``accepts_device_views``): the manager hands it
detached views of the ring tail on write and a `RestoreTarget` on read (DESIGN.md section 2).

Construction (warm-up): the Plan client's segments are made ready (an embedded client maps and
pre-faults its segment here) and registered with the transfer runtime once, so the first write
pays neither. Without a ``transfer`` object or a ``device``, the runtime is chosen from the
device of the first tensors seen and the segments are registered then.

Write of one chunk (`put_async`, synchronous for now; ``stream`` is threaded through so it can
move to a side stream)::

    keys {locator}:L{i}:k / :v, grouped by byte size (one value size per Plan)
    start every Plan -> decode every table -> one D2H batch (validated whole, one synchronize)
    -> commit every Plan -> check every status and key code -> handle.ready -> on_ready(handle)
    failure before commit: abort every live uncommitted Plan (the batch contract guarantees no
    copy is in flight); failure at or after commit: wait for the submitted commits, then remove
    every key of them, so nothing of the blob stays in the store. Then handle.error is set and a
    `StoreError` is raised.

Read of depth K (`read_path`): latents first (one GET of every ``{hex}:lat`` of the path, all or
nothing, one H2D batch into ``target.latents``); then the window's KV as one chunk-major request
with ``atomic_group_lens = [2 * n_layers] * len(window)``; a partial transferable prefix is a miss
(its views are released, nothing is copied into the ring); then every copy run of every layer,
K and V, in one H2D batch; synchronize; release the views. Every get handle is ended on every
path (transferred -> release_views, else cancel_get_transfer).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Dict, Optional

import attrs

from cacheseek.errors import (
    LayoutMismatchError,
    PlanError,
    StoreClosedError,
    StoreError,
    StoreTimeoutError,
)
from cacheseek.plan.base import GetPlan, PlanClient, PutCommitResult, PutPlan
from cacheseek.plan.table import decode_plan_table
from cacheseek.registry import PLAN_CLIENTS, STORES, TRANSFERS
from cacheseek.reuse.exact_prefix.keys import layer_keys
from cacheseek.reuse.exact_prefix.types import BlobHandle, Tier, TrieNode
from cacheseek.stores.base import LayerPayload, RestoreTarget
from cacheseek.transfer.base import (
    CopyDescriptor,
    Direction,
    HostMapping,
    MemoryRange,
    TransferRuntime,
    add_note,
)

__all__ = ["PlanTierStore", "PlanTierSchema", "PlanTierStats"]

log = logging.getLogger(__name__)

@dataclasses.dataclass
class PlanTierSchema:
    _target_: str = "cacheseek.stores.plan_tier.PlanTierStore"
    client: str = "embedded"
    segment_bytes: int = 1 << 30
    prefault_threads: int = 4
    backing: str = "shared"
    shm_dir: Optional[str] = None
    transfer_kind: str = "auto"
    device: Optional[str] = None
    commit_timeout_s: float = 30.0
    client_options: Dict[str, Any] = dataclasses.field(default_factory=dict)


@attrs.frozen(slots=True)
class PlanTierStats:
    """A snapshot of the Plan tier's counters (bytes and seconds are whole calls, wall clock)."""

    put_bytes: int = 0
    put_seconds: float = 0.0
    puts: int = 0
    put_failures: int = 0
    get_bytes: int = 0
    get_seconds: float = 0.0
    reads: int = 0
    read_hits: int = 0
    read_misses: int = 0
    plans_started: int = 0
    plans_committed: int = 0
    plans_aborted: int = 0
    gets_started: int = 0
    gets_transferred: int = 0
    gets_cancelled: int = 0
    values_removed: int = 0
    used_bytes: Optional[int] = None
    capacity_bytes: Optional[int] = None
    n_values: Optional[int] = None
    segment_ready_seconds: float = 0.0
    fault_seconds: float = 0.0
    register_seconds: float = 0.0
    transfer: Dict[str, Any] = attrs.field(factory=dict)

    def as_dict(self) -> dict[str, Any]:
        out = attrs.asdict(self)
        out.update({f"transfer_{k}": v for k, v in out.pop("transfer").items()})
        return out


def _nbytes(tensor: Any) -> int:
    return int(tensor.numel()) * int(tensor.element_size())


@STORES.register("fluxon_plan", PlanTierSchema)
class PlanTierStore:
    """KV tier over a Plan client and a transfer runtime (see the module docstring).

    ``client``: a `PLAN_CLIENTS` name, built with ``segment_bytes``, ``prefault_threads``,
    ``backing``, ``shm_dir`` (where its schema has them) and ``client_options``; or pass a built
    client as ``plan_client`` (the caller then keeps owning it). ``transfer``: a built
    `TransferRuntime` (the caller keeps owning it); else ``transfer_kind`` from `TRANSFERS` is
    built for ``device`` now, or for the device of the first tensors seen.
    """

    accepts_device_views = True

    def __init__(
        self,
        client: str = "embedded",
        segment_bytes: int = 1 << 30,
        prefault_threads: int = 4,
        backing: str = "shared",
        shm_dir: Optional[str] = None,
        transfer_kind: str = "auto",
        device: Optional[str] = None,
        commit_timeout_s: float = 30.0,
        client_options: Optional[dict[str, Any]] = None,
        *,
        transfer: Optional[TransferRuntime] = None,
        plan_client: Optional[PlanClient] = None,
    ) -> None:
        self.commit_timeout_s = commit_timeout_s
        self.transfer_kind = transfer_kind
        self._lock = threading.Lock()
        self._setup_lock = threading.Lock()
        self._counters: dict[str, Any] = {}
        self._latent_nbytes: dict[str, int] = {}
        self._closed = False
        if plan_client is None:
            factory = PLAN_CLIENTS.get(client)
            try:
                accepted = {f.name for f in dataclasses.fields(PLAN_CLIENTS.schema(client))}
            except KeyError:
                accepted = set()
            given = dict(
                segment_bytes=segment_bytes,
                prefault_threads=prefault_threads,
                backing=backing,
                shm_dir=shm_dir,
            )
            kwargs = {k: v for k, v in given.items() if k in accepted}
            kwargs.update(client_options or {})
            plan_client = factory(**kwargs)
            self._owns_client = True
        else:
            self._owns_client = False
        self._client: PlanClient = plan_client
        self._transfer: Optional[TransferRuntime] = transfer
        self._owns_transfer = False
        self._mappings: list[HostMapping] = []
        try:
            t0 = time.perf_counter()
            segments = self._client.wait_local_segments_ready()
            self._count(segment_ready_seconds=time.perf_counter() - t0)
            self._mappings = [HostMapping(s.ptr, s.length, s.generation, s.writable) for s in segments]
            if transfer is None and device is not None:
                self._transfer = self._build_transfer(device)
            if self._transfer is not None:
                self._register()
        except BaseException:
            if self._owns_transfer and self._transfer is not None:
                self._transfer.close()
            if self._owns_client:
                self._client.close()
            raise

    # -- setup ----------------------------------------------------------------------------------
    def _build_transfer(self, device: Any) -> TransferRuntime:
        factory = TRANSFERS.get(self.transfer_kind)
        runtime = factory(device=device) if self.transfer_kind == "auto" else factory()
        self._owns_transfer = True
        return runtime

    def _register(self) -> None:
        transfer = self._transfer
        if transfer is None:
            return
        t0 = time.perf_counter()
        transfer.register(self._mappings)
        self._count(register_seconds=time.perf_counter() - t0)

    def _transfer_for(self, tensor: Any) -> TransferRuntime:
        if self._transfer is not None:
            return self._transfer
        with self._setup_lock:
            if self._transfer is None:
                device = getattr(tensor, "device", "cpu")
                log.info(
                    "Plan tier: transfer runtime chosen from the first tensors (%s); segments are "
                    "registered now. Pass device= (or transfer=) to do this at construction.", device,
                )
                transfer = self._build_transfer(device)
                self._transfer = transfer
                self._register()
            return self._transfer

    @property
    def transfer(self) -> Optional[TransferRuntime]:
        return self._transfer

    @property
    def plan_client(self) -> PlanClient:
        return self._client

    def _info(self, call: str) -> Any:
        """The client's `PlanClientInfo` call ``call``, or None when it does not offer it (checked
        by attribute, so proxies that delegate through ``__getattr__`` keep the capability)."""
        fn = getattr(self._client, call, None)
        return fn if callable(fn) else None

    def _arena(self) -> Optional[tuple[int, int]]:
        table_arena = self._info("table_arena")
        return table_arena() if table_arena is not None else None

    # -- counters -------------------------------------------------------------------------------
    def _count(self, **deltas: Any) -> None:
        with self._lock:
            for k, v in deltas.items():
                self._counters[k] = self._counters.get(k, 0) + v

    @property
    def stats(self) -> PlanTierStats:
        with self._lock:
            counters = dict(self._counters)
        usage_fn, timers_fn = self._info("usage"), self._info("segment_timers")
        usage = usage_fn() if usage_fn is not None and not self._closed else None
        timers = timers_fn() if timers_fn is not None else None
        return PlanTierStats(
            **counters,
            used_bytes=usage.used_bytes if usage else None,
            capacity_bytes=usage.capacity_bytes if usage else None,
            n_values=usage.n_values if usage else None,
            fault_seconds=timers.fault_seconds if timers else 0.0,
            transfer=self._transfer.stats.as_dict() if self._transfer is not None else {},
        )

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("Plan tier store used after close()")

    # -- write ----------------------------------------------------------------------------------
    def put_async(
        self,
        locator: str,
        payload: Sequence[LayerPayload],
        *,
        tier: Tier,
        on_ready: Optional[Callable[[BlobHandle], None]] = None,
        stream: Any = None,
    ) -> BlobHandle:
        """Write one chunk's KV (per layer ``(k, v)`` views ``[1, chunk_tokens, H, D]``,
        contiguous, on the runtime device) under ``{locator}:L{i}:k/v``. Returns the handle,
        ready and already passed to ``on_ready``; raises a `StoreError` (handle.error set)."""
        self._check_open()
        layers = list(payload)
        handle = BlobHandle(tier, locator, 0, len(layers))
        t0 = time.perf_counter()
        try:
            items = []
            for i, (k, v) in enumerate(layers):
                k_key, v_key = layer_keys(locator, i)
                items += [(k_key, k), (v_key, v)]
            if not items:
                raise PlanError(f"put of {locator}: empty payload")
            handle.nbytes = sum(_nbytes(t) for _, t in items)
            self._put_values(items, stream=stream)
        except Exception as exc:
            self._count(put_failures=1)
            handle.error = _as_store_error(exc, f"put of {locator}")
            if handle.error is exc:
                raise
            raise handle.error from exc
        self._count(puts=1, put_bytes=handle.nbytes, put_seconds=time.perf_counter() - t0)
        handle.ready = True
        if on_ready is not None:
            on_ready(handle)
        return handle

    def put_skeleton(self, locator: str, latent: Any, *, stream: Any = None) -> None:
        """Write one latent (a contiguous tensor on the runtime device) as the value ``locator``
        (``{hex}:lat``). Raises a `StoreError`."""
        self._check_open()
        try:
            self._put_values([(locator, latent)], stream=stream)
        except Exception as exc:
            error = _as_store_error(exc, f"put of skeleton {locator}")
            if error is exc:
                raise
            raise error from exc
        self._latent_nbytes[locator] = _nbytes(latent)

    def _put_values(self, items: list[tuple[str, Any]], *, stream: Any) -> None:
        transfer = self._transfer_for(items[0][1])
        groups: dict[int, list[tuple[str, MemoryRange]]] = {}
        for key, tensor in items:
            rng = transfer.device_range(tensor)
            groups.setdefault(rng.length, []).append((key, rng))
        started: list[PutPlan] = []
        submitted: list[PutPlan] = []
        futures: dict[PutPlan, Future] = {}
        try:
            descriptors: list[CopyDescriptor] = []
            for nbytes, members in groups.items():
                plan, table = self._client.local_fast_put_start([k for k, _ in members], nbytes)
                started.append(plan)
                self._count(plans_started=1)
                dsts = decode_plan_table(table, len(members), arena=self._arena())
                descriptors += [
                    CopyDescriptor(dst, rng.ptr, nbytes, Direction.D2H)
                    for dst, (_, rng) in zip(dsts, members)
                ]
            ranges = [rng for members in groups.values() for _, rng in members]
            transfer.copy_batch(descriptors, stream=stream, device_ranges=ranges)
            while started:
                plan = started.pop(0)
                submitted.append(plan)
                futures[plan] = self._client.local_fast_put_commit(plan)
            failures = []
            for plan in submitted:
                result = self._commit_result(plan, futures[plan])
                if not result.ok:
                    bad = [f"{k}={c}" for k, c in zip(plan.keys, result.key_codes) if c]
                    failures.append(
                        f"commit of {len(plan.keys)} values of {plan.value_len} B: status "
                        f"{result.status}{', key codes ' + ', '.join(bad) if bad else ''}"
                        f"{' (' + result.message + ')' if result.message else ''}"
                    )
            if failures:
                raise PlanError("; ".join(failures))
            self._count(plans_committed=len(submitted))
        except BaseException as exc:
            self._undo_put(exc, started, submitted, futures)
            raise

    def _commit_result(self, plan: PutPlan, future: Future) -> PutCommitResult:
        try:
            return future.result(timeout=self.commit_timeout_s)
        except FutureTimeout as exc:
            raise StoreTimeoutError(
                f"commit of {len(plan.keys)} values not done after {self.commit_timeout_s} s"
            ) from exc

    def _undo_put(
        self,
        exc: BaseException,
        started: list[PutPlan],
        submitted: list[PutPlan],
        futures: dict[PutPlan, Future],
    ) -> None:
        """Abort every uncommitted plan; remove every key of a submitted one (after its commit
        settled; a commit call that raised counts as submitted), so that a failed write leaves
        nothing behind."""
        for plan in started:
            try:
                self._client.put_abort(plan)
                self._count(plans_aborted=1)
            except Exception as abort_error:
                add_note(exc, f"put_abort failed too: {abort_error!r}")
        for plan in submitted:
            future = futures.get(plan)
            if future is not None:
                try:
                    future.result(timeout=self.commit_timeout_s)
                except Exception:
                    pass  # its keys are removed below whatever the commit's outcome
            for key in plan.keys:
                try:
                    self._client.remove(key)
                    self._count(values_removed=1)
                except Exception as remove_error:
                    add_note(exc, f"remove({key!r}) after a failed commit failed too: {remove_error!r}")

    # -- read -----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _reading(self, keys: list[str], group_lens: list[int]) -> Iterator["_Read"]:
        read = _Read(self, self._client.get_start(keys, group_lens))
        self._count(gets_started=1)
        try:
            yield read
        except BaseException as exc:
            try:
                read.end()
            except Exception as end_error:
                add_note(exc, f"ending the get plan failed too: {end_error!r}")
            raise
        read.end()

    def read_path(
        self, path: Sequence[TrieNode], window: Sequence[TrieNode], target: RestoreTarget
    ) -> bool:
        """See `PathReadStore.read_path`. Raises `LayoutMismatchError` when the blob handles or
        the runs disagree with ``target``; `TransferError`, `PlanTableError`, `PlanError` on
        failures. Fills ``target.latents`` and ``target.kv``; publishes nothing."""
        self._check_open()
        path, window = list(path), list(window)
        t0 = time.perf_counter()
        self._count(reads=1)
        found = self._check_path(path, window, target)
        if found is None:
            self._count(read_misses=1)
            return False
        latent_keys, blobs = found
        transfer = self._transfer_for(target.kv[0][0])
        moved = self._read_latents(latent_keys, target, transfer)
        if moved is not None:
            kv = self._read_window(blobs, target, transfer)
            moved = None if kv is None else moved + kv
        if moved is None:
            self._count(read_misses=1)
            return False
        self._count(read_hits=1, get_bytes=moved, get_seconds=time.perf_counter() - t0)
        return True

    def _check_path(
        self, path: list[TrieNode], window: list[TrieNode], target: RestoreTarget
    ) -> Optional[tuple[list[str], list[BlobHandle]]]:
        """The path's latent keys and the window's blob handles; None on a miss (a node without
        skeleton or ready blob). Raises `LayoutMismatchError` when sizes, depths or runs disagree
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

    def _read_latents(
        self, keys: list[str], target: RestoreTarget, transfer: TransferRuntime
    ) -> Optional[int]:
        """Fill ``target.latents`` from ``keys`` (all or nothing); bytes moved, None on a miss."""
        with self._reading(keys, [len(keys)]) as read:
            table, n = read.transfer()
            if n < len(keys):
                return None
            srcs = decode_plan_table(table, n, arena=self._arena())
            descs = [
                CopyDescriptor(lat.data_ptr(), src, _nbytes(lat), Direction.H2D)
                for lat, src in zip(target.latents, srcs)
            ]
            transfer.copy_batch(descs, device_ranges=[transfer.device_range(t) for t in target.latents])
        return sum(d.nbytes for d in descs)

    def _read_window(
        self, blobs: list[BlobHandle], target: RestoreTarget, transfer: TransferRuntime
    ) -> Optional[int]:
        """Copy the runs of the window's KV into the ring; bytes moved, None on a miss (a partial
        transferable prefix: its views are released with nothing copied)."""
        n_layers, tb = target.n_layers, target.token_bytes
        keys = [k for blob in blobs for i in range(n_layers) for k in layer_keys(blob.locator, i)]
        with self._reading(keys, [2 * n_layers] * len(blobs)) as read:
            table, n = read.transfer()
            if n < len(keys):
                return None
            values = decode_plan_table(table, n, arena=self._arena())
            slot = {depth: j for j, depth in enumerate(target.window_depths)}
            descs = []
            for run in target.runs:  # chunk-major, then layer, then K before V
                base = slot[run.chunk_depth] * 2 * n_layers
                for layer, pair in enumerate(target.kv):
                    for half, ring in enumerate(pair):
                        src = values[base + 2 * layer + half] + run.src_token * tb
                        dst = ring.data_ptr() + run.dst_token * tb
                        descs.append(CopyDescriptor(dst, src, run.n_tokens * tb, Direction.H2D))
            rings = [transfer.device_range(t) for pair in target.kv for t in pair]
            transfer.copy_batch(descs, device_ranges=rings)
        return sum(d.nbytes for d in descs)

    def get_skeleton(self, locator: str, like: Any = None, *, nbytes: Optional[int] = None) -> Any:
        """The latent stored under ``locator``, or None when absent. With ``like`` (a tensor on the
        runtime device), a new tensor of its shape and dtype filled with the value; without, the
        raw bytes (size from ``nbytes`` or from this store's own `put_skeleton`). Restores read
        latents through `read_path`."""
        self._check_open()
        size = _nbytes(like) if like is not None else nbytes
        size = self._latent_nbytes.get(locator) if size is None else size
        if size is None:
            raise LayoutMismatchError(f"size of latent {locator} unknown: pass like= or nbytes=")
        with self._reading([locator], [1]) as read:
            table, n = read.transfer()
            if n == 0:
                return None
            (src,) = decode_plan_table(table, 1, arena=self._arena())
            if like is None:
                return ctypes.string_at(src, size)
            out = like.new_empty(like.shape)
            transfer = self._transfer_for(out)
            transfer.copy_batch(
                [CopyDescriptor(out.data_ptr(), src, size, Direction.H2D)],
                device_ranges=[transfer.device_range(out)],
            )
            return out

    def get_layer(
        self, handle: BlobHandle, layer: int, *, like: Optional[LayerPayload] = None
    ) -> Optional[LayerPayload]:
        """One layer's ``(k, v)``, or None when either is missing. With ``like`` (a ``(k, v)``
        pair of tensors on the runtime device) new tensors of their shapes and dtypes; without,
        raw bytes of ``handle.nbytes / (2 * n_layers)`` each (K and V of one size). The manager
        restores through `read_path`; this is the generic per-layer read."""
        self._check_open()
        with self._reading(list(layer_keys(handle.locator, layer)), [2]) as read:
            table, n = read.transfer()
            if n < 2:
                return None
            srcs = decode_plan_table(table, 2, arena=self._arena())
            if like is None:
                size = handle.nbytes // (2 * handle.n_layers)
                return ctypes.string_at(srcs[0], size), ctypes.string_at(srcs[1], size)
            k, v = (t.new_empty(t.shape) for t in like)
            transfer = self._transfer_for(k)
            transfer.copy_batch(
                [CopyDescriptor(t.data_ptr(), src, _nbytes(t), Direction.H2D) for t, src in zip((k, v), srcs)],
                device_ranges=[transfer.device_range(k), transfer.device_range(v)],
            )
            return k, v

    # -- reclamation / lifetime -----------------------------------------------------------------
    def free(self, handle: BlobHandle) -> None:
        """Remove every K/V value of the blob (idempotent); the skeleton stays. Raises
        `PlanError` if any removal fails (the caller keeps the blob)."""
        self._check_open()
        errors: list[tuple[str, BaseException]] = []
        for layer in range(handle.n_layers):
            for key in layer_keys(handle.locator, layer):
                try:
                    self._client.remove(key)
                    self._count(values_removed=1)
                except Exception as exc:
                    errors.append((key, exc))
        if errors:
            key, first = errors[0]
            raise PlanError(
                f"free of {handle.locator}: {len(errors)} removals failed, first {key}: {first}"
            ) from first

    def flush(self) -> None:
        """Nothing is buffered: every write is committed before `put_async` returns."""

    def close(self) -> None:
        """Unregister the segments, close what this store built. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._transfer is not None:
                self._transfer.unregister(self._mappings)
                if self._owns_transfer:
                    self._transfer.close()
        finally:
            if self._owns_client:
                self._client.close()

    def __repr__(self) -> str:
        return f"PlanTierStore(client={type(self._client).__name__}, transfer={self._transfer!r})"


class _Read:
    """One get plan of a read: ``transfer()`` once, then ``end()`` releases or cancels it."""

    def __init__(self, store: PlanTierStore, plan: GetPlan) -> None:
        self._store = store
        self.plan = plan
        self.transferred = False
        self.ended = False

    def transfer(self) -> tuple[int, int]:
        table, n = self._store._client.get_transfer(self.plan)
        self.transferred = True
        self._store._count(gets_transferred=1)
        return table, n

    def end(self) -> None:
        if self.ended:
            return
        self.ended = True
        if self.transferred:
            self._store._client.release_views(self.plan)
        else:
            self._store._client.cancel_get_transfer(self.plan)
            self._store._count(gets_cancelled=1)


def _as_store_error(exc: Exception, what: str) -> Exception:
    """``exc`` when it already is a `StoreError`; else a `PlanError` naming the cause (a transfer,
    table or layout error, or a payload that is not a tensor pair)."""
    if isinstance(exc, StoreError):
        return exc
    return PlanError(f"{what} failed: {type(exc).__name__}: {exc}")
