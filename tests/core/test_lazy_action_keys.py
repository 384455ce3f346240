"""`LazyActionKeys` and the trie walk that consumes it: a key is computed only when read, once,
byte-identical to `action_keys`; the rest on one background thread that ends (or is joined); a
control without a key fails its own index only; the lookup reads an action only while the node
reached has children."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from cacheseek.reuse.exact_prefix import lazy_keys
from cacheseek.reuse.exact_prefix.actions import NO_CONTROL, action_keys
from cacheseek.reuse.exact_prefix.keys import node_key
from cacheseek.reuse.exact_prefix.lazy_keys import THREAD_NAME, LazyActionKeys
from cacheseek.reuse.exact_prefix.trie import NamespaceForest
from cacheseek.reuse.exact_prefix.types import BlobHandle, Tier

CONTROLS = [
    torch.linspace(-1, 1, 300).reshape(3, 100),
    None,
    np.arange(12, dtype=np.float64).reshape(3, 4) / 7,
    [[0.25, -0.5], [1e-7, 3.0]],
    torch.tensor([5000.0, -1.5]),  # an <i8 key
]


def _join(keys, timeout_s):
    """Wait for the background thread, if one is still running (it clears itself when done)."""
    thread = keys.background_thread
    if thread is not None:
        thread.join(timeout_s)


class Calls(list):
    """(thread name, index) of every key computed; ``go`` lets the background thread start."""

    def __init__(self) -> None:
        super().__init__()
        self.go = threading.Event()


@pytest.fixture
def calls(monkeypatch):
    """Every key computed: (thread name, index); the background thread waits for ``go``."""
    made = Calls()
    go = made.go
    real = lazy_keys.chunk_action_key

    def recording(index, control):
        name = threading.current_thread().name
        if name == THREAD_NAME:
            assert go.wait(10)
        made.append((name, index))
        return real(index, control)

    monkeypatch.setattr(lazy_keys, "chunk_action_key", recording)
    return made


def no_key_thread_alive() -> bool:
    return not any(t.name == THREAD_NAME and t.is_alive() for t in threading.enumerate())


def test_keys_are_those_of_action_keys_each_computed_once_when_read(calls):
    keys = LazyActionKeys(CONTROLS)
    assert len(keys) == 5 and keys.computed == 0 and calls == []
    assert keys[2] == action_keys(CONTROLS)[2] and [i for _, i in calls] == [2]
    assert list(keys) == action_keys(CONTROLS)
    assert keys[1] == NO_CONTROL
    assert sorted(i for _, i in calls) == [0, 1, 2, 3, 4] and keys.computed == 5 and keys.pending == 0


def test_a_slice_is_a_lazy_view_sharing_the_computed_keys(calls):
    keys = LazyActionKeys(CONTROLS)
    head = keys[:3]
    assert isinstance(head, LazyActionKeys) and len(head) == 3 and calls == []
    assert head[-1] == keys[2] and list(keys[1:4:2]) == [keys[1], keys[3]]
    assert sorted(i for _, i in calls) == [1, 2, 3]  # each once, whichever view read it


def test_the_background_thread_keys_the_rest_and_ends(calls):
    keys = LazyActionKeys(CONTROLS)
    assert keys[0] == action_keys(CONTROLS[:1])[0]
    keys.compute_rest_in_background()
    calls.go.set()
    assert keys[4] == action_keys(CONTROLS)[4]  # taken from the thread, or computed here while it works
    _join(keys, 10)  # it ends by itself once every key is computed
    assert no_key_thread_alive() and keys.pending == 0 and keys.close(10)
    assert sorted(i for _, i in calls) == [0, 1, 2, 3, 4] and list(keys) == action_keys(CONTROLS)
    assert [name for name, i in calls if i in (1, 2, 3)] == [THREAD_NAME] * 3


def test_nothing_left_starts_no_thread_and_close_is_idempotent(calls):
    keys = LazyActionKeys([None, None])
    list(keys)
    keys.compute_rest_in_background()
    assert keys.background_thread is None and keys.close() and keys.close()


def test_a_control_without_a_key_fails_its_own_index_only(calls):
    bad = [CONTROLS[0], np.array([0.0, float("nan")]), CONTROLS[2]]
    keys = LazyActionKeys(bad)
    keys.compute_rest_in_background()
    calls.go.set()
    assert keys.close(10)
    with pytest.raises(ValueError, match=r"chunk 1's control: .*non-finite"):
        keys[1]
    with pytest.raises(ValueError, match=r"chunk 1's control"):  # kept: raised again, not recomputed
        keys[1]
    assert [keys[0], keys[2]] == [action_keys(bad[:1])[0], action_keys(bad[2:])[0]]
    assert keys.pending == 0 and sorted(i for _, i in calls) == [0, 1, 2]


def test_close_stops_the_thread_after_the_key_under_way(calls):
    keys = LazyActionKeys(CONTROLS)
    keys.compute_rest_in_background()
    assert not keys.close(0.2)  # held before its first key: still running
    calls.go.set()
    assert keys.close(10) and no_key_thread_alive()
    assert len(calls) == 1  # the key under way, then it stopped
    assert list(keys) == action_keys(CONTROLS)  # the rest computed by the asking thread


class Reads(list):
    """Actions that record which indices were read (as LazyActionKeys computes them)."""

    def __init__(self, items):
        super().__init__(items)
        self.read: list[int] = []

    def __iter__(self):
        for i in range(len(self)):
            self.read.append(i)
            yield self[i]


def chain(forest: NamespaceForest, root: bytes, actions: list[bytes]):
    ns = forest.get_or_create_namespace(root, b"c" * 32)
    node = ns.root
    for depth, a in enumerate(actions):
        node = forest.commit(ns, node, a, node_key(node.node_key, a), depth)
        node.blob = BlobHandle(Tier.CPU, node.node_key.hex(), 8, 1, ready=True)
    return ns


def test_the_lookup_reads_an_action_only_while_the_node_reached_has_children():
    forest = NamespaceForest()
    root = b"r" * 32
    acts = Reads([b"a", b"b", b"c", b"d"])
    assert forest.lookup(root, acts).matched_len == 0 and acts.read == []  # no namespace
    chain(forest, root, [])
    assert forest.lookup(root, acts).matched_len == 0 and acts.read == []  # a fresh namespace
    chain(forest, root, [b"a", b"b"])
    match = forest.lookup(root, acts)
    assert match.matched_len == 2 and acts.read == [0, 1]  # node "b" has no children: key 2 unread
    acts.read.clear()
    other = Reads([b"x", b"b"])
    assert forest.lookup(root, other).matched_len == 0 and other.read == [0]  # a miss at depth 0
    assert forest.lookup(root, [b"a", b"b", b"c"]).matched_len == 2  # a plain list walks as before



@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_controls_keyed_on_a_side_stream_in_the_background_match_action_keys():
    gen = torch.Generator(device="cpu").manual_seed(3)
    host = [torch.randn(1, 384, 3, 60, 104, generator=gen) for _ in range(3)]  # the 480p control's shape
    cuda = [t.cuda() for t in host]
    torch.cuda.synchronize()
    main = torch.cuda.current_stream()
    torch.cuda._sleep(200_000_000)  # the caller's stream is busy ...
    cuda[2].add_(1.0)  # ... then writes a control: the side stream must wait for it
    keys = LazyActionKeys(cuda)
    keys.compute_rest_in_background()
    _join(keys, 60)
    assert keys.computed == 3 and no_key_thread_alive()  # all on the thread
    assert torch.cuda.current_stream() == main
    assert list(keys) == action_keys(host[:2] + [host[2] + 1.0])


# -- controls that arrive chunk by chunk (live sessions) ----------------------------------------


def test_an_unknown_control_has_no_key_until_it_is_supplied():
    keys = LazyActionKeys([CONTROLS[0], lazy_keys.UNKNOWN, lazy_keys.UNKNOWN])
    assert keys.known_prefix() == 1 and keys.pending == 1
    assert keys[0] == action_keys([CONTROLS[0]])[0]
    with pytest.raises(lazy_keys.ControlUnknownError, match="chunk 1's control is not known"):
        keys[1]
    keys.supply(1, None)  # a chunk that runs without control is a known control
    assert keys.known_prefix() == 2 and keys[1] == NO_CONTROL
    with pytest.raises(lazy_keys.ControlUnknownError):
        keys[2]  # not kept as an error: it can still arrive
    keys.supply(2, CONTROLS[2])
    assert list(keys) == action_keys([CONTROLS[0], None, CONTROLS[2]])


def test_a_supplied_control_replaces_the_planned_key():
    keys = LazyActionKeys(CONTROLS[:2])
    planned = keys[0]
    keys.supply(0, CONTROLS[0])  # the same object: the key stays
    assert keys.computed == 1
    keys.supply(0, CONTROLS[3])
    assert keys.computed == 0 and keys[0] == action_keys([CONTROLS[3]])[0] != planned


def test_the_background_thread_starts_again_for_controls_supplied_later():
    keys = LazyActionKeys([CONTROLS[0], lazy_keys.UNKNOWN])
    keys.compute_rest_in_background()
    _join(keys, 10)
    assert keys.computed == 1 and keys.pending == 0
    keys.supply(1, CONTROLS[4])
    keys.compute_rest_in_background()
    _join(keys, 10)
    assert keys.computed == 2 and keys[1] == action_keys([CONTROLS[4]])[0]
    keys.close()
    keys.supply(1, CONTROLS[2])
    keys.compute_rest_in_background()  # closed: the asking thread computes it
    assert keys.computed == 1 and keys[1] == action_keys([CONTROLS[2]])[0]


def test_supplying_the_same_control_again_does_not_wait_for_its_key_under_way(calls):
    keys = LazyActionKeys(CONTROLS[:1])
    keys.compute_rest_in_background()  # the thread holds key 0 until ``go``
    done = threading.Event()
    threading.Thread(target=lambda: (keys.supply(0, CONTROLS[0]), done.set()), daemon=True).start()
    assert done.wait(5)  # returned while key 0 of that control is still under way
    assert keys.computed == 0
    calls.go.set()
    assert keys[0] == action_keys(CONTROLS[:1])[0] and calls == [(THREAD_NAME, 0)]  # computed once
    replaced = threading.Event()
    keys2 = LazyActionKeys(CONTROLS[:1])
    calls.go.clear()
    keys2.compute_rest_in_background()
    threading.Thread(target=lambda: (keys2.supply(0, CONTROLS[1]), replaced.set()), daemon=True).start()
    assert not replaced.wait(0.3)  # another control waits for the key under way, then replaces it
    calls.go.set()
    assert replaced.wait(5) and keys2[0] == action_keys(CONTROLS[1:2])[0]
