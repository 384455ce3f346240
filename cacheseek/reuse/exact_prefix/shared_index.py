"""`SharedIndex`: the store's chunk records as the truth, this process's trie as a cache of them.

A service runs one worker per GPU, on several hosts, and restarts them; each worker has its own
trie. A chunk's key is a pure function of its session (the namespace root, then one key per
action), so where the local trie ends (or is empty: a new or restarted worker) the lookup asks
the store for the session's next node keys, batched: one key first (a cold session computes one
action key ahead of its first chunk, not a window of them), then windows of ``window`` keys per
probe, each probe bounded by the store's own operation timeout. Every record found in order is *adopted*: its
node is committed to the local trie with a ready handle built from the record (the record's
geometry and checksums; a read checks each value against them), and the lookup goes on from there.
A live session streamed one action per chunk asks for one key per chunk (`child`).

Publication (`publish`) is the writer's last step: the store's completion callback has reported
every value of the chunk committed; only then is the record written (`cacheseek.kv.records`: the
first writer wins, a second is a no-op). A chunk whose record could not be written stays this
process's alone.

A read that raced a deletion: a store that deletes a chunk retracts its record first, then its
values. A restore that found its records before it read, and finds them still there after
(`gone`), read values that were not deleted under it; one whose record went meanwhile is a
miss (``index_recheck_misses``), never a restore of values another process freed. One whose
re-check could not be made (the records' medium unreachable: a stopped etcd) is a miss too, but
nothing is invalidated: the values are not known gone, and freeing them would empty the cache for
every process while the medium is down.

Chunks in flight (`cacheseek.kv.claims`): workers started at once reach the same uncached chunks
together. A live session about to compute a chunk no record names claims it (`claim_or_wait`);
one that finds another live process's claim waits, at most ``wait_s``, for that chunk's record
and adopts it instead of computing it too, so N concurrent workers compute each chunk about once,
as one process would. The claim goes when the record is published (`publish`) or when the
session ends without it (`release_claims`); a dead or slow holder's claim is stale and ignored.

Adoption checks the record against the path walked: its parent's key, its depth and its
namespace must be the ones the lookup expects (the node key already binds all three; a record that
disagrees is not trusted), and its storage format this store's (two kinds of store on one medium,
such as the Plan tier and the per-layer tier on one Fluxon cluster, lay values out otherwise). A node this process is writing, freeing or has invalidated is not
replaced by a record.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Optional

from cacheseek.kv.handles import BlobHandle, Skeleton
from cacheseek.kv.locators import kv_locator, latent_locator
from cacheseek.kv.records import ChunkRecord
from cacheseek.reuse.exact_prefix.config import SharedIndexConfig
from cacheseek.reuse.exact_prefix.keys import node_key
from cacheseek.reuse.exact_prefix.trie import Namespace, PrefixMatch
from cacheseek.reuse.exact_prefix.types import ActionKey, TrieNode

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from cacheseek.reuse.exact_prefix.manager import WorldKVManager

__all__ = ["SharedIndex"]


def _action_bytes(action: ActionKey) -> Optional[bytes]:
    """The bytes a node key hashes for ``action``: the binding's actions are digests
    (``node key = H(parent, action)``); an int or str action's key is its caller's to derive,
    so the index cannot name it (None)."""
    return action if isinstance(action, bytes) else None


class SharedIndex:
    """Finds chunks past the local trie in the store's records and publishes this process's."""

    def __init__(self, ctx: "WorldKVManager", cfg: SharedIndexConfig) -> None:
        self.ctx = ctx
        self.cfg = cfg
        self._format = ctx.store.storage_format  # what records name, and must name
        self._claims: dict[bytes, int] = {}  # node key -> id of the owner (a session) holding its claim
        self._claims_lock = threading.Lock()

    @property
    def active(self) -> bool:
        """Whether lookups ask the store: the index is on and the store's records are shared."""
        return self.cfg.enabled and self.ctx.store.records.shared

    # -- lookup ---------------------------------------------------------------------------------

    def extend(self, match: PrefixMatch, actions: Sequence[ActionKey], limit: int) -> PrefixMatch:
        """``match`` (the local trie's longest ready prefix of ``actions``) continued through the
        store's records, at most ``limit`` chunks deep: a probe of one key, then of ``window``
        keys, until one is not found whole."""
        ns, node, matched = match.namespace, match.node, match.matched_len
        if ns is None or node is None or not self.active:
            return match
        step = 1  # the first probe asks for one key: a miss computes one action key, not a window's
        while matched < limit:
            want = min(step, limit - matched)
            step = self.cfg.window
            chain: list[tuple[ActionKey, bytes]] = []
            parent_key = node.node_key
            for i in range(matched, matched + want):
                try:
                    action = actions[i]  # a lazy key is computed here
                except (IndexError, ValueError, LookupError):  # a control without a key ends the walk
                    break
                raw = _action_bytes(action)
                if raw is None:
                    break
                parent_key = node_key(parent_key, raw)
                chain.append((action, parent_key))
            if not chain:
                break
            records = self._find([key for _, key in chain])
            for (action, _), record in zip(chain, records):
                child = self.adopt(ns, node, action, record) if record is not None else None
                if child is None:
                    return PrefixMatch(ns, node, matched)
                node, matched = child, matched + 1
            if len(chain) < want:
                break
        return PrefixMatch(ns, node, matched)

    def child(self, ns: Namespace, parent: TrieNode, action: ActionKey) -> Optional[TrieNode]:
        """The ready child of ``parent`` for ``action``: the local trie's, else one adopted from
        the store's record of it (one key probed), else None."""
        with self.ctx.forest.lock:
            child = parent.children.get(action)
            if child is not None and child.has_kv:
                return child
        raw = _action_bytes(action)
        if not self.active or raw is None:
            return None
        key = node_key(parent.node_key, raw)
        (record,) = self._find([key])
        return self.adopt(ns, parent, action, record) if record is not None else None

    def keys_as(self, parent: TrieNode, action: ActionKey, key: bytes) -> bool:
        """Whether ``key`` is ``parent``'s child key for ``action`` as the index derives it (a
        caller that derives node keys its own way writes chunks the index cannot name)."""
        raw = _action_bytes(action)
        return raw is not None and node_key(parent.node_key, raw) == key

    def claim_or_wait(self, ns: Namespace, parent: TrieNode, action: ActionKey, owner: object) -> Optional[TrieNode]:
        """A live session (``owner``) is about to compute ``parent``'s child for ``action``,
        which no record names: claim the chunk's write and return None (compute it), or, while
        another live process holds its claim, wait at most ``wait_s`` for its record and return
        the chunk adopted from it. None also when waiting gave up (compute it, unclaimed)."""
        raw = _action_bytes(action)
        if not self.active or raw is None or self.cfg.wait_s <= 0:
            return None
        records, metrics = self.ctx.store.records, self.ctx.metrics
        key = node_key(parent.node_key, raw)
        t0 = time.monotonic()
        deadline, pause, waited = t0 + self.cfg.wait_s, 0.001, False
        try:
            holder = records.claim(key)
            while holder is not None:
                if holder.stale(self.cfg.wait_s):
                    records.drop_claim(key)  # a dead or expired holder's: nobody computes it
                else:
                    while holder is not None and time.monotonic() < deadline:
                        (record,) = records.find([key])
                        if record is not None:
                            break
                        waited = True
                        time.sleep(pause)
                        pause = min(2 * pause, 0.02)
                        holder = records.holder(key)
                    else:
                        (record,) = records.find([key])  # released: its record is there, or it gave up
                    if record is not None:
                        node = self.adopt(ns, parent, action, record)
                        if node is not None and waited:
                            metrics.add(index_wait_adopted=1)
                        return node
                    if holder is not None and not holder.stale(self.cfg.wait_s):
                        log.info("chunk %s: still claimed by %s pid %d after %.1f s; computing it here",
                                 key.hex()[:16], holder.host, holder.pid, self.cfg.wait_s)
                        return None
                if time.monotonic() >= deadline:
                    return None
                holder = records.claim(key)  # released without a record, or stale: claim it
            (record,) = records.find([key])  # committed between the caller's probe and the claim
            if record is not None:
                records.drop_claim(key)
                return self.adopt(ns, parent, action, record)
            with self._claims_lock:
                self._claims[key] = id(owner)
            metrics.add(index_claims=1)
            return None
        finally:
            if waited:
                metrics.add(index_waits=1, index_wait_seconds=time.monotonic() - t0)

    def release_claims(self, owner: object) -> None:
        """Drop the claims ``owner`` (a session) still holds: it ends without their records."""
        with self._claims_lock:
            mine = [k for k, o in self._claims.items() if o == id(owner)]
            for k in mine:
                del self._claims[k]
        for k in mine:
            self.ctx.store.records.drop_claim(k)

    def _release(self, key: bytes) -> None:
        with self._claims_lock:
            held = self._claims.pop(key, None) is not None
        if held:
            self.ctx.store.records.drop_claim(key)

    def _find(self, keys: list[bytes]) -> list[Optional[ChunkRecord]]:
        self.ctx.metrics.add(index_probes=1, index_keys_probed=len(keys))
        return self.ctx.store.records.find(keys)

    def adopt(self, ns: Namespace, parent: TrieNode, action: ActionKey, record: ChunkRecord) -> Optional[TrieNode]:
        """``record``'s chunk as ``parent``'s child for ``action``, ready (None when the record
        does not belong there, or the node is this process's own write, free or invalidation)."""
        ctx = self.ctx
        raw = _action_bytes(action)
        if (raw is None or record.node_key != node_key(parent.node_key, raw) or record.parent_key != parent.node_key
                or record.depth != parent.depth + 1 or record.root_hash != ns.root_hash):
            log.warning("chunk record %s does not belong at depth %d under %s: not adopted",
                        record.node_key.hex()[:16], parent.depth + 1, parent.node_key.hex()[:16])
            return None
        if record.storage_format != self._format:
            # another kind of store on the same medium (the Plan tier and the per-layer tier on one
            # Fluxon cluster): its values are laid out otherwise
            log.info("chunk record %s was written by a %r store, this one reads %r: not adopted",
                     record.node_key.hex()[:16], record.storage_format, self._format)
            return None
        with ctx.forest.lock:
            try:
                node = ctx.forest.commit(ns, parent, action, record.node_key, record.depth)
            except ValueError as exc:  # the trie holds another key for this action (a crafted snapshot)
                log.warning("chunk record %s not adopted: %s", record.node_key.hex()[:16], exc)
                return None
            if node.has_kv:
                return node
            if not node.state.vacant:
                return None
            node.blob = BlobHandle(ctx.cfg.commit_tier, kv_locator(record.node_key), record.nbytes,
                                   record.n_layers, ready=True, pairs=record.pairs,
                                   digests=dict(record.digests) or None, recorded=True)
            node.skeleton = Skeleton(latent_locator(record.node_key))
            if record.depth < ctx.cfg.sink_chunks:
                node.pinned = True
            node.last_access = ctx.clock()
        ctx.metrics.add(index_adopted=1)
        return node

    # -- the write side -------------------------------------------------------------------------

    def publish(self, ns: Namespace, node: TrieNode, handle: BlobHandle, latent_nbytes: int) -> None:
        """Make ``node``'s chunk findable by every process: its values are committed (the
        store's completion callback called this), so its record goes last."""
        if (not self.active or handle.error is not None or node.parent is None
                or not self.keys_as(node.parent, node.action, node.node_key)):
            return
        record = ChunkRecord(node_key=node.node_key, parent_key=node.parent.node_key, root_hash=ns.root_hash,
                             depth=node.depth, n_layers=handle.n_layers, nbytes=int(handle.nbytes), pairs=handle.pairs,
                             latent_nbytes=int(latent_nbytes), storage_format=self._format,
                             digests=handle.digests or {})
        if self.ctx.store.records.publish(record):
            handle.recorded = True
            self.ctx.metrics.add(index_published=1)
        self._release(node.node_key)  # the record is there (or could not be): waiters stop waiting

    # -- the read side's re-check ---------------------------------------------------------------

    def gone(self, nodes: Sequence[TrieNode]) -> Optional[tuple[TrieNode, ...]]:
        """The nodes of ``nodes`` with a record (their chunks shared with other processes) whose
        records are no longer in the store (read after a restore's copies, before it publishes):
        their values may have been freed under it. Other nodes are this process's alone. None
        when the records could not be read (the medium unreachable): nothing is known gone, but
        what was read cannot be trusted either."""
        shared = [n for n in nodes if n.blob is not None and n.blob.recorded]
        if not self.active or not shared:
            return ()
        records = self.ctx.store.records.probe([n.node_key for n in shared])
        if records is None:
            return None
        lost = tuple(n for n, r in zip(shared, records) if r is None)
        if lost:
            self.ctx.metrics.add(index_recheck_misses=1)
        return lost

