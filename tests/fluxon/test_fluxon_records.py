"""The Fluxon side of the shared index: chunk records in the cluster's etcd (`EtcdRecords`),
found by key by every worker process of the cluster, through a real service.

- records round trip (publish first-wins, a batched find past etcd's 128 operations a
  transaction, a damaged record removed, retract, the listing);
- two worker processes: the second, with an empty trie and no snapshot, restores on both Fluxon
  stores what the first wrote, found by key alone, frames equal a cold run;
- a record whose values are gone (evicted) or were replaced by other bytes is a miss that
  invalidates the chunk and retracts its record, never a wrong restore;
- etcd stopped (SIGSTOP) mid-run: each probe fails within the bound, later ones at once, and the
  sessions run cold with the right frames; once etcd runs again the records are found again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import attrs
import pytest

from cacheseek.fluxon.records import MAX_TXN_OPS, EtcdRecords
from cacheseek.kv.locators import layer_keys
from cacheseek.kv.records import ChunkRecord, encode_record
from cacheseek.orchestrator import build_stack
from cacheseek.plan.fluxon_public import FluxonPublicPlanClient
from cacheseek.reuse.exact_prefix import NamespaceForest
from cacheseek.reuse.exact_prefix.keys import node_key
from cacheseek.stores.fluxon_bytes import FluxonTensorTier, FluxonValueBackend
from cacheseek.stores.plan_tier import PlanTierStore
from cacheseek.transfer.host_transfer import HostTransferRuntime

pytestmark = pytest.mark.fluxon

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("records_worker.py")
MiB = 1 << 20


def record(parent: bytes, action: bytes, depth: int = 1) -> ChunkRecord:
    return ChunkRecord(node_key=node_key(parent, action), parent_key=parent, root_hash=b"\x07" * 32, depth=depth,
                       n_layers=2, nbytes=4096, storage_format="cacheseek.tier.objects.v1",
                       digests={"a:L0:k": "0123456789abcdef"})


def ready_nodes(stack) -> list:
    return sorted((n for ns in stack.forest.namespaces() for n in ns.iter_nodes() if n.has_kv), key=lambda n: n.depth)


def session(stack, actions, **kw):
    binding, hashes, _ = stack.run_session(actions, **kw)
    return binding.last_fast_forward, hashes


def cold(stack, actions) -> list:
    return session(stack, actions, manager=stack.new_manager(forest=NamespaceForest(), shared_index=False),
                   ingest=False)[1]


def etcd_put(records: EtcdRecords, name: str, data: bytes) -> None:
    """Store raw bytes under a record's etcd key, as a damaged or foreign writer would."""
    import grpc
    from etcd3 import etcdrpc

    with grpc.insecure_channel(records.endpoint) as channel:
        etcdrpc.KVStub(channel).Put(etcdrpc.PutRequest(key=records.key(name), value=data), timeout=5)


# -- the records themselves --------------------------------------------------------------------


def test_records_round_trip_through_the_service(fluxon_client, key_prefix):
    records = fluxon_client.records  # the session client's: other tests count on it too
    assert isinstance(records, EtcdRecords) and records.shared
    before = attrs.evolve(records.stats, probe_seconds=[])
    assert records.prefix == f"/cacheseek/records/{fluxon_client.cluster_name}/"
    parent = os.urandom(32)
    rec = record(parent, b"a0")
    assert records.find([rec.node_key]) == [None]
    assert records.publish(rec) and records.stats.published == before.published + 1
    again = attrs.evolve(rec, digests={"a:L0:k": "fedcba9876543210"})  # a second writer's
    assert records.publish(again) and records.stats.already_there == before.already_there + 1  # first one won
    assert records.find([rec.node_key]) == [rec]
    # one probe, more keys than one etcd transaction takes: answers in order
    many = [record(parent, b"m%d" % i) for i in range(MAX_TXN_OPS + 5)]
    for r in many[::40]:
        records.publish(r)
    found = records.find([r.node_key for r in many])
    assert [f is not None for f in found] == [i % 40 == 0 for i in range(len(many))]
    assert all(f == r for f, r in zip(found, many) if f is not None)
    # a record stored under another chunk's name, or damaged: a miss, and removed
    other = record(parent, b"other")
    etcd_put(records, other.name, encode_record(rec))
    assert records.find([other.node_key]) == [None] and records.stats.corrupt == before.corrupt + 1
    assert other.node_key not in records.node_keys()
    assert rec.node_key in records.node_keys()
    records.retract(rec.node_key)
    assert records.find([rec.node_key]) == [None]
    for r in many[::40]:
        records.retract(r.node_key)
    assert records.stats.probe_errors == before.probe_errors and records.stats.as_dict()["probe_p50_ms"] is not None


