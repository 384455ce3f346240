"""Live sessions on TeleFuser's real pipeline, streamed as its services stream them: no controls
when the session is created, then one control per chunk (the release and the hooked commit:
``generate_next_chunk(runtime, control_override=build_control_override(...))``; main:
``submit_chunk(session, i, control)``). Each chunk is keyed by the control it ran with, never by
a placeholder, so two live sessions with different actions never restore each other's chunks.

Runs on whichever TeleFuser is importable: the PyPI release in CI, a source checkout of the
hooked commit or of main first on ``PYTHONPATH``."""

from __future__ import annotations

import pytest
import torch

from cacheseek.errors import ControlMismatchError
from cacheseek.integrations.telefuser import hooks_of
from cacheseek.reuse.exact_prefix import NamespaceForest, WorldKVManager
from cacheseek.reuse.exact_prefix.actions import action_keys
from cacheseek.reuse.exact_prefix.keys import build_action_chain
from cacheseek.reuse.exact_prefix.telefuser_lingbot import LingBotWorldKVBinding, make_rolling_config
from cacheseek.runtime.telefuser import TeleFuserRuntimeFactory
from cacheseek.stores.memory import InMemoryTierStore

X = [[0.3, -0.2, 0.1], [-0.5, 0.4, 0.0], [0.1, 0.1, -0.3], [0.7, -0.6, 0.2]]
Y = [[-0.3, 0.2, 0.1], [0.5, 0.4, 0.0], [0.1, -0.1, 0.3], [-0.7, 0.6, 0.2]]
P_THEN_Y = X[:2] + Y[2:]  # shares X's first two actions


@pytest.fixture(scope="module")
def factory():
    return TeleFuserRuntimeFactory(local_attn_size=7, sink_size=3)


@pytest.fixture()
def manager():
    return WorldKVManager(NamespaceForest(), InMemoryTierStore(), make_rolling_config(local_attn_size=7, sink_size=3))


@pytest.fixture(scope="module")
def cold(factory):
    """Frames of each action list with no cache (the reference)."""
    out = {}
    for name, actions in (("X", X), ("Y", Y), ("PY", P_THEN_Y)):
        out[name] = factory.make(actions, streamed=True).generate()
    return out


def _binding(manager, factory):
    return LingBotWorldKVBinding(manager, manager.forest, model_fingerprint=factory.weights_fingerprint)


def _streamed(factory, manager, actions):
    binding = _binding(manager, factory)
    session = factory.make(actions, hooks=binding, streamed=True)
    hashes = session.generate()
    manager.store.flush()
    return session, binding, hashes


def _streamed_controls(factory, session):
    """The controls the streamed chunks ran with, rebuilt the way the service built them."""
    if factory.streaming:
        return session.controls
    return [factory.chunk_override(session.runtime, session.actions, k) for k in range(session.total_chunks)]


def test_two_live_sessions_with_other_actions_never_restore_each_others_chunks(factory, manager, cold):
    a, binding_a, frames_a = _streamed(factory, manager, X)
    assert frames_a == cold["X"] and binding_a.last_fast_forward == 0
    b, binding_b, frames_b = _streamed(factory, manager, Y)
    assert binding_b.last_fast_forward == 0  # nothing planned: nothing restored at creation
    assert frames_b == cold["Y"]  # B's own video, not A's
    assert manager.metrics.chunks_unkeyed == 0 and manager.metrics.hook_failures == 0

    # each chunk is keyed by the control it ran with: two branches of four chunks
    ns = manager.forest.resolve(binding_a.root)
    assert binding_b.root == binding_a.root and len(ns.root.children) == 2
    for session, binding in ((a, binding_a), (b, binding_b)):
        expected = build_action_chain(binding.root, action_keys(_streamed_controls(factory, session)))
        node, chain = ns.root, []
        for key in list(binding.actions):
            node = node.children[key]
            chain.append(node.node_key)
        assert chain == expected and all(n.has_kv for n in _path(ns, binding.actions))


def test_a_live_session_sharing_a_prefix_branches_where_its_actions_do(factory, manager, cold):
    _, binding_a, _ = _streamed(factory, manager, X)
    _, binding_c, frames_c = _streamed(factory, manager, P_THEN_Y)
    assert frames_c == cold["PY"] and binding_c.last_fast_forward == 0
    ns = manager.forest.resolve(binding_a.root)
    assert len(ns.root.children) == 1  # chunk 0 and 1: the same controls, the same nodes
    depth1 = next(iter(ns.root.children.values()))
    assert len(depth1.children) == 1 and len(next(iter(depth1.children.values())).children) == 2
    assert list(binding_c.actions)[:2] == list(binding_a.actions)[:2]
    assert list(binding_c.actions)[2:] != list(binding_a.actions)[2:]


