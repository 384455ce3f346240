"""The shared index's semantics, in one process: two managers, each with its own forest (two
workers' tries), on one `InMemoryTierStore`, whose chunk records every manager on it shares.

- adoption: a manager with an empty trie restores what the other wrote, found by key;
- a live session probes one key per chunk and restores another worker's chunks mid-session;
- a record whose values are gone is a miss, the longest whole prefix is restored, and the record
  is retracted (nobody finds it again);
- a record retracted between the lookup and the end of the restore (another process freed the
  chunk while this one read it) is a miss, never a restore of what was read;
- two live sessions reaching the same chunks at once compute each chunk once: one claims it, the
  other waits for its record (`cacheseek.kv.claims`); a stale claim is not waited for.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from cacheseek.kv.claims import ChunkClaim, this_host
from cacheseek.kv.locators import layer_keys
from cacheseek.reuse.exact_prefix import NamespaceForest, WorldKVManager
from cacheseek.reuse.exact_prefix.telefuser_lingbot import LingBotWorldKVBinding, make_full_kv_config
from cacheseek.runtime.synthetic import SyntheticRuntimeFactory
from cacheseek.stores.memory import InMemoryTierStore

N = 4
FACTORY = SyntheticRuntimeFactory(geometry="tiny")
ACTS = [[0.1 * i, -0.05 * i, 0.02, 0.3 * (i % 2)] for i in range(N)]


def manager(store, **shared_index) -> WorldKVManager:
    return WorldKVManager(NamespaceForest(), store, make_full_kv_config(), shared_index=shared_index or None)


def session(mgr, actions=ACTS, *, ingest=True):
    """A whole session, planned: its binding (``last_fast_forward``: chunks restored) and frames."""
    b = LingBotWorldKVBinding(mgr, mgr.forest, ingest_enabled=ingest)
    hashes = FACTORY.make(actions, hooks=b).generate()
    b.close()
    return b, hashes


def live(mgr, actions=ACTS, *, ingest=True, start=None):
    """A live session, one action per chunk: its binding (``restored_chunks``) and frames."""
    b = LingBotWorldKVBinding(mgr, mgr.forest, ingest_enabled=ingest)
    rt = FACTORY.make(actions, hooks=b, streamed=True)
    if start is not None:
        start.wait(10)
    for i in range(len(actions)):
        hashes = rt.generate(stop_after=i + 1)
    b.close()
    return b, list(hashes)


COLD = FACTORY.make(ACTS).generate()


def chain(mgr):
    """The nodes of the (one) written path, by depth."""
    (ns,) = mgr.forest.namespaces()
    return sorted((n for n in ns.iter_nodes() if n.depth >= 0 and n.blob is not None), key=lambda n: n.depth)


def test_a_manager_with_an_empty_trie_adopts_what_another_wrote():
    store = InMemoryTierStore()
    a, b = manager(store), manager(store)
    _, hashes = session(a)
    assert hashes == COLD and a.metrics.index_published == N
    binding, hashes = session(b)
    assert hashes == COLD and binding.last_fast_forward == N
    assert b.metrics.index_adopted == N and b.metrics.writes == 0
    # past its empty trie: one key first (a miss there costs one action key), then the rest at once
    assert b.metrics.index_probes == 2 and b.metrics.index_keys_probed == N
    assert store.records.stats.found >= N


def test_with_the_index_off_a_manager_finds_only_its_own_chunks():
    store = InMemoryTierStore()
    a, b = manager(store), manager(store, enabled=False)
    session(a)
    binding, hashes = session(b)
    assert hashes == COLD and binding.last_fast_forward == 0 and b.metrics.index_probes == 0


def test_a_live_session_probes_one_key_a_chunk_and_restores_anothers_chunks():
    store = InMemoryTierStore()
    a, b = manager(store), manager(store)
    _, hashes = live(a)
    assert hashes == COLD and a.metrics.index_published == N and a.metrics.index_claims == N
    binding, hashes = live(b)
    assert hashes == COLD and binding.restored_chunks == list(range(N))
    assert b.metrics.index_keys_probed == b.metrics.index_probes == N  # one key, one probe, per chunk
    assert b.metrics.index_adopted == N and b.metrics.live_hits == N and b.metrics.writes == 0


@pytest.mark.parametrize("depth", [1, 3])
def test_a_record_whose_values_are_gone_is_a_miss_and_is_retracted(depth):
    store = InMemoryTierStore()
    a, b = manager(store), manager(store)
    session(a)
    gone = chain(a)[depth]
    store.backend.delete(layer_keys(gone.blob.locator, 0)[1])  # one V value, behind the records' back
    binding, hashes = session(b, ingest=False)
    assert hashes == COLD and binding.last_fast_forward == depth  # the longest whole prefix
    assert b.metrics.invalidations == 1
    assert store.records.find([gone.node_key]) == [None]  # retracted: nobody adopts it again
    assert all(r is not None for r in store.records.find([n.node_key for n in chain(a)[:depth]]))
    c = manager(store)
    binding, hashes = session(c, ingest=False)
    assert hashes == COLD and binding.last_fast_forward == depth and c.metrics.invalidations == 0


class FreedWhileRead(InMemoryTierStore):
    """Another process frees chunk ``victim`` (retracts its record) while this one reads it."""

    victim: bytes = b""

    def get_layer(self, handle, layer):
        out = super().get_layer(handle, layer)
        if handle.locator.startswith(self.victim.hex()):
            self.records.retract(self.victim)
        return out


def test_a_record_retracted_during_the_restore_is_a_miss():
    store = FreedWhileRead()
    a, b = manager(store), manager(store)
    session(a)
    store.victim = chain(a)[2].node_key
    binding, hashes = session(b, ingest=False)
    assert hashes == COLD
    assert b.metrics.index_recheck_misses >= 1 and binding.last_fast_forward < N
    assert b.metrics.restores == 1  # the shorter prefix, found whole on the retry


def test_two_live_sessions_at_once_compute_each_chunk_once():
    store = InMemoryTierStore()
    managers = [manager(store), manager(store)]
    start = threading.Barrier(2)
    out = [None, None]

    def run(k):
        out[k] = live(managers[k], start=start)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert [hashes for _, hashes in out] == [COLD, COLD]
    assert sum(m.metrics.index_published for m in managers) == N  # every chunk computed once
    assert sum(len(b.restored_chunks) for b, _ in out) == N
    assert sum(m.metrics.index_claims for m in managers) == N
    assert sum(m.metrics.index_wait_seconds for m in managers) < 10


def test_wait_s_0_claims_nothing():
    store = InMemoryTierStore()
    managers = [manager(store, wait_s=0), manager(store, wait_s=0)]
    _, hashes = live(managers[0])
    assert hashes == COLD and managers[0].metrics.index_claims == 0  # wait_s=0: nothing claimed


def test_a_claim_is_stale_once_its_holder_is_gone_or_it_is_too_old():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    now = time.time()
    assert ChunkClaim(this_host(), dead.pid, "t", now).stale(60)
    assert not ChunkClaim(this_host(), os.getpid(), "t", now).stale(60)
    assert ChunkClaim(this_host(), os.getpid(), "t", now - 61).stale(60)
    assert not ChunkClaim("another-host", dead.pid, "t", now).stale(60)  # another host's: by age only
    claim = ChunkClaim.mine()
    assert ChunkClaim.decode(claim.encode()) == claim and ChunkClaim.decode(b"junk") is None


def test_a_claim_taken_is_held_until_released():
    store = InMemoryTierStore()
    key = bytes(range(32))
    assert store.records.claim(key) is None  # ours now
    holder = store.records.claim(key)
    assert holder is not None and holder.pid == os.getpid()
    store.records.drop_claim(key)
    assert store.records.holder(key) is None and store.records.claim(key) is None