# -- two worker processes -----------------------------------------------------------------------


def test_a_second_worker_process_restores_by_key_what_the_first_wrote(fluxon_service, tmp_path):
    """Separate processes, one after the other, no snapshot: the second's trie is empty."""
    specs = ["fluxon_plan:records-plan", "fluxon:records-tier"]
    env = dict(os.environ, PYTHONPATH=str(REPO), HYDRA_FULL_ERROR="0")
    results = {}
    for role in ("write", "read"):
        out = tmp_path / f"{role}.json"
        proc = subprocess.run([sys.executable, str(WORKER), role, fluxon_service.cluster_name,
                               fluxon_service.share_mem_path, str(out), *specs],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
        results[role] = json.loads(out.read_text())
    for store in ("fluxon_plan", "fluxon"):
        first, second = results["write"][store], results["read"][store]
        n = first["n"]
        assert first["records_shared"] and second["records_shared"]
        assert first["a"]["hit_depth"] == 0 and first["a"]["ingest_errors"] == 0
        assert first["metrics"]["index_published"] == n
        assert second["b"]["hit_depth"] == n, (store, second)  # every chunk, found by key alone
        assert second["b"]["bytes_written"] == 0
        assert second["metrics"]["index_adopted"] == n and second["metrics"]["index_recheck_misses"] == 0
        assert second["b"]["frame_hashes"] == first["a"]["frame_hashes"] == second["cold"]["frame_hashes"]


# -- values gone or replaced --------------------------------------------------------------------


def plan_store(fluxon_client) -> PlanTierStore:
    return PlanTierStore(plan_client=FluxonPublicPlanClient(client=fluxon_client, staging_bytes=MiB),
                         transfer=HostTransferRuntime(), overlap=False)


def close(store) -> None:
    store.close()
    if isinstance(store, PlanTierStore):
        store.plan_client.close()


@pytest.mark.parametrize("kind,fault", [("plan", "evicted"), ("tier", "evicted"), ("tier", "replaced")])
def test_a_record_whose_values_are_gone_is_a_miss_never_a_wrong_restore(fluxon_client, compose_cfg, tmp_path,
                                                                         kind, fault):
    store = plan_store(fluxon_client) if kind == "plan" else FluxonTensorTier(client=fluxon_client)
    # runtime.handout=false: the KV restore at creation is what this test faults (a session that
    # hands out frames reads the KV only where it computes: tests/test_handout.py)
    stack = build_stack(compose_cfg(f"namespace.model_fingerprint=records-gone-{kind}-{fault}", "runtime.handout=false"),
                        store=store, run_dir=tmp_path)
    gate = stack.workload
    try:
        k, a = session(stack, gate.P + gate.X)
        nodes = ready_nodes(stack)
        assert k == 0 and len(nodes) == gate.n
        victim = nodes[2]
        value = layer_keys(victim.blob.locator, 1)[0]
        if fault == "evicted":  # as Fluxon's own eviction would
            fluxon_client.remove(value)
        else:  # another writer's bytes under the key (its own checksum, not the record's)
            fluxon_client.remove(value)
            FluxonValueBackend(fluxon_client, owns_client=False).write(value, b"another writer's bytes")
        fresh = stack.new_manager(forest=NamespaceForest())  # an empty trie: only the records
        k, b = session(stack, gate.P + gate.X, manager=fresh)
        assert k == 2 and b == a == cold(stack, gate.P + gate.X)  # the whole prefix before the chunk
        metrics = stack.metrics.as_dict()
        assert metrics["invalidations"] >= 1
        if fault == "replaced":
            assert store.stats.corrupt_values >= 1
        # the broken chunk was rewritten whole by that session, and its record published again
        (found,) = store.records.find([victim.node_key])
        assert found is not None and found.depth == victim.depth
    finally:
        for n in ready_nodes(stack):
            store.free(n.blob)
            store.free_skeleton(n.skeleton.latent_locator)
        close(store)


# -- etcd stopped -------------------------------------------------------------------------------


def test_etcd_stopped_mid_run_probes_fail_within_the_bound_and_sessions_run_cold(new_fluxon_service, compose_cfg,
                                                                                 tmp_path):
    svc = new_fluxon_service(dram="32MiB", tag="etcdstop")
    svc.start()
    bound = 2.0
    store = PlanTierStore(client="fluxon", transfer=HostTransferRuntime(), overlap=False, client_options={
        "cluster_name": svc.cluster_name, "share_mem_path": svc.share_mem_path, "op_timeout_s": bound,
        "staging_bytes": MiB})
    # runtime.handout=false: the re-check of a restore's records is what etcd's stop faults
    stack = build_stack(compose_cfg("namespace.model_fingerprint=records-etcd-stop", "runtime.handout=false"),
                        store=store, run_dir=tmp_path)
    gate = stack.workload
    etcd = svc.pids["etcd"]
    stopped = False
    try:
        k, a = session(stack, gate.P + gate.X)
        assert k == 0 and stack.metrics.as_dict()["index_published"] == gate.n
        os.kill(etcd, signal.SIGSTOP)
        stopped = True
        wait_stopped(etcd)
        t0 = time.monotonic()
        assert store.records.probe([ready_nodes(stack)[0].node_key]) is None  # cannot tell, within the bound
        assert bound - 0.5 < time.monotonic() - t0 < bound + 3
        t0 = time.monotonic()
        assert store.records.probe([ready_nodes(stack)[1].node_key]) is None  # at once now
        assert time.monotonic() - t0 < 0.5
        t1 = time.monotonic()
        k, b = session(stack, gate.P + gate.X, manager=stack.new_manager(forest=NamespaceForest()))
        assert k == 0 and b == a  # cold, right frames
        assert time.monotonic() - t1 < 30  # probes fail at once after the first: no wait per chunk
        k, c = session(stack, gate.P + gate.X)  # the local trie's hits cannot be re-checked: cold too
        assert k == 0 and c == a
        assert store.records.stats.probe_errors >= 2
        os.kill(etcd, signal.SIGCONT)
        stopped = False
        time.sleep(store.records.retry_after_s)
        k, d = session(stack, gate.P + gate.X, manager=stack.new_manager(forest=NamespaceForest()))
        assert k == gate.n and d == a  # found by key again
    finally:
        if stopped:
            os.kill(etcd, signal.SIGCONT)
        close(store)
        svc.stop()


def wait_stopped(pid: int, bound_s: float = 10.0) -> None:
    """Wait until every thread of ``pid`` is stopped. ``kill(SIGSTOP)`` returns once the signal is
    queued; the group stop reaches the other threads only when the one that takes it runs, so on
    a loaded machine etcd answered a request sent just after the kill."""
    deadline = time.monotonic() + bound_s
    while True:
        states = {}
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:  # the state follows the command name in parentheses, which may hold spaces
                states[task.name] = (task / "stat").read_text().rpartition(")")[2].split()[0]
            except (OSError, IndexError):  # the thread exited meanwhile
                continue
        if states and all(state in "Tt" for state in states.values()):
            return
        assert time.monotonic() < deadline, f"pid {pid} not stopped {bound_s} s after SIGSTOP: threads {states}"
        time.sleep(0.01)
