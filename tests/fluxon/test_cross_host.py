"""One Fluxon cache over two emulated hosts (tools/emulated_hosts.py): host ``a`` runs the control
plane and an owner, host ``b`` an owner that joined it; each host has its own hostname, /tmp and
/dev/shm, so a value one host put and the other reads crossed the link between them (b's
/proc/net/dev counts it). The faults hit b's owner (the control plane stays up): reads on a are
bounded, a miss or the exact bytes, never other bytes.

The module's name sorts first in tests/fluxon, so it runs before the session's single-host
service starts: five busy-polling Fluxon processes on a 2-core machine starve the workers.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

pytestmark = pytest.mark.fluxon

OP_TIMEOUT_S = 3.0
BOUND_S = OP_TIMEOUT_S + 2.0  # an answer, hit or not, within this (the peer's own overhead included)
SIZE = 256 << 10


@pytest.fixture(scope="module")
def cluster(fluxon_env, tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("emulated hosts need root")
    from emulated_hosts import EmulatedHosts
    from multi_host_demo import FluxonHosts

    shared = tmp_path_factory.mktemp("hosts")
    os.chmod(shared, 0o777)
    with EmulatedHosts(["a", "b"], shared_dir=shared, shm_size="256m", tmp_size="256m") as hosts:
        fx = FluxonHosts(hosts, dram="48MiB")
        with_cluster = fx.start()
        try:
            yield with_cluster
        finally:
            fx.close()


@pytest.fixture(scope="module")
def peers(cluster):
    made = {h: cluster.peer(h, OP_TIMEOUT_S) for h in ("a", "b")}
    yield made
    for p in made.values():
        p.close()


def _put_all(peer, prefix: str, n: int, seed0: int) -> dict[str, str]:
    from fluxon_peer import digest, payload

    expected = {}
    for i in range(n):
        key = f"{prefix}/{i}"
        out = peer.call("put", key=key, seed=seed0 + i, size=SIZE)
        assert "error" not in out, out
        expected[key] = digest(payload(seed0 + i, SIZE))
    return expected


@pytest.fixture(scope="module")
def two_host_workers(cluster):
    """tools/workers.py's workers at once, two on a and two on b (each its own process; each host
    its own hostname and /dev/shm), on the one cache: interactive sessions, no snapshot exchanged."""
    return cluster.workers(["a", "a", "b", "b"], "fluxon_plan", ["namespace.model_fingerprint=hosts-workers",
                                                                 "workload.sessions=8"], tag="two-hosts")


def test_workers_on_two_hosts_run_on_one_cache(two_host_workers):
    out = two_host_workers
    assert out["passed"], (out["failures"], out["errors"], out["mismatches"])
    assert sorted((p["worker"], p["host"]) for p in out["processes"]) == [(0, "a"), (1, "a"), (2, "b"), (3, "b")]
    assert out["all"]["sessions"] == 8 and out["all"]["chunks_restored"] > 0


def test_a_worker_on_b_adopts_what_the_worker_on_a_wrote(two_host_workers):
    adopted = sum(p["metrics"]["index_adopted"] for p in two_host_workers["processes"])
    assert adopted > 0


def test_values_cross_hosts_bit_exact_and_overwrite_and_removal_are_seen(peers):
    a, b = peers["a"], peers["b"]
    assert (a.hostname, b.hostname) == ("a", "b")
    expected = _put_all(a, "xh", 10, 100)
    remote = 0
    for key, want in expected.items():
        got = b.call("get", key=key)
        assert got["hit"] and got["digest"] == want, (key, got)
        remote += got["rx"] >= SIZE  # pulled from a's owner over the link
    assert remote >= 1, "every value landed on b's own owner: random placement, 10 values, p = 1/1024"
    replica = b.call("get", key="xh/0")
    assert replica["digest"] == expected["xh/0"] and replica["rx"] < SIZE // 4  # b's replica: local now

    from fluxon_peer import digest, payload

    new = digest(payload(999, SIZE))
    assert "error" not in b.call("put", key="xh/0", seed=999, size=SIZE)  # overwritten on b ...
    seen = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        seen.append(a.call("get", key="xh/0")["digest"])  # ... and read on a
        assert seen[-1] in (expected["xh/0"], new), seen
        if seen[-1] == new:
            break
        time.sleep(0.2)
    assert seen[-1] == new, f"a still reads the old value after 10 s: {seen}"
    assert "error" not in b.call("remove", key="xh/1")
    assert not a.call("get", key="xh/1")["hit"]
    assert a.call("get", key="xh/2")["digest"] == expected["xh/2"]


def _read_after_fault(reader, expected: dict[str, str]) -> tuple[int, int]:
    """Every read of ``expected`` answers within BOUND_S: the exact bytes or a miss/error."""
    hits = failures = 0
    for key, want in expected.items():
        t0 = time.monotonic()
        got = reader.call("get", key=key)
        elapsed = time.monotonic() - t0
        assert elapsed < BOUND_S, (key, elapsed, got)
        if got.get("hit"):
            assert got["digest"] == want, (key, got)  # never other bytes
            hits += 1
        else:
            failures += 1
    return hits, failures


@pytest.mark.parametrize("fault", ["stop", "kill"])
def test_an_owner_stopped_or_killed_mid_run_then_restarted(cluster, fault):
    """b writes 10 values (about half land on b's owner); b's owner is stopped (SIGTERM) or
    killed (SIGKILL); a's reads of them are bounded: a's share exact, b's a miss or an error.
    b's owner restarted: its old values are gone, new ones cross the link again."""
    a = cluster.peer("a", OP_TIMEOUT_S)
    b = cluster.peer("b", OP_TIMEOUT_S)
    try:
        expected = _put_all(b, f"fault-{fault}", 10, 200)
        b.close()
        if fault == "stop":
            cluster.stop_owner("b")
        else:
            cluster.kill_owner("b")
        hits, failures = _read_after_fault(a, expected)
        assert failures >= 1, "every value landed on a's owner: random placement, 10 values, p = 1/1024"
        assert hits + failures == 10
        a.close()
        if fault == "kill":
            deadline = time.monotonic() + 30  # b's service notices its owner died and stops the rest
            while (Path(cluster.hosts.shared_dir) / "service-b.json").exists() and time.monotonic() < deadline:
                time.sleep(0.2)
            cluster.running.discard("b")
        cluster.start_owner("b")
        a = cluster.peer("a", OP_TIMEOUT_S)
        b = cluster.peer("b", OP_TIMEOUT_S)
        again = _put_all(b, f"after-{fault}", 6, 300)
        for key, want in again.items():
            got = a.call("get", key=key)
            assert got["hit"] and got["digest"] == want, (key, got)
    finally:
        a.close()
        b.close()