def test_a_chunk_whose_control_never_reached_the_binding_is_not_cached(factory, manager):
    """Driving the pipeline around the per-chunk seam: no control is known, so nothing is keyed
    (counted and logged), never a placeholder key."""
    if factory.streaming:
        pytest.skip("TeleFuser main reports every submitted control; its seam cannot be bypassed this way")
    hooks = hooks_of(factory.pipeline)
    plain = factory.make(X, streamed=True)  # overrides built for a session without a binding
    plain.start()
    overrides = [factory.chunk_override(plain.runtime, X, k) for k in range(len(X))]
    binding = _binding(manager, factory)
    session = factory.make(X, hooks=binding, streamed=True)
    session.start()
    for override in overrides:
        hooks.own_generate_next_chunk(session.runtime, control_override=override)
    manager.store.flush()
    assert manager.metrics.chunks_unkeyed == len(X) and manager.metrics.writes == 0
    ns = manager.forest.resolve(binding.root)
    assert ns is not None and not ns.root.children


def test_a_planned_session_run_with_another_control_over_a_restored_chunk_stops(factory, manager):
    """A chunk restored for its planned control cannot be shown for another one: the caller of
    generate_next_chunk gets ControlMismatchError instead of the planned control's frames."""
    if factory.streaming:
        pytest.skip("on main the planned controls are the ones submitted (generate_video)")
    factory.make(X, hooks=_binding(manager, factory)).generate()
    manager.store.flush()
    binding = _binding(manager, factory)
    session = factory.make(X, hooks=binding)
    session.start()
    assert binding.last_fast_forward == len(X)
    other = factory.chunk_override(session.runtime, Y, 0)
    with pytest.raises(ControlMismatchError, match="chunk 0 was restored"):
        factory.pipeline.generate_next_chunk(session.runtime, control_override=other)
    # the planned control itself (passed as an override) is accepted
    same = session.runtime.control_chunks[0].clone()
    factory.pipeline.generate_next_chunk(session.runtime, control_override=same)
    assert int(session.runtime.current_chunk_index) == 1


def _path(ns, keys):
    node, out = ns.root, []
    for key in keys:
        node = node.children[key]
        out.append(node)
    return out


def test_streamed_overrides_are_float32_controls_of_the_chunk(factory):
    """What the binding keys: TeleFuser's own control tensor of one chunk."""
    if factory.streaming:
        pytest.skip("main builds controls with its control builder (covered by the gate)")
    session = factory.make(X, streamed=True)
    session.start()
    override = factory.chunk_override(session.runtime, X, 1)
    assert session.runtime.control_chunks is None
    assert override.dtype == torch.float32 and override.shape[2] == 3


def test_a_live_chunk_that_looks_its_key_up_next_is_keyed_as_its_control_arrives(factory, cold, monkeypatch):
    """The override is built right before its chunk: where that chunk's lookup reads the key (a
    cached child below the cursor, or a shared index to ask), the key is computed in the caller's
    thread as the control arrives, not handed to the keys' thread and waited for; where no
    lookup reads it (a fresh namespace, no shared index), the keys' thread computes it."""
    import threading

    from cacheseek.reuse.exact_prefix import lazy_keys

    if factory.streaming:
        pytest.skip("TeleFuser main's service submits controls ahead; no override is built before a chunk")
    manager = WorldKVManager(NamespaceForest(), InMemoryTierStore(), make_rolling_config(local_attn_size=7, sink_size=3),
                             shared_index={"enabled": False})
    assert not manager.index.active
    where: list[tuple[str, int]] = []
    real = lazy_keys.chunk_action_key
    monkeypatch.setattr(lazy_keys, "chunk_action_key",
                        lambda i, c: (where.append((threading.current_thread().name, i)), real(i, c))[1])
    _, _, frames = _streamed(factory, manager, X)
    assert frames == cold["X"] and sorted(where) == [(lazy_keys.THREAD_NAME, i) for i in range(len(X))]
    where.clear()
    _, binding, frames = _streamed(factory, manager, X)  # each chunk's cached child is looked up by its key
    assert frames == cold["X"] and len(binding.restored_chunks) == len(X)
    assert sorted(where) == [(threading.main_thread().name, i) for i in range(len(X))]
