"""Issue 12 item 2: pins protect only what a live namespace needs.

The reproduction: rolling L=7 S=3 (one sink chunk pinned per namespace), a store of 8 chunks,
sessions over distinct images. Before, after 8 namespaces the store was all pinned sinks and every
later write was dropped. Now a namespace is live while one of the last ``live_sessions`` sessions
touched it; the sinks of the others are ordinary LRU victims.
"""

from __future__ import annotations

import pytest

from cacheseek.errors import ConfigError
from cacheseek.eviction import EvictionConfig
from cacheseek.reuse.exact_prefix import NamespaceForest
from cacheseek.reuse.exact_prefix.telefuser_lingbot import LingBotWorldKVBinding
from cacheseek.runtime.synthetic import SyntheticImage
from cacheseek.stores.memory import InMemoryTierStore

from prodkit import ROLLING, acts, check_invariants, factory, new_manager, nodes

N = 3
ACTIONS = acts(N)


def image(i: int) -> SyntheticImage:
    return SyntheticImage("RGB", (4, 4), bytes((i * 31 + j * 7) % 256 for j in range(4 * 4 * 3)))


def session(mgr, i: int, *, ingest: bool = True):
    b = LingBotWorldKVBinding(mgr, mgr.forest, ingest_enabled=ingest)
    rt = factory(ROLLING).make(ACTIONS, hooks=b, image=image(i))
    hashes = rt.generate()
    return b, hashes


def chunk_bytes() -> int:
    store = InMemoryTierStore()
    session(new_manager(store, ROLLING), 0)
    return store.usage().used_bytes // N


@pytest.mark.parametrize("live", [1, 2, 4])
def test_sinks_of_dead_namespaces_are_evicted_and_writes_go_on(live):
    per_chunk = chunk_bytes()
    store = InMemoryTierStore(capacity_bytes=8 * per_chunk)
    mgr = new_manager(store, ROLLING, eviction=EvictionConfig(live_sessions=live))
    for i in range(12):
        session(mgr, i)
        assert check_invariants(mgr.forest, store.keys()) == []
    m = mgr.metrics.as_dict()
    assert mgr.metrics.dropped_writes == 0 and m["failed_writes"] == 0
    assert store.usage().used_bytes <= 8 * per_chunk
    sinks = [n for n in nodes(mgr.forest) if n.pinned]
    assert len(sinks) <= 8  # dead namespaces' sinks went, and the nodes left holding nothing were pruned
    assert all(n.has_kv or n.skeleton is not None or n.children for n in nodes(mgr.forest))
    assert len(mgr.forest) < 12 and all(ns.root.children for ns in mgr.forest.namespaces())
    # the latest session's namespace is restored (whole when pins hold a small part of the store)
    b, hashes = session(mgr, 11, ingest=False)
    assert b.last_fast_forward == N if live <= 2 else b.last_fast_forward >= 1
    assert hashes == factory(ROLLING).make(ACTIONS, hooks=None, image=image(11)).generate()


def test_a_live_namespaces_sink_is_never_a_victim():
    per_chunk = chunk_bytes()
    store = InMemoryTierStore(capacity_bytes=8 * per_chunk)
    mgr = new_manager(store, ROLLING, eviction=EvictionConfig(live_sessions=3))
    for i in range(3):
        session(mgr, i)
    sinks = {n for n in nodes(mgr.forest) if n.pinned}
    assert len(sinks) == 3
    mgr.evictor.evict(0)
    assert all(n.has_kv for n in sinks)  # the three namespaces are live: their sinks stay
    assert not any(n.has_kv for n in nodes(mgr.forest) if not n.pinned)
    session(mgr, 3, ingest=False)  # a fourth session: namespace 0 is no longer live
    mgr.evictor.evict(0)
    assert [n.has_kv for n in sorted(sinks, key=lambda n: n.last_access)] == [False, True, True]
    assert mgr.evict_blob(next(n for n in sinks if n.has_kv)) is False  # the public verb keeps pins


def test_lookups_and_writes_keep_a_namespace_live():
    forest = NamespaceForest()
    ns = forest.get_or_create_namespace(b"a" * 32, b"c")
    assert forest.is_live(ns, 1)
    forest.begin_session(b"b" * 32)
    assert not forest.is_live(ns, 1) and forest.is_live(ns, 2)
    forest.touch(ns)
    assert forest.is_live(ns, 1)
    forest.begin_session(b"b" * 32)
    forest.begin_session(b"a" * 32)
    assert forest.is_live(ns, 1) and ns.last_session == forest.sessions == 3


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "4"])
def test_live_sessions_is_checked(bad):
    with pytest.raises(ConfigError) as info:
        EvictionConfig(live_sessions=bad)
    assert info.value.field == "manager.eviction.live_sessions"
