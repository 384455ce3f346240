"""The binding's start-up path (issue 14): what a session pays before its first chunk runs.

- a store still warming up in the background is bypassed: no namespace, no keys, no lookup, no
  writes, counted; once warm, sessions write and hit as usual;
- the binding holds the store's start-up token from its creation until on_runtime_created
  returns, on every path;
- action keys are computed only as the trie walk needs them (none at a fresh namespace, exactly
  the matched ones on a hit), the rest on a background thread that ends with the session; a later
  chunk's control without a key fails that chunk's ingest only.
"""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from cacheseek.errors import GeometryError
from cacheseek.reuse.exact_prefix import NamespaceForest, WorldKVManager, lazy_keys
from cacheseek.reuse.exact_prefix.actions import action_keys
from cacheseek.reuse.exact_prefix.lazy_keys import THREAD_NAME
from cacheseek.reuse.exact_prefix.telefuser_lingbot import LingBotWorldKVBinding, make_full_kv_config, make_rolling_config
from cacheseek.runtime.synthetic import SyntheticRuntimeFactory
from cacheseek.stores.memory import InMemoryTierStore

N = 5
ACTS = [[0.1 * i, -0.05 * i, 0.02, 0.3 * (i % 2)] for i in range(N)]
FACTORY = SyntheticRuntimeFactory(geometry="tiny")


def binding_for(store, forest=None, *, shared_index=True, **kw) -> LingBotWorldKVBinding:
    forest = forest if forest is not None else NamespaceForest()
    manager = WorldKVManager(forest, store, make_full_kv_config(), shared_index={"enabled": shared_index})
    return LingBotWorldKVBinding(manager, forest, **kw)


def chain_actions(forest: NamespaceForest) -> list[bytes]:
    (ns,) = forest.namespaces()
    out, node = [], ns.root
    while node.children:
        (node,) = node.children.values()
        out.append(node.action)
    return out


def no_key_thread_alive() -> bool:
    return not any(t.name == THREAD_NAME and t.is_alive() for t in threading.enumerate())


class Calls(list):
    """(thread name, index) of every key computed; the background thread waits for ``go``."""

    def __init__(self) -> None:
        super().__init__()
        self.go = threading.Event()

    def indices(self, thread: str | None = None) -> list[int]:
        return sorted(i for name, i in self if thread is None or name == thread)


@pytest.fixture
def calls(monkeypatch) -> Calls:
    made = Calls()
    real = lazy_keys.chunk_action_key

    def recording(index, control):
        name = threading.current_thread().name
        if name == THREAD_NAME:
            assert made.go.wait(10)
        made.append((name, index))
        return real(index, control)

    monkeypatch.setattr(lazy_keys, "chunk_action_key", recording)
    yield made
    made.go.set()


# -- a store still warming up ----------------------------------------------------------------------

@pytest.fixture
def warming(gated):
    return gated()


def test_a_warming_store_is_bypassed_then_used_once_warm(warming, calls, caplog):
    store, client = warming
    forest = NamespaceForest()
    b = binding_for(store, forest)
    assert store.starts.starting == 2  # the warm-up yields while this session (the first) starts
    rt = FACTORY.make(ACTS, hooks=b)
    with caplog.at_level(logging.INFO, logger="cacheseek.reuse.exact_prefix.telefuser_lingbot"):
        hashes = rt.generate()
    assert store.starts.starting == 0
    assert b.bypassed_warming and b.last_fast_forward == 0 and b.root is None
    assert hashes == FACTORY.make(ACTS).generate()  # the session ran as with no cache
    assert len(forest) == 0 and calls == [] and no_key_thread_alive()  # no namespace, no keys
    m = b.manager.metrics
    assert (m.sessions_bypassed_warming, m.lookups, m.hook_failures) == (1, 0, 0)
    stats = store.stats
    assert (stats.reads_while_warming, stats.writes_while_warming) == (0, 0)  # never asked
    assert b.ingest_errors == 0

    client.gate.set()
    assert store.wait_ready(20)
    calls.go.set()
    first = binding_for(store, forest)
    FACTORY.make(ACTS, hooks=first).generate()
    store.flush()
    second = binding_for(store, forest)
    assert FACTORY.make(ACTS, hooks=second).generate() == hashes
    assert not first.bypassed_warming and second.last_fast_forward == N
    assert first.manager.metrics.sessions_bypassed_warming == 0


def test_the_start_up_token_is_released_on_every_path():
    released: list[str] = []

    class Token:
        def __init__(self, name: str) -> None:
            self.name = name

        def release(self) -> None:
            released.append(self.name)

    class TokenStore(InMemoryTierStore):
        def session_starting(self):
            return Token(f"t{len(released)}")

    store = TokenStore()
    b = binding_for(store)
    assert released == []
    FACTORY.make(ACTS, hooks=b).generate()
    assert released == ["t0"]
    b.close()
    assert released == ["t0"]  # once only

    bad = LingBotWorldKVBinding(WorldKVManager(NamespaceForest(), store, make_rolling_config()), NamespaceForest())
    with pytest.raises(GeometryError):  # a failing hook releases it too
        FACTORY.make(ACTS, hooks=bad).generate()
    assert released == ["t0", "t1"]
    unused = binding_for(store)
    unused.close()  # a binding whose session never started
    assert released == ["t0", "t1", "t2"]


