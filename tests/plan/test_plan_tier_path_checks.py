"""The Plan tier's read-path pieces alone: the path checks against a restore target
(`check_path`: a miss, or a layout mismatch, before any Plan call) and one get plan's lifecycle
(`GetRead`: transferred -> released, else cancelled; lengths checked before any copy)."""

from __future__ import annotations

import dataclasses
from typing import Optional

import pytest

from cacheseek.errors import LayoutMismatchError
from cacheseek.kv.handles import BlobHandle, Skeleton, Tier
from cacheseek.kv.payload import RestoreTarget
from cacheseek.kv.ring import CopyRun
from cacheseek.plan.embedded import EmbeddedPlanClient
from cacheseek.stores.plan_tier.segments import ClientCalls
from cacheseek.stores.plan_tier.read import GetRead, check_path
from cacheseek.stores.plan_tier.stats import Counters

N_LAYERS, CHUNK_TOKENS, TOKEN_BYTES = 2, 4, 8
VALUE = CHUNK_TOKENS * TOKEN_BYTES


@dataclasses.dataclass
class Node:
    depth: int
    blob: Optional[BlobHandle]
    skeleton: Optional[Skeleton]


def node(depth: int, *, ready=True, skeleton=True, n_layers=N_LAYERS, nbytes=2 * N_LAYERS * VALUE) -> Node:
    blob = BlobHandle(Tier.FLUXON_DRAM, f"c{depth}:kv", nbytes, n_layers, ready=ready)
    return Node(depth, blob, Skeleton(f"c{depth}:lat") if skeleton else None)


def target(k: int, window_depths, runs=None, n_layers=N_LAYERS) -> RestoreTarget:
    runs = runs if runs is not None else [CopyRun(d, 0, i * CHUNK_TOKENS, CHUNK_TOKENS) for i, d in enumerate(window_depths)]
    return RestoreTarget(kv=tuple((object(), object()) for _ in range(n_layers)), runs=tuple(runs),
                         window_depths=tuple(window_depths), token_bytes=TOKEN_BYTES,
                         chunk_tokens=CHUNK_TOKENS, latents=tuple(object() for _ in range(k)))


def test_a_consistent_path_gives_its_latent_keys_and_window_blobs():
    path = [node(d) for d in range(3)]
    keys, blobs = check_path(path, path[1:], target(3, [1, 2]))
    assert keys == ["c0:lat", "c1:lat", "c2:lat"] and blobs == [path[1].blob, path[2].blob]


@pytest.mark.parametrize("missing", ["skeleton", "blob", "not_ready"])
def test_a_node_without_skeleton_or_ready_blob_is_a_miss(missing):
    path = [node(0), node(1)]
    if missing == "skeleton":
        path[0] = node(0, skeleton=False)
    elif missing == "blob":
        path[1].blob = None
    else:
        path[1] = node(1, ready=False)
    assert check_path(path, path, target(2, [0, 1])) is None


def test_latent_targets_or_layers_that_do_not_fit_the_path_are_a_mismatch():
    path = [node(0), node(1)]
    with pytest.raises(LayoutMismatchError, match="1 latent targets and 2 layers for a path of 2"):
        check_path(path, path, target(1, [0, 1]))
    with pytest.raises(LayoutMismatchError, match="0 layers"):
        check_path(path, path, target(2, [0, 1], n_layers=0))


def test_window_depths_must_be_the_targets():
    path = [node(0), node(1)]
    with pytest.raises(LayoutMismatchError, match=r"window depths \[1\] differ from the target's \[0, 1\]"):
        check_path(path, path[1:], target(2, [0, 1]))


def test_a_blob_of_another_layout_is_a_mismatch_not_a_miss():
    path = [node(0), node(1, nbytes=VALUE)]
    with pytest.raises(LayoutMismatchError, match="blob c1:kv holds 2 layers in 32 B"):
        check_path(path, path, target(2, [0, 1]))
    path = [node(0), node(1, n_layers=3)]
    with pytest.raises(LayoutMismatchError, match="blob c1:kv holds 3 layers"):
        check_path(path, path, target(2, [0, 1]))


@pytest.mark.parametrize("run", [CopyRun(5, 0, 0, 1), CopyRun(1, 2, 0, CHUNK_TOKENS - 1)])
def test_a_run_outside_the_window_or_the_chunk_is_a_mismatch(run):
    path = [node(0), node(1)]
    with pytest.raises(LayoutMismatchError, match="is outside the window or a 4-token chunk"):
        check_path(path, path, target(2, [0, 1], runs=[run]))


@pytest.fixture
def client():
    c = EmbeddedPlanClient(segment_bytes=1 << 20, prefault_threads=1)
    c.wait_local_segments_ready()
    plan, _ = c.local_fast_put_start(["a", "b"], 16)
    c.local_fast_put_commit(plan).result(5)
    yield c
    c.close()


def test_a_transferred_read_is_released_and_ending_twice_is_one_end(client):
    counters = Counters()
    read = GetRead(client, counters, {}, client.get_start(["a", "b"], [2]),
                   ClientCalls.of(client).value_lengths)
    table, n = read.transfer([16, 16])
    assert n == 2 and table
    read.end()
    read.end()
    assert client.live_handles() == (0, 0)
    assert counters.snapshot()[0] == {"gets_transferred": 1}


def test_a_read_never_transferred_is_cancelled(client):
    counters = Counters()
    read = GetRead(client, counters, {}, client.get_start(["a"], [1]),
                   ClientCalls.of(client).value_lengths)
    read.end()
    assert client.live_handles() == (0, 0) and counters.get("gets_cancelled") == 1


def test_lengths_are_checked_before_anything_is_copied(client):
    read = GetRead(client, Counters(), {}, client.get_start(["a", "b"], [2]),
                   ClientCalls.of(client).value_lengths)
    with pytest.raises(LayoutMismatchError, match="value b holds 16 B but its restore target takes 32 B"):
        read.transfer([16, 32])
    read.end()  # still ended after the mismatch: released, never leaked
    assert read.transferred and client.live_handles() == (0, 0)


class NoLengths:
    """The embedded client without ``value_lengths``: the store's own records are used."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        if name == "value_lengths":
            raise AttributeError(name)
        return getattr(self._inner, name)


def test_without_client_lengths_the_latent_records_are_checked(client):
    proxy = NoLengths(client)
    read = GetRead(proxy, Counters(), {"a": 16, "b": 8}, proxy.get_start(["a", "b"], [2]),
                   ClientCalls.of(proxy).value_lengths)
    with pytest.raises(LayoutMismatchError, match="value b holds 8 B"):
        read.transfer([16, 16])
    read.end()
    read = GetRead(proxy, Counters(), {}, proxy.get_start(["a", "b"], [2]),
                   ClientCalls.of(proxy).value_lengths)
    assert read.transfer([16, 16])[1] == 2  # nothing recorded: nothing to contradict
    read.end()
