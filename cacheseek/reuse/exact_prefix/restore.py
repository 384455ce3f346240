"""`Restorer`: restores the window path ending at one trie node into a `RestoreWindow`.

Lifetime of one restore: under one hold of the forest lock it checks the path is whole (every
window node has KV, every path node a latent) and references every path node (``ref_count``),
so eviction cannot take them; it fetches and copies outside the lock; only then does it publish
(``window.set_resume_depth``, the single publication point) and stamp ``last_access``; finally
(`release`, in a ``finally``) it drops the references, invalidates what it found gone and frees
the blobs whose invalidation waited for this, their last reader. A failure publishes nothing.
On a store shared with other processes, the path's chunk records are read again after the copies
and before publication (`SharedIndex.gone`): a chunk freed by another process meanwhile is a miss
(invalidated); a re-check that cannot be made (the records unreachable) is a miss that
invalidates nothing.

Two store paths, chosen by capability:

- generic `TierStore`: latents via ``get_skeleton``, then every window layer in one
  ``get_layers`` call (a store may overlap the reads); all of it is fetched before the first
  ``seed_layer`` call;
- a store that ``reads_paths`` (and a window that offers ``restore_target``): the store restores the whole
  window path into the runtime's buffers itself (``read_path``); when it returns False, the
  store's ``contains`` names what is gone.

A corrupt value is a missing value: the generic tiers read it as None, and a store that raises
`CorruptValueError` has the node owning that key invalidated the same way. So is a node the
window refuses before anything is fetched (its ``node_problem``: a key or a blob that does not
fit the runtime, as a crafted snapshot may name) and a chunk whose stored values do not fit the
ring (`LayoutMismatchError` with its ``depth``): the snapshot is data, not authority. Any other error
propagates (the lookup runs cold and leaves the trie as it was).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Optional

import attrs

from cacheseek.errors import CorruptValueError, HandleStateError, LayoutMismatchError
from cacheseek.kv.payload import RestoreTarget, layer_nbytes, payload_nbytes
from cacheseek.reuse.exact_prefix.invalidation import owner_of
from cacheseek.reuse.exact_prefix.types import NodeState, TrieNode

if TYPE_CHECKING:
    from cacheseek.reuse.exact_prefix.manager import WorldKVManager

log = logging.getLogger(__name__)

__all__ = ["NOT_WHOLE", "OK", "Outcome", "RestoreWindow", "Restorer", "as_window"]


class RestoreWindow:
    """What a restore seeds. ``blobs`` is ``[(chunk_depth, layer_payload), ...]`` oldest first
    (``(k, v)`` from the binding, any object a generic tier stored). ``depth`` in both calls is the
    trie depth of the deepest restored node, ``node.depth`` = K-1 for K restored chunks (as
    upstream CacheSeek passes it); the runtime resumes at chunk ``depth + 1``.

    Optional, with defaults: ``node_problem(node, in_window)`` (why a node cannot be restored into
    this runtime; None: it can), ``seed_latents(latents)``, ``bytes_restored`` (0: counted from
    what was fetched), ``published`` (None: the restore's outcome says). ``restores_paths``: it
    offers ``restore_target(depth, window_depths)``, where a store that ``reads_paths`` restores
    the whole path itself. A caller's own window is wrapped once per restore (`as_window`)."""

    restores_paths: ClassVar[bool] = False
    bytes_restored: int = 0
    published: Optional[bool] = None

    def seed_layer(self, layer: int, blobs: list[tuple[int, Any]], depth: int) -> None:
        raise NotImplementedError(f"{type(self).__name__}.seed_layer")

    def set_resume_depth(self, depth: int) -> None:
        raise NotImplementedError(f"{type(self).__name__}.set_resume_depth")

    def node_problem(self, node: TrieNode, in_window: bool) -> Optional[str]:
        return None

    def seed_latents(self, latents: Sequence[Any]) -> None:
        return None

    def restore_target(self, depth: int, window_depths: Sequence[int]) -> RestoreTarget:
        raise NotImplementedError(f"{type(self).__name__} has no restore target")


class _CallerWindow(RestoreWindow):
    """A caller's own window (``seed_layer`` and ``set_resume_depth``, docs/api.md) behind the
    contract: what else it has is resolved here, once."""

    def __init__(self, obj: Any) -> None:
        self.wrapped = obj
        self.seed_layer = obj.seed_layer  # type: ignore[method-assign]
        self.set_resume_depth = obj.set_resume_depth  # type: ignore[method-assign]
        for name in ("node_problem", "seed_latents", "restore_target"):
            if callable(getattr(obj, name, None)):
                setattr(self, name, getattr(obj, name))
        self.restores_paths = callable(getattr(obj, "restore_target", None))  # type: ignore[misc]

    @property
    def bytes_restored(self) -> int:  # type: ignore[override]
        return int(getattr(self.wrapped, "bytes_restored", 0) or 0)

    @property
    def published(self) -> Optional[bool]:  # type: ignore[override]
        return getattr(self.wrapped, "published", None)


def as_window(obj: Any) -> RestoreWindow:
    """``obj`` when it is a `RestoreWindow`, else the caller's own window behind the contract."""
    return obj if isinstance(obj, RestoreWindow) else _CallerWindow(obj)


@attrs.frozen(slots=True)
class Outcome:
    """One restore attempt: ``ok``; else ``missing`` (nodes whose values are gone, by depth;
    empty when the store cannot say) or ``not_whole`` (the trie changed under us: a path node
    lost its blob). A success names the ``tier`` that served it (the metrics' label)."""

    ok: bool
    missing: tuple[TrieNode, ...] = ()
    not_whole: bool = False
    tier: str = ""

    @property
    def retryable(self) -> bool:
        """A shorter prefix may still be whole: values were found gone, or the path changed."""
        return bool(self.missing) or self.not_whole

    def retry_limit(self, matched_len: int) -> int:
        """How many chunks to look up next after a failed restore of ``matched_len`` chunks: the
        longest prefix that ends before the first broken node (a node at depth d breaks every
        prefix longer than d chunks), and always shorter than this one."""
        broken = [n.depth for n in self.missing] or [matched_len - 1]
        return min(min(broken), matched_len - 1)


OK = Outcome(True)
NOT_WHOLE = Outcome(False, not_whole=True)


class Restorer:
    """Restores paths (see the module docstring); the manager's invalidator drops what a restore
    finds gone, its shared index re-checks the chunk records."""

    def __init__(self, ctx: "WorldKVManager") -> None:
        self.ctx = ctx

    def window_path(self, node: TrieNode) -> list[TrieNode]:
        """The nodes of ``node``'s path whose KV a restore reads: the config's window depths."""
        path = node.path()
        depths = set(self.ctx.cfg.window_depths(len(path)))
        return [n for n in path if n.depth in depths]

    def restore(self, node: TrieNode, window: RestoreWindow, *, chunk_only: bool = False) -> Outcome:
        """Restore the window path ending at ``node`` into ``window``; with ``chunk_only``, the
        node alone (its latent and KV: a live session's next chunk, whose ring already holds
        the rest). Raises on store errors other than missing or corrupt values."""
        ctx = self.ctx
        window = as_window(window)
        path = [node] if chunk_only else node.path()
        win = [node] if chunk_only else self.window_path(node)
        in_win = {id(n) for n in win}
        with ctx.forest.lock:
            if not all(n.has_kv for n in win) or not all(n.skeleton is not None for n in path):
                return NOT_WHOLE
            bad = [(n, why) for n in path if (why := window.node_problem(n, id(n) in in_win))]
            for n in path:
                n.ref_count += 1
        missing: tuple[TrieNode, ...] = ()
        try:
            if bad:  # the snapshot named a node this runtime cannot restore: dropped, never met again
                for n, why in bad:
                    log.warning("restore of depth %d: %r cannot be restored (%s); invalidating it",
                                len(path), n, why)
                missing = tuple(n for n, _ in bad)
                return Outcome(False, missing)
            t0 = time.perf_counter()
            tier = ctx.store.label
            try:
                if ctx.store.reads_paths and window.restores_paths:
                    target = window.restore_target(len(path), [n.depth for n in win])
                    if not ctx.store.read_path(path, win, target):
                        missing = self.ctx.invalidator.find_missing(path, win, None)
                        return Outcome(False, missing)
                    tier = ctx.store.served_tier() or tier
                    nbytes = window.bytes_restored
                else:
                    fetched = self._fetch_generic(path, win, window)
                    if isinstance(fetched, Outcome):
                        missing = fetched.missing
                        return fetched
                    nbytes = window.bytes_restored or fetched
            except LayoutMismatchError as exc:
                if exc.depth is None:
                    raise
                log.warning("restore of depth %d: %s; invalidating that chunk", len(path), exc)
                missing = tuple(n for n in win if n.depth == exc.depth)
                return Outcome(False, missing)
            except CorruptValueError as exc:
                # A store that raises on a corrupt value instead of reading it as missing: the same miss.
                log.warning("restore of depth %d met %s", len(path), exc)
                missing = self.ctx.invalidator.find_missing(path, win, owner_of(exc.key, path, win))
                return Outcome(False, missing)
            lost = self.ctx.index.gone(path)
            if lost is None:  # the records could not be re-read: not trusted, nothing known gone
                log.info("restore of depth %d: the chunk records could not be re-checked; a miss", len(path))
                return Outcome(False)
            if lost:  # another process freed a chunk while this one read it: what was read is not trusted
                log.info("restore of depth %d: %d chunks were freed by another process while read; a miss",
                         len(path), len(lost))
                missing = lost
                return Outcome(False, missing)
            window.set_resume_depth(node.depth)
            now = ctx.clock()
            with ctx.forest.lock:
                for n in path:
                    n.last_access = now
            ctx.metrics.record_transfer("restore", tier, nbytes, time.perf_counter() - t0)
            return Outcome(True, tier=tier)
        finally:
            self.release(path, missing)

    def release(self, path: Sequence[TrieNode], missing: Sequence[TrieNode]) -> None:
        """Drop a restore's references; invalidate what it found gone, then free the blobs whose
        invalidation waited for their last reader (this one). A reference that was never taken
        raises `HandleStateError` and changes nothing."""
        settle: list[TrieNode] = []
        with self.ctx.forest.lock:
            for n in path:
                if n.ref_count <= 0:
                    raise HandleStateError(f"ref_count of {n!r} would go below zero")
            for n in path:
                n.ref_count -= 1
                if n.ref_count == 0 and n.state is NodeState.INVALID:
                    settle.append(n)
        if missing:
            self.ctx.invalidator.invalidate(missing)
        for n in settle:
            self.ctx.invalidator.free_invalidated(n)

    def _fetch_generic(self, path: list[TrieNode], win: list[TrieNode], window: RestoreWindow) -> "int | Outcome":
        """Fetch every latent and window layer, then seed; bytes fetched, or a miss `Outcome`."""
        store = self.ctx.store
        latents = []
        nbytes = 0
        for n in path:
            latent = store.get_skeleton(n.skeleton.latent_locator)
            if latent is None:
                log.info("latent of depth %d missing", n.depth)
                return Outcome(False, self.ctx.invalidator.find_missing(path, win, n))
            latents.append(latent)
            nbytes += payload_nbytes(latent)
        n_layers = {n.blob.n_layers for n in win}
        if len(n_layers) != 1:
            return Outcome(False)
        reads = [(n, layer) for layer in range(n_layers.pop()) for n in win]
        values = store.get_layers([(n.blob, layer) for n, layer in reads])  # none read after a miss
        per_layer: list[list[tuple[int, Any]]] = []
        for (n, layer), kv in zip(reads, values):
            if kv is None or (n.blob.pairs and (kv[0] is None or kv[1] is None)):
                log.info("layer %d of depth %d missing", layer, n.depth)
                return Outcome(False, self.ctx.invalidator.find_missing(path, win, n))
            if layer == len(per_layer):
                per_layer.append([])
            per_layer[layer].append((n.depth, kv))
            nbytes += layer_nbytes(kv)
        window.seed_latents(latents)
        for layer, blobs in enumerate(per_layer):
            window.seed_layer(layer, blobs, path[-1].depth)
        return nbytes
