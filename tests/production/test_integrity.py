"""Issue 12: a corrupt value is never restored, and is treated like a missing one; an invalidated
node is never freed under a reader.

- A flipped bit in a stored K value (LocalDisk): the A/B/C/D gate's C restores only the prefix
  before the damaged chunk, its frames equal the cold reference D, the node is invalidated and
  its values freed; the next session restores everything again.
- A truncated file: the same (today it was a store error that made every later session read,
  fail and run cold, with the poisoned file kept).
- A deferred invalidation: a restore that finds values missing while another restore reads the
  same node does not free the node under that reader; the last release frees it.
"""

from __future__ import annotations

import threading

import pytest

from cacheseek.reuse.exact_prefix.keys import layer_keys
from cacheseek.reuse.exact_prefix.types import NodeState
from cacheseek.stores.localdisk import LocalDiskTierStore
from cacheseek.stores.memory import InMemoryTierStore

from prodkit import FULL, MODES, acts, chain, check_invariants, cold_hashes, new_manager, run_session

N = 4
P_X = acts(N)
P_Y = P_X[:3] + acts(N, variant=1)[3:]  # shares the first 3 chunks with P_X


def _flip(path, at):
    data = bytearray(path.read_bytes())
    data[at] ^= 0x04
    path.write_bytes(bytes(data))


def _damage(store, key, how):
    path = store.disk.path_of(key)
    if how == "flip":
        _flip(path, path.stat().st_size - 5)  # inside the payload
    elif how == "flip-header":
        _flip(path, 20)
    else:
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return path


@pytest.mark.parametrize("how", ["flip", "flip-header", "truncate"])
@pytest.mark.parametrize("what", ["kv", "latent"])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_damaged_value_is_a_miss_never_a_wrong_restore(tmp_path, mode, what, how):
    mode = MODES[mode]
    store = LocalDiskTierStore(str(tmp_path / "kv"))
    try:
        mgr = new_manager(store, mode)
        run_session(mgr, mode, P_X)  # A
        node = chain(mgr.forest)[1]
        key = layer_keys(node.blob.locator, 1)[0] if what == "kv" else node.skeleton.latent_locator
        path = _damage(store, key, how)
        window_has_1 = 1 in [n.depth for n in mgr.restorer.window_path(chain(mgr.forest)[2])]

        b, rt, hashes = run_session(mgr, mode, P_Y)  # C: would hit 3 chunks without the damage
        assert hashes == cold_hashes(mode, P_Y)  # = D
        if what == "kv" and not window_has_1:
            assert b.last_fast_forward == 3  # chunk 1's KV is not read at depth 3 in this window
        else:
            assert b.last_fast_forward == 1 and rt.restored_chunks == [0]
            assert path.exists() and store.disk.read(key) is not None  # C rewrote it, sound
            assert mgr.metrics.invalidations == 1 and store.stats.corrupt_values == 1
        assert check_invariants(mgr.forest, store.keys()) == []

        # C re-ingested chunks 1..3 of P_Y; the same request is now a full hit, bit-identical.
        b, _, hashes = run_session(mgr, mode, P_Y, ingest=False)
        assert b.last_fast_forward == N and hashes == cold_hashes(mode, P_Y)
    finally:
        store.close()


def test_truncated_value_is_not_read_again(tmp_path):
    """The poisoned file goes with the first read that finds it; later sessions hit."""
    store = LocalDiskTierStore(str(tmp_path / "kv"))
    try:
        mgr = new_manager(store, FULL)
        run_session(mgr, FULL, P_X)
        node = chain(mgr.forest)[2]
        _damage(store, layer_keys(node.blob.locator, 0)[1], "truncate")
        for _ in range(3):
            b, _, hashes = run_session(mgr, FULL, P_X)
            assert hashes == cold_hashes(FULL, P_X)
        assert b.last_fast_forward == N
        assert store.stats.corrupt_values == 1 and mgr.metrics.restore_failures == 0
    finally:
        store.close()