# -- lazy action keys ------------------------------------------------------------------------------

@pytest.mark.parametrize("shared_index", [False, True])
def test_a_cold_session_at_a_fresh_namespace_computes_no_key_before_its_first_chunk(calls, shared_index):
    """Without the shared index, no key at all; with it, the one key the store is asked for."""
    store = InMemoryTierStore()
    forest = NamespaceForest()
    b = binding_for(store, forest, shared_index=shared_index)
    rt = FACTORY.make(ACTS, hooks=b)
    rt.run_chunks(0)  # on_runtime_created only
    assert calls == ([("MainThread", 0)] if shared_index else []) and b.last_fast_forward == 0 and len(forest) == 1
    calls.go.set()
    rt.generate()
    store.flush()
    assert calls.indices() == list(range(N)) and no_key_thread_alive()  # each once; the thread joined
    assert chain_actions(forest) == action_keys(rt.control_chunks)


@pytest.mark.parametrize("shared_index", [False, True])
def test_a_hit_computes_exactly_the_matched_keys_and_a_miss_at_depth_0_one(calls, shared_index):
    """With the shared index, the key after the trie's end too (the one the store is asked for)."""
    store = InMemoryTierStore()
    forest = NamespaceForest()
    calls.go.set()
    first = binding_for(store, forest, shared_index=shared_index)
    FACTORY.make(ACTS, hooks=first).generate(stop_after=3)  # a chain of 3 chunks: the session stopped
    store.flush()
    first.close()
    calls.clear()
    calls.go.clear()

    b = binding_for(store, forest, shared_index=shared_index)
    rt = FACTORY.make(ACTS, hooks=b)
    rt.run_chunks(0)
    asked = [("MainThread", 3)] if shared_index else []
    assert b.last_fast_forward == 3 and calls == [("MainThread", 0), ("MainThread", 1), ("MainThread", 2)] + asked
    calls.go.set()
    rt.generate()
    store.flush()
    assert calls.indices() == list(range(N)) and chain_actions(forest) == action_keys(rt.control_chunks)

    calls.clear()
    calls.go.clear()
    other = binding_for(store, forest, shared_index=shared_index)
    rt = FACTORY.make([[9.0, 9.0, 9.0, 9.0]] + ACTS[1:], hooks=other)
    rt.run_chunks(0)
    assert other.last_fast_forward == 0 and calls == [("MainThread", 0)]
    calls.go.set()
    other.close()  # the session ends early: its thread stops after the key under way
    assert no_key_thread_alive()


def test_a_later_chunks_control_without_a_key_fails_that_ingest_only(calls, caplog):
    calls.go.set()
    store = InMemoryTierStore()
    forest = NamespaceForest()
    b = binding_for(store, forest)
    rt = FACTORY.make(ACTS, hooks=b)
    rt.control_chunks[3] = torch.full_like(rt.control_chunks[3], float("nan"))  # only the binding reads it
    with caplog.at_level(logging.WARNING, logger="cacheseek.reuse.exact_prefix.telefuser_lingbot"):
        hashes = rt.generate()
    store.flush()
    assert hashes == FACTORY.make(ACTS).generate()
    assert len(chain_actions(forest)) == 3  # chunks 0-2 cached; 3 failed; 4 not ingested
    assert b.ingest_errors == 1 and b.manager.metrics.action_key_errors == 1 and b.manager.metrics.hook_failures == 0
    assert any("chunk 3's control" in r.getMessage() and "ingest of chunk 3" in r.getMessage() for r in caplog.records)
    b.close()
    assert no_key_thread_alive()


def test_a_control_the_lookup_needs_without_a_key_fails_on_runtime_created(calls):
    calls.go.set()
    store = InMemoryTierStore()
    forest = NamespaceForest()
    FACTORY.make(ACTS, hooks=binding_for(store, forest)).generate()  # chunk 0 has a child to match
    store.flush()
    b = binding_for(store, forest)
    rt = FACTORY.make(ACTS, hooks=b)
    rt.control_chunks[0] = torch.full_like(rt.control_chunks[0], float("inf"))
    with pytest.raises(ValueError, match=r"chunk 0's control: .*non-finite"):
        b.on_runtime_created(rt, rt.session_config)
    assert b.manager.metrics.hook_failures == 1 and b.last_fast_forward == 0
    b.on_chunk_finalized(rt, 0, rt.noise_chunks[0])  # nothing to ingest into: a no-op
    assert no_key_thread_alive()
