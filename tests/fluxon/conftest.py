"""Fixtures of the real-Fluxon tests (marker ``fluxon``).

They start a real local service (etcd + KV master + owner, `FluxonService`, the same code as
``tools/fluxon_service.py``) with a small segment. The master and owner advertise a non-loopback
address, so the fixtures refuse to start (skip, with the reason) unless the whole test process
runs inside a private network namespace made by ``tools/netns-run.sh``; they also skip
when fluxon-py or an etcd binary is missing (``bash tools/install_fluxon_deps.sh`` installs both).

CI runs them as::

    tools/netns-run.sh python -m pytest -m fluxon tests/fluxon -q

Each Fluxon op costs ~10-20 ms on a 2-core machine and the idle master and owner busy-poll a
core each: keep payloads small and services short-lived.

Nothing is left behind: every service `make_service` made is stopped at the end of the session
and at exit, whatever its test did; a test process that crashes runs neither, and then
``tools/netns-run.sh`` ends it all (its PID namespace ends every process left, etcd included; its
private /dev/shm and /tmp/fluxon_ipc mounts vanish). A fresh-clone run once crashed with SIGSEGV
(SEGV_ACCERR, a write to a read-only mapping) after 38 tests, as test_plan_faults.py's
test_service_stopped_mid_run began (issue 23); on this branch a full run (45 passed) and two runs
of test_plan_conformance.py with test_plan_faults.py (13 passed each) did not reproduce it; a second
full run, on a machine loaded far beyond its 2 cores, ended with status 1 and no report after 42
tests, three after test_service_stopped_mid_run: what fluxon-py 0.2.4 does about a minute after
the etcd of a client it could not close stops (experiments/fault_campaign/README.md), unconfirmed. fluxon-py 0.2.4 maps the owner's segment twice in each client,
read-only for views and read-write for puts (`cacheseek.fluxon.segment`), so a native write that
lands in the read-only one (a put into a stale address after a mapping was replaced) would fault
this way; the same kind of crash was seen when a client was reopened on a restarted owner while the
old client was open (experiments/fault_campaign/README.md). The cause is not confirmed.
"""

from __future__ import annotations

import atexit
import itertools
import os
import sys
from pathlib import Path
from typing import Optional

import pytest

from cacheseek.fluxon_service.service import FluxonService, local_service_problem

# The Plan tests here reuse the Plan test kit (recording proxies, the cold ring, the fake Fluxon
# with a Plan API) the way tests/plan/conftest.py does: from its folder on sys.path.
_PLAN_TESTS = str(Path(__file__).resolve().parents[1] / "plan")
if _PLAN_TESTS not in sys.path:
    sys.path.insert(0, _PLAN_TESTS)

CI_COMMAND = "tools/netns-run.sh python -m pytest -m fluxon tests/fluxon -q"
OP_TIMEOUT_S = 10.0  # generous for a loaded 2-core CI machine; the fault test uses 5 s
_names = itertools.count(1)


def fluxon_skip_reason() -> Optional[str]:
    """Why real-Fluxon tests cannot run here, or None."""
    problem = local_service_problem()
    if problem:
        return f"{problem} (the fluxon tests run as: {CI_COMMAND})"
    return None


_made: list[FluxonService] = []  # every service of this session, stopped at its end whatever happened


def make_service(base: Path, *, dram: str = "64MiB", tag: str = "") -> FluxonService:
    """A service with a cluster name and /dev/shm folder unique to this test process; stopped
    (processes, segment and IPC folders) at the end of the session even when the test that made
    it failed or never stopped it (`_stop_every_service`, also at exit)."""
    n = next(_names)
    name = f"cstest{os.getpid()}n{n}{tag}"
    svc = FluxonService(base / name, dram=dram, cluster_name=name,
                        share_mem_path=f"/dev/shm/cacheseek-test-{os.getpid()}-{n}",
                        ready_timeout_s=90.0)
    _made.append(svc)
    return svc


def _stop_every_service() -> None:
    """Stop what is left (`FluxonService.stop` is idempotent). A crashed test process runs none of
    this: tools/netns-run.sh then ends the namespace's processes and its /dev/shm and IPC files."""
    while _made:
        svc = _made.pop()
        try:
            svc.stop()
        except Exception as exc:  # noqa: BLE001 - the next service must still be stopped
            print(f"fluxon test cleanup: stopping {svc!r} failed: {exc!r}", file=sys.stderr)


atexit.register(_stop_every_service)


@pytest.fixture(scope="session", autouse=True)
def _no_service_left_behind():
    yield
    _stop_every_service()


@pytest.fixture(scope="session")
def fluxon_env() -> None:
    """Skips the requesting test unless a real service can be started here; fails it instead
    under ``CACHESEEK_REQUIRE_FLUXON=1`` (what .ci/run sets), so CI cannot pass by skipping."""
    reason = fluxon_skip_reason()
    if reason:
        if os.environ.get("CACHESEEK_REQUIRE_FLUXON") == "1":
            pytest.fail(f"CACHESEEK_REQUIRE_FLUXON=1 but no real Fluxon service can start: {reason}")
        pytest.skip(reason)


@pytest.fixture(scope="session")
def fluxon_service(fluxon_env, tmp_path_factory):
    """One 64 MiB service for the whole session."""
    svc = make_service(tmp_path_factory.mktemp("fluxon"), dram="64MiB", tag="main")
    svc.start()
    try:
        yield svc
    finally:
        svc.stop()


@pytest.fixture(scope="session")
def fluxon_client(fluxon_service):
    """One client attached to the session service (attaching costs ~3 s: share it)."""
    from cacheseek.fluxon.client import FluxonClient

    client = FluxonClient(fluxon_service.cluster_name, fluxon_service.share_mem_path,
                          op_timeout_s=OP_TIMEOUT_S, attach_timeout_s=60.0)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def new_fluxon_service(fluxon_env, tmp_path):
    """new_fluxon_service(dram="32MiB", tag="") -> a not-yet-started service of its own; the
    fixture stops it at the end of the test."""
    made = []

    def _make(dram: str = "32MiB", tag: str = "") -> FluxonService:
        svc = make_service(tmp_path, dram=dram, tag=tag)
        made.append(svc)
        return svc

    yield _make
    for svc in made:
        svc.stop()


@pytest.fixture
def key_prefix(request) -> str:
    """A key prefix unique to the test, so tests sharing the session service never collide."""
    return f"{request.node.name}/"