def test_invalidation_of_a_referenced_node_waits_for_its_last_reader():
    store = InMemoryTierStore()
    mgr = new_manager(store, FULL)
    run_session(mgr, FULL, P_X)
    node = chain(mgr.forest)[1]
    handle = node.blob
    kk, _ = layer_keys(handle.locator, 0)

    real_get_layer = store.get_layer
    reading = threading.Event()
    go_on = threading.Event()

    def slow_get_layer(h, layer):
        out = real_get_layer(h, layer)
        if h is handle and layer == 1:
            reading.set()
            assert go_on.wait(10)
        return out

    store.get_layer = slow_get_layer
    result = {}
    reader = threading.Thread(target=lambda: result.update(r=run_session(mgr, FULL, P_X, ingest=False)))
    reader.start()
    try:
        assert reading.wait(10)
        assert node.ref_count == 1
        # A second session finds chunk 1's values missing and invalidates it meanwhile.
        assert mgr.invalidator.invalidate([node]) == 1
        assert node.state is NodeState.INVALID and not node.has_kv
        assert store.contains([kk]) == [True]  # not freed under the reader
    finally:
        go_on.set()
        reader.join(10)
    b, _, hashes = result["r"]
    assert hashes == cold_hashes(FULL, P_X)
    assert b.last_fast_forward == N  # the reader's values were intact: its restore stands
    assert node.ref_count == 0 and node.state is NodeState.EMPTY
    assert node.blob is None and store.contains([kk]) == [False]  # freed by the last release
    assert check_invariants(mgr.forest, store.keys()) == []
    b, _, hashes = run_session(mgr, FULL, P_X)  # re-ingests chunk 1 and below
    assert b.last_fast_forward == 1 and hashes == cold_hashes(FULL, P_X)
    b, _, _ = run_session(mgr, FULL, P_X, ingest=False)
    assert b.last_fast_forward == N


def test_two_plan_tiers_sharing_a_transfer_runtime_close_independently():
    """Closing one Plan tier must not unregister memory the other still uses (issue 12 item 5)."""
    from cacheseek.plan.embedded import EmbeddedPlanClient
    from cacheseek.stores.plan_tier import PlanTierStore

    from prodkit import fake_cuda

    transfer, fake = fake_cuda()
    client = EmbeddedPlanClient(segment_bytes=1 << 20, prefault_threads=1)
    a = PlanTierStore(plan_client=client, transfer=transfer)
    b = PlanTierStore(plan_client=client, transfer=transfer)
    try:
        mapping = transfer.registered()[0]
        assert transfer.users(mapping) == 2
        a.close()
        assert fake.is_registered(mapping.ptr) and transfer.users(mapping) == 1
        mgr = new_manager(b, FULL)
        run_session(mgr, FULL, P_X)
        bb, _, hashes = run_session(mgr, FULL, P_X, ingest=False)
        assert bb.last_fast_forward == N and hashes == cold_hashes(FULL, P_X)
        b.close()
        assert not fake.is_registered(mapping.ptr) and transfer.registered() == []
    finally:
        a.close()
        b.close()
        client.close()
        transfer.close()


def _swap(store, a, b):
    pa, pb = store.disk.path_of(a), store.disk.path_of(b)
    da, db = pa.read_bytes(), pb.read_bytes()
    pa.write_bytes(db)
    pb.write_bytes(da)


@pytest.mark.parametrize("swap", ["k-and-v", "two-layers", "two-chunks", "two-latents"])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_value_under_another_key_is_a_miss_never_a_wrong_restore(tmp_path, mode, swap):
    """Two self-consistent value files swapped (a misdirected write, a restore from a backup):
    each value's checksum covers its own key, so both read as corrupt; the session restores the
    longest whole prefix before them and its frames equal a cold run's."""
    mode = MODES[mode]
    store = LocalDiskTierStore(str(tmp_path / "kv"))
    try:
        mgr = new_manager(store, mode)
        run_session(mgr, mode, P_X)
        nodes = chain(mgr.forest)
        one, two = nodes[2], nodes[3]  # in the restore window of depth 4 in both ring modes
        pairs = {"k-and-v": layer_keys(one.blob.locator, 0),
                 "two-layers": (layer_keys(one.blob.locator, 0)[0], layer_keys(one.blob.locator, 1)[0]),
                 "two-chunks": (layer_keys(one.blob.locator, 1)[0], layer_keys(two.blob.locator, 1)[0]),
                 "two-latents": (one.skeleton.latent_locator, two.skeleton.latent_locator)}
        _swap(store, *pairs[swap])
        b, _, hashes = run_session(mgr, mode, P_X)
        assert hashes == cold_hashes(mode, P_X)
        assert store.stats.corrupt_values >= 1 and b.last_fast_forward < N
        assert check_invariants(mgr.forest, store.keys()) == []
    finally:
        store.close()
