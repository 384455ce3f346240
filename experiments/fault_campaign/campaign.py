"""Fault campaign: nothing lost, nothing wrong, nothing stuck (issue 12).

Sessions of the synthetic runtime (tiny geometry, rolling L=7 S=3, through the real binding and
manager) run against stores while faults are injected; every session's frame hashes are checked
against a cold run of the same request. Scenarios:

- ``kill9``: a writer process (LocalDisk, durable commit, snapshot after every chunk) is killed
  with SIGKILL at a random moment mid-run, again and again on the same root; each restart loads
  the last snapshot, reconciles the store with it (`WorldKVManager.reconcile`), and replays
  every request the snapshot names;
- ``bitflip`` / ``truncate``: random single-bit flips (header or payload) or truncations of
  LocalDisk value files, then every request again;
- ``enospc``: a LocalDisk root on a 256 KiB tmpfs (a disk that fills; needs root to mount,
  otherwise the row says skipped), many distinct requests;
- ``full_store``: a memory store of 8 chunks, 12+ sessions over distinct images (the sinks of
  dead namespaces must not fill it);
- ``concurrent``: several threads running sessions with shared prefixes on one forest and one
  write-back LocalDisk store;
- ``fluxon_kill9`` / ``fluxon_plan_kill9``: a real local Fluxon service (``+store=fluxon``, or
  ``+store=fluxon_plan store.client=fluxon``); its owner (the process that owns the segment) is
  killed with SIGKILL a few ms into a chunk's write; sessions go on with the owner dead; the
  service is restarted, the store reopened and reconciled, and sessions write and restore again.
  The data in the killed owner's segment is gone with it, by design: what must hold is that no
  session gets wrong frames (a restore after the kill fails within the op bound or misses, and
  the session runs cold), that the manager invalidates what died (``gone_with_owner``) and that
  nothing ready after recovery lacks its values. Needs fluxon-py, etcd and a private network
  namespace (run the campaign under ``tools/netns-run.sh``); the rows say skipped
  otherwise.

Per scenario: faults injected, sessions run, wrong outputs (frames differ from cold: must be 0),
committed data lost (must be 0: a chunk committed and not damaged that a later session could not
restore, or a ready node whose values are gone from the store), time to recover (from the fault to
the end of the first correct session after it; for kill9 the restart, reconcile and that session;
none for full_store and concurrent, which inject no single fault to recover from; for the Fluxon
owner kills, from the kill to the end of the first correct session started after it, with
``write_again_s`` from the start of the service restart to the end of the first session whose
write committed), and counters
(invalidations, corrupt values, evictions, dropped writes). "Committed and not damaged" is read
from the disk itself (`sound_prefix`: every value present and passing its checksum), so damage a
restore has not read yet is not counted as a loss when a later restore finds it.

Run from the repository root::

    python experiments/fault_campaign/campaign.py                 # full campaign
    python experiments/fault_campaign/campaign.py short=true      # the CI version (tests/)
    tools/netns-run.sh python experiments/fault_campaign/campaign.py   # with the Fluxon rows
    python experiments/fault_campaign/campaign.py faults=kill9,bitflip          # some scenarios only
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types
import uuid
from pathlib import Path
from typing import Any, Optional, Sequence

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
import benchlib  # noqa: E402  (puts the repository root on sys.path)

from cacheseek.reuse.exact_prefix import NamespaceForest, WorldKVManager  # noqa: E402
from cacheseek.reuse.exact_prefix.keys import layer_keys  # noqa: E402
from cacheseek.kv.records import decode_record, record_name  # noqa: E402
from cacheseek.reuse.exact_prefix.telefuser_lingbot import (  # noqa: E402
    LingBotWorldKVBinding,
    make_rolling_config,
)
from cacheseek.runtime.synthetic import SyntheticImage, SyntheticRuntimeFactory  # noqa: E402

L, S, C = 7, 3, 3
FULL_CONF = dict(requests=4, chunks=4, rounds=3, kills=6, flips=8, truncations=6, enospc_sessions=24,
                 full_sessions=16, threads=4, sessions_per_thread=6, owner_kills=3, fluxon_requests=2, seed=12,
                 swaps=10, snapshot_flips=6, fifos=4, shared_faults=2)
SHORT_CONF = dict(requests=2, chunks=3, rounds=1, kills=2, flips=2, truncations=2, enospc_sessions=6,
                  full_sessions=12, threads=2, sessions_per_thread=2, owner_kills=1, fluxon_requests=2, seed=12,
                  swaps=5, snapshot_flips=2, fifos=2, shared_faults=1)
OP_TIMEOUT_S = 0.5  # store.op_timeout_s of the fifo and stalled rows (a stalled medium's bound)
TRUST_FAULTS = ("swap", "crafted_snapshot", "links", "fifo", "stalled", "enospc_recovery", "shared_root")
FAULTS = ("kill9", "bitflip", "truncate", "enospc", "full_store", "concurrent", *TRUST_FAULTS,
          "fluxon_kill9", "fluxon_plan_kill9")
FLUXON_OP_TIMEOUT_S = 5.0  # every Fluxon call of the stores under test; generous for a loaded 2-core VM


# -- sessions -------------------------------------------------------------------------------------


def factory() -> SyntheticRuntimeFactory:
    return SyntheticRuntimeFactory(geometry="tiny", local_attn_size=L, sink_size=S)


def image(i: int) -> SyntheticImage:
    return SyntheticImage("RGB", (4, 4), bytes((i * 31 + j * 7) % 256 for j in range(48)))


def request(i: int, chunks: int, *, branch: int = 0) -> list[list[float]]:
    """Request ``i``: chunk 0 shared by all requests, the rest its own (``branch`` forks at 2)."""
    out = []
    for c in range(chunks):
        v = 0 if c == 0 else i + 1 + (branch * 100 if c >= 2 else 0)
        out.append([0.1 * c + v, -0.05 * c, 0.02 * v, 0.3 * (c % 2)])
    return out


_COLD: dict = {}


def cold(actions: Sequence[Sequence[float]], img: int = 0) -> list[bytes]:
    key = (tuple(map(tuple, actions)), img)
    if key not in _COLD:
        _COLD[key] = factory().make(actions, hooks=None, image=image(img)).generate()
    return _COLD[key]


def manager(store: Any, forest: Optional[NamespaceForest] = None, **kw: Any) -> WorldKVManager:
    cfg = make_rolling_config(local_attn_size=L, sink_size=S, chunk_size=C)
    return WorldKVManager(forest if forest is not None else NamespaceForest(), store, cfg, **kw)


def session(mgr: WorldKVManager, actions, *, img: int = 0, ingest: bool = True, snapshot: Optional[str] = None,
            on_chunk: Optional[Any] = None):
    """One session; returns (restored depth, frames correct). ``on_chunk(idx)`` runs as chunk
    ``idx`` is finalized, just before its write."""
    b = LingBotWorldKVBinding(mgr, mgr.forest, ingest_enabled=ingest, snapshot_path=snapshot,
                              snapshot_on_finalize=snapshot is not None)
    if on_chunk is not None:
        inner = b.on_chunk_finalized

        def hooked(runtime, idx, denoised):
            on_chunk(idx)
            inner(runtime, idx, denoised)

        b.on_chunk_finalized = hooked
    hashes = factory().make(actions, hooks=b, image=image(img)).generate()
    _KEYS[(tuple(map(tuple, actions)), img)] = (b.root, list(b.actions))
    flush = getattr(mgr.store, "flush", None)
    if flush is not None:
        flush()
    return b.last_fast_forward, hashes == cold(actions, img)


def lost_values(mgr: WorldKVManager) -> int:
    """Ready (committed) nodes whose values are not all in the store."""
    contains = mgr.store.contains
    lost = 0
    with mgr.forest.lock:
        ready = [n for ns in mgr.forest.namespaces() for n in ns.iter_nodes() if n.has_kv]
    for n in ready:
        keys = [k for i in range(n.blob.n_layers) for k in layer_keys(n.blob.locator, i)]
        keys.append(n.skeleton.latent_locator)
        lost += not all(contains(keys))
    return lost


def sound_prefix(store: Any, nodes: list) -> int:
    """Leading committed chunks every value of which is in ``store`` and passes its checksum
    (read straight from the disk backend: no side effect), and whose chunk record (the commit point
    other processes and the restore's re-check read) is too: what a restore must reach."""
    from cacheseek.errors import CorruptValueError

    import stat

    def regular(key: str) -> bool:  # never open a FIFO or follow a link to check a value
        try:
            return stat.S_ISREG(os.lstat(store.disk.path_of(key)).st_mode)
        except OSError:
            return False

    depth = 0
    for n in nodes:
        if not n.has_kv or n.skeleton is None:
            break
        keys = [n.skeleton.latent_locator] + [k for i in range(n.blob.n_layers) for k in layer_keys(n.blob.locator, i)]
        try:
            if not all(regular(k) for k in keys) or any(store.disk.read(k) is None for k in keys):
                break
            if store.records.shared:  # the record, read raw and checked (no side effect)
                rec = record_name(n.node_key)
                if not regular(rec):
                    break
                decode_record(n.node_key, store.disk.read_raw(rec) or b"")
        except CorruptValueError:
            break
        depth += 1
    return depth


_KEYS: dict = {}


def chain_nodes(mgr: WorldKVManager, actions, img: int = 0) -> list:
    """The nodes of a request's chain that exist in ``mgr``'s forest, by depth (the root and the
    action keys are the binding's, taken from a session of that request)."""
    key = (tuple(map(tuple, actions)), img)
    if key not in _KEYS:
        from cacheseek.stores.memory import InMemoryTierStore

        session(manager(InMemoryTierStore()), actions, img=img, ingest=False)
    root, action_keys = _KEYS[key]
    ns = mgr.forest.resolve(root)
    out, node = [], ns.root if ns is not None else None
    for a in action_keys if node is not None else []:
        node = node.children.get(a)
        if node is None:
            break
        out.append(node)
    return out


def prime(requests: Sequence[tuple[Any, int]]) -> None:
    """Compute the cold references and the chain keys of these ``(actions, img)`` requests up
    front, so a time to recover measures recovery, not the reference runs."""
    for actions, img in requests:
        cold(actions, img)
        chain_nodes(manager(_memory()), actions, img)


def _memory() -> Any:
    from cacheseek.stores.memory import InMemoryTierStore

    return InMemoryTierStore()


def row(fault: str, **kw: Any) -> dict[str, Any]:
    base = dict(fault=fault, injected=0, sessions=0, wrong_outputs=0, committed_lost=0, recover_s=None)
    base.update(kw)
    return base


# -- scenarios ------------------------------------------------------------------------------------


def damage_scenario(cfg: dict, kind: str, work: Path, rng: random.Random) -> dict[str, Any]:
    """Flip bits in (or truncate) value files, then replay every request."""
    from cacheseek.stores.localdisk import LocalDiskTierStore

    store = LocalDiskTierStore(str(work / f"{kind}-kv"))
    mgr = manager(store)
    reqs = [request(i, cfg["chunks"]) for i in range(cfg["requests"])]
    prime([(a, 0) for a in reqs])
    out = row(kind)
    recover: list[float] = []
    try:
        for actions in reqs:
            _, ok = session(mgr, actions)
            out["sessions"] += 1
            out["wrong_outputs"] += not ok
        n_faults = cfg["flips"] if kind == "bitflip" else cfg["truncations"]
        for r in range(cfg["rounds"]):
            files = sorted(store.disk.path_of(k) for k in store.keys())
            for path in rng.sample(files, min(n_faults, len(files))):
                data = bytearray(path.read_bytes())
                if kind == "bitflip":
                    at = rng.randrange(len(data))
                    data[at] ^= 1 << rng.randrange(8)
                else:
                    data = data[: rng.randrange(len(data))]
                path.write_bytes(bytes(data))
                out["injected"] += 1
            t_fault = time.perf_counter()
            first = True
            for actions in reqs:
                expect = sound_prefix(store, chain_nodes(mgr, actions))
                depth, ok = session(mgr, actions)
                out["sessions"] += 1
                out["wrong_outputs"] += not ok
                out["committed_lost"] += max(0, expect - depth)
                if first and ok:
                    recover.append(time.perf_counter() - t_fault)
                    first = False
            out["committed_lost"] += lost_values(mgr)
            for actions in reqs:  # what is sound restores (damage not read yet is found now)
                expect = sound_prefix(store, chain_nodes(mgr, actions))
                depth, ok = session(mgr, actions, ingest=False)
                out["sessions"] += 1
                out["wrong_outputs"] += not ok
                out["committed_lost"] += max(0, expect - depth)
        out.update(recover_s=max(recover) if recover else None, invalidations=mgr.metrics.invalidations,
                   corrupt_values=store.stats.corrupt_values, restore_failures=mgr.metrics.restore_failures)
    finally:
        store.close()
    return out


WRITER = r"""
import sys, random
sys.path.insert(0, sys.argv[1])
import campaign
from cacheseek.reuse.exact_prefix import load_forest_snapshot
from cacheseek.stores.localdisk import LocalDiskTierStore
root, snap, chunks, nreq, seed = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
store = LocalDiskTierStore(root)
mgr = campaign.manager(store, load_forest_snapshot(snap))
mgr.reconcile()
print("ready", flush=True)
rng = random.Random(seed)
while True:
    i = rng.randrange(nreq)
    campaign.session(mgr, campaign.request(i, chunks, branch=rng.randrange(3)), snapshot=snap)
"""


def kill9_scenario(cfg: dict, work: Path, rng: random.Random) -> dict[str, Any]:
    """SIGKILL a LocalDisk writer mid-chunk, restart, check what its last snapshot committed."""
    from cacheseek.reuse.exact_prefix import load_forest_snapshot
    from cacheseek.stores.localdisk import LocalDiskTierStore

    root, snap = str(work / "kill9-kv"), str(work / "kill9-forest.json")
    script = work / "writer.py"
    script.write_text(WRITER)
    out = row("kill9", restarts=0)
    prime([(request(i, cfg["chunks"], branch=b), 0) for i in range(cfg["requests"]) for b in range(3)])
    recover: list[float] = []
    for k in range(cfg["kills"]):
        proc = subprocess.Popen([sys.executable, str(script), str(HERE), root, snap, str(cfg["chunks"]),
                                 str(cfg["requests"]), str(rng.randrange(1 << 30))],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                env={**os.environ, "PYTHONPATH": str(benchlib.REPO)})
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.3, 1.5))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        t_fault = time.perf_counter()
        out["injected"] += 1
        # restart: the last snapshot says what was committed
        store = LocalDiskTierStore(root)
        try:
            mgr = manager(store, load_forest_snapshot(snap))
            mgr.reconcile()
            out["restarts"] += 1
            out["committed_lost"] += lost_values(mgr)
            first = True
            for i in range(cfg["requests"]):
                for branch in range(3):
                    actions = request(i, cfg["chunks"], branch=branch)
                    expect = sum(1 for _ in _leading_ready(chain_nodes(mgr, actions)))
                    depth, ok = session(mgr, actions, ingest=False)
                    out["sessions"] += 1
                    out["wrong_outputs"] += not ok
                    out["committed_lost"] += max(0, expect - depth)
                    if first and ok:
                        recover.append(time.perf_counter() - t_fault)
                        first = False
        finally:
            store.close()
    out["recover_s"] = max(recover) if recover else None
    return out


def _leading_ready(nodes: list):
    for n in nodes:
        if not n.has_kv:
            return
        yield n


def enospc_scenario(cfg: dict, work: Path) -> dict[str, Any]:
    from cacheseek.stores.localdisk import LocalDiskTierStore

    where = work / f"tmpfs-{uuid.uuid4().hex[:6]}"
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(where)], capture_output=True)
    if done.returncode != 0:
        return row("enospc", skipped=f"cannot mount a tmpfs: {done.stderr.strip()[:80]!r}")
    out = row("enospc")
    prime([(request(s, cfg["chunks"]), s) for s in range(cfg["enospc_sessions"])])
    try:
        store = LocalDiskTierStore(str(where / "kv"))
        mgr = manager(store)
        t0 = None
        for s in range(cfg["enospc_sessions"]):
            actions = request(s, cfg["chunks"])
            _, ok = session(mgr, actions, img=s)
            out["sessions"] += 1
            out["wrong_outputs"] += not ok
            if store.stats.capacity_bytes is not None and t0 is None:
                t0 = time.perf_counter()
                out["injected"] = 1  # the disk filled (first ENOSPC)
            elif t0 is not None and out["recover_s"] is None and ok:
                out["recover_s"] = time.perf_counter() - t0
        depth, ok = session(mgr, request(cfg["enospc_sessions"] - 1, cfg["chunks"]),
                            img=cfg["enospc_sessions"] - 1, ingest=False)
        out["sessions"] += 1
        out["wrong_outputs"] += not ok
        out["committed_lost"] += lost_values(mgr)
        m = mgr.metrics.as_dict()
        out.update(evictions=m["evictions"], dropped_writes=m["dropped_writes"], failed_writes=m["failed_writes"],
                   last_session_depth=depth, learned_capacity=store.stats.capacity_bytes)
        store.close()
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)
    return out


def full_store_scenario(cfg: dict) -> dict[str, Any]:
    from cacheseek.stores.memory import InMemoryTierStore

    probe = InMemoryTierStore()
    session(manager(probe), request(0, cfg["chunks"]))
    per_chunk = probe.usage().used_bytes // cfg["chunks"]
    store = InMemoryTierStore(capacity_bytes=8 * per_chunk)
    mgr = manager(store)
    out = row("full_store", injected=1)
    for s in range(cfg["full_sessions"]):
        _, ok = session(mgr, request(0, cfg["chunks"]), img=s)
        out["sessions"] += 1
        out["wrong_outputs"] += not ok
    depth, ok = session(mgr, request(0, cfg["chunks"]), img=cfg["full_sessions"] - 1, ingest=False)
    out["sessions"] += 1
    out["wrong_outputs"] += not ok
    out["committed_lost"] += lost_values(mgr)
    pinned = sum(n.blob.nbytes for ns in mgr.forest.namespaces() for n in ns.iter_nodes() if n.pinned and n.has_kv)
    m = mgr.metrics.as_dict()
    out.update(dropped_writes=m["dropped_writes"], evictions=m["evictions"], last_session_depth=depth,
               pinned_fraction=round(pinned / store.capacity_bytes, 3))
    return out


def concurrent_scenario(cfg: dict, work: Path, rng: random.Random) -> dict[str, Any]:
    from cacheseek.stores.localdisk import LocalDiskTierStore

    store = LocalDiskTierStore(str(work / "concurrent-kv"), write_back=True)
    forest = NamespaceForest()
    out = row("concurrent", injected=cfg["threads"])
    results: list[tuple[int, bool]] = []
    lock = threading.Lock()
    seeds = [rng.randrange(1 << 30) for _ in range(cfg["threads"])]

    def worker(seed: int) -> None:
        r = random.Random(seed)
        mgr = manager(store, forest)
        for _ in range(cfg["sessions_per_thread"]):
            actions = request(r.randrange(cfg["requests"]), cfg["chunks"], branch=r.randrange(2))
            res = session(mgr, actions)
            with lock:
                results.append(res)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(s,)) for s in seeds]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    out["stuck_threads"] = sum(t.is_alive() for t in threads)
    store.flush()
    mgr = manager(store, forest)
    out.update(sessions=len(results), wrong_outputs=sum(not ok for _, ok in results),
               committed_lost=lost_values(mgr), all_sessions_s=round(time.perf_counter() - t0, 3))
    store.close()
    return out


def fluxon_problem() -> Optional[str]:
    """Why a real local Fluxon service cannot start here, or None."""
    from cacheseek.fluxon_service.service import local_service_problem

    return local_service_problem()


def open_fluxon_store(kind: str, svc: Any) -> Any:
    """``+store=fluxon`` (the per-layer tier, ``kind="fluxon"``) or ``+store=fluxon_plan
    store.client=fluxon`` (the Plan tier; fluxon-py 0.2.4 has no Plan API, so the public client's
    emulation), attached to ``svc``, every Fluxon call bounded by FLUXON_OP_TIMEOUT_S."""
    opts = dict(cluster_name=svc.cluster_name, share_mem_path=svc.share_mem_path, op_timeout_s=FLUXON_OP_TIMEOUT_S)
    if kind == "fluxon":
        from cacheseek.stores.fluxon_bytes import FluxonTensorTier

        return FluxonTensorTier(attach_timeout_s=60.0, **opts)
    from cacheseek.stores.plan_tier import PlanTierStore
    from cacheseek.transfer.host_transfer import HostTransferRuntime

    return PlanTierStore(client="fluxon", transfer=HostTransferRuntime(), overlap=False,
                         client_options=dict(staging_bytes="16MiB", **opts))


def _tally(out: dict, result: tuple[int, bool]) -> bool:
    out["sessions"] += 1
    out["wrong_outputs"] += not result[1]
    return result[1]


def fluxon_owner_kill9_round(cfg: dict, work: Path, rng: random.Random, kind: str) -> dict[str, Any]:
    """One owner kill: a real local Fluxon service, a store on it and a forest in this process;
    sessions commit chunks; the owner (the process that owns the segment) gets SIGKILL a few ms
    into a chunk's write; sessions go on with the owner dead; the service is restarted, the store
    reopened and reconciled, and sessions write and restore again. Run it in a process of its own
    (`fluxon_owner_kill9_scenario`): fluxon-py's side effects of the fault end that process."""
    name = f"{kind}_kill9"
    from cacheseek.fluxon_service.service import FluxonService

    tag = f"{os.getpid()}{kind.replace('_', '')}"
    svc = FluxonService(work / f"{name}-{os.getpid()}", dram="64MiB", cluster_name=f"csfault{tag}",
                        share_mem_path=f"/dev/shm/cacheseek-fault-{tag}", ready_timeout_s=120.0)
    reqs = [request(i, cfg["chunks"]) for i in range(cfg["fluxon_requests"])]
    victim = request(100 + rng.randrange(1000), cfg["chunks"])  # written as the owner dies
    prime([(a, 0) for a in reqs + [victim]])
    forest = NamespaceForest()
    out = row(name, restarts=0, gone_with_owner=0, dead_owner_sessions=0, restore_errors=0,
              write_again_s=None, restart_s=None)
    svc.start()
    store = open_fluxon_store(kind, svc)
    try:
        mgr = manager(store, forest)
        for actions in reqs:  # committed before the kill
            _tally(out, session(mgr, actions))
        owner, kill_at, delay = svc.pids["owner"], rng.randrange(1, cfg["chunks"]), rng.uniform(0.0, 0.03)
        killed: list[float] = []

        def kill() -> None:
            os.kill(owner, signal.SIGKILL)
            killed.append(time.perf_counter())

        timers: list[threading.Timer] = []

        def kill_during_write(idx: int) -> None:
            if idx == kill_at and not timers:  # a few ms into the write of chunk kill_at
                timers.append(threading.Timer(delay, kill))
                timers[0].start()

        _tally(out, session(mgr, victim, on_chunk=kill_during_write))
        if timers:
            timers[0].join()
        else:
            kill()
        out["injected"] += 1
        failures = mgr.metrics.restore_failures
        for actions in reqs:  # the owner is dead: restores fail within the bound, sessions run cold
            ok = _tally(out, session(mgr, actions))
            out["dead_owner_sessions"] += 1
            if ok and out["recover_s"] is None:
                out["recover_s"] = time.perf_counter() - killed[0]
        out["restore_errors"] += mgr.metrics.restore_failures - failures
        # restart the service, reopen the store: reconcile invalidates what died with the owner
        t_restart = time.perf_counter()
        store.close()  # its fluxon-py client stays open while calls are stuck in the dead owner
        svc.stop()
        svc.start()
        out["restart_s"] = round(time.perf_counter() - t_restart, 3)
        store = open_fluxon_store(kind, svc)
        mgr = manager(store, forest)
        out["gone_with_owner"] += mgr.reconcile()["invalidated"]
        out["restarts"] += 1
        for actions in reqs:
            _tally(out, session(mgr, actions))
            if out["write_again_s"] is None and any(n.has_kv for n in chain_nodes(mgr, actions)):
                out["write_again_s"] = round(time.perf_counter() - t_restart, 3)
        for actions in reqs:  # what was written since the restart restores
            expect = sum(1 for _ in _leading_ready(chain_nodes(mgr, actions)))
            depth, ok = session(mgr, actions, ingest=False)
            _tally(out, (depth, ok))
            out["committed_lost"] += max(0, expect - depth)
        out["committed_lost"] += lost_values(mgr)
    finally:
        store.close()
        svc.stop()
    return out


FLUXON_CHILD = "fluxon-child"
_SUMMED = ("injected", "sessions", "wrong_outputs", "committed_lost", "restarts", "gone_with_owner",
           "dead_owner_sessions", "restore_errors")


def fluxon_owner_kill9_scenario(cfg: dict, work: Path, rng: random.Random, kind: str) -> dict[str, Any]:
    """``owner_kills`` rounds of `fluxon_owner_kill9_round`, each in a child process; one row
    (counts summed, times the worst). A child keeps fluxon-py's side effects of the fault to
    itself: a 0.2.4 client with calls stuck in the dead owner cannot be closed, and a client left
    open ends its whole process with status 1 (std::process::exit from its etcd lease keepalive)
    about a minute after its etcd stops, which a service restart does."""
    name = f"{kind}_kill9"
    problem = fluxon_problem()
    if problem:
        return row(name, skipped=problem[:100])
    out = row(name, restarts=0, gone_with_owner=0, dead_owner_sessions=0, restore_errors=0,
              write_again_s=None, restart_s=None)
    for _ in range(cfg["owner_kills"]):
        args = [sys.executable, str(Path(__file__).resolve()), FLUXON_CHILD, kind, json.dumps(cfg),
                str(rng.randrange(1 << 30)), str(work)]
        done = subprocess.run(args, capture_output=True, text=True, timeout=1800,
                              env={**os.environ, "PYTHONPATH": str(benchlib.REPO)})
        rows = [line[4:] for line in done.stdout.splitlines() if line.startswith("ROW ")]
        if not rows:
            tail = "\n".join(done.stderr.splitlines()[-15:])
            raise RuntimeError(f"the {name} round exited with {done.returncode} and no row:\n{tail}")
        got = json.loads(rows[-1])
        for key in _SUMMED:
            out[key] += got[key]
        for key in ("recover_s", "write_again_s", "restart_s"):
            if got[key] is not None:
                out[key] = max(out[key] or 0.0, got[key])
    return out


# -- the campaign ---------------------------------------------------------------------------------


def run(cfg: dict, out_dir: Optional[Path] = None, faults: Sequence[str] = FAULTS) -> dict[str, Any]:
    import disk_trust  # the issue-23 classes (beside this file)

    cfg = {"op_timeout_s": OP_TIMEOUT_S, **cfg}
    me = types.SimpleNamespace(**globals())  # this module's helpers, however it was loaded (tests/)
    rng = random.Random(cfg["seed"])
    rows = []
    with tempfile.TemporaryDirectory(prefix="fault-campaign-") as tmp:
        work = Path(tmp)
        scenarios = {"kill9": lambda: kill9_scenario(cfg, work, rng),
                     "bitflip": lambda: damage_scenario(cfg, "bitflip", work, rng),
                     "truncate": lambda: damage_scenario(cfg, "truncate", work, rng),
                     "enospc": lambda: enospc_scenario(cfg, work),
                     "full_store": lambda: full_store_scenario(cfg),
                     "concurrent": lambda: concurrent_scenario(cfg, work, rng),
                     **{name: (lambda fn=fn: fn(me, cfg, work, rng)) for name, fn in disk_trust.SCENARIOS.items()},
                     "fluxon_kill9": lambda: fluxon_owner_kill9_scenario(cfg, work, rng, "fluxon"),
                     "fluxon_plan_kill9": lambda: fluxon_owner_kill9_scenario(cfg, work, rng, "fluxon_plan")}
        progress = benchlib.Progress(len(faults), "faults")
        for name, fn in [(f, scenarios[f]) for f in faults]:
            t0 = time.perf_counter()
            r = fn()
            r["wall_s"] = round(time.perf_counter() - t0, 2)
            rows.append(r)
            progress.step(f"{name}: {json.dumps({k: v for k, v in r.items() if k != 'fault'})}")
    res = dict(conf=cfg, rows=rows, totals=dict(
        faults=sum(r["injected"] for r in rows), sessions=sum(r["sessions"] for r in rows),
        wrong_outputs=sum(r["wrong_outputs"] for r in rows), committed_lost=sum(r["committed_lost"] for r in rows),
        hung=sum(r.get("hung", 0) for r in rows), outside_changes=sum(r.get("outside_changes", 0) for r in rows)),
        env={**benchlib.env_info(), **versions()}, command=" ".join([Path(sys.argv[0]).name] + sys.argv[1:]))
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        benchlib.write_json(out_dir / "results.json", res)
        (out_dir / "results.md").write_text(table(rows, res["totals"]))
        plot(rows, out_dir / "fault_campaign.png")
    return res


def versions() -> dict[str, Any]:
    """The commit the campaign ran at (``-dirty`` with local changes) and fluxon-py's version."""
    import importlib.metadata

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=benchlib.REPO, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    commit = git("rev-parse", "HEAD") or None
    if commit and git("status", "--porcelain", "--untracked-files=no"):
        commit += "-dirty"
    try:
        fluxon = importlib.metadata.version("fluxon-py")
    except importlib.metadata.PackageNotFoundError:
        fluxon = None
    return {"commit": commit, "fluxon_py": fluxon}


def table(rows: list[dict], totals: dict) -> str:
    lines = ["| fault | injected | sessions | wrong outputs | committed lost | time to recover (s) | notes |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    core = {"fault", "injected", "sessions", "wrong_outputs", "committed_lost", "recover_s", "wall_s"}
    for r in rows:
        notes = ", ".join(f"{k}={v}" for k, v in r.items() if k not in core)
        rec = "-" if r["recover_s"] is None else f"{r['recover_s']:.3f}"
        lines.append(f"| {r['fault']} | {r['injected']} | {r['sessions']} | {r['wrong_outputs']} | "
                     f"{r['committed_lost']} | {rec} | {notes} |")
    lines.append(f"| **total** | {totals['faults']} | {totals['sessions']} | {totals['wrong_outputs']} | "
                 f"{totals['committed_lost']} | | |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["fault"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(15, 5))
    a.bar(names, [r["sessions"] for r in rows], label="sessions", color="#4c72b0")
    a.bar(names, [r["wrong_outputs"] for r in rows], label="wrong outputs", color="#c44e52")
    a.bar(names, [r["committed_lost"] for r in rows], bottom=[r["wrong_outputs"] for r in rows],
          label="committed lost", color="#dd8452")
    a.set_title("sessions per fault (wrong outputs and lost data must be 0)")
    a.legend()
    b.bar(names, [r["recover_s"] or 0.0 for r in rows], color="#55a868")
    b.set_title("time to recover (s): fault to first correct session")
    for ax in (a, b):
        ax.set_xticks(range(len(names)), names, rotation=40, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str]) -> dict[str, Any]:
    import logging

    quiet = logging.getLogger("cacheseek")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)  # the faults are counted, not logged
    try:
        return _main(argv)
    finally:
        quiet.setLevel(level)  # main() also runs inside a test session: give its logging back


def _main(argv: Sequence[str]) -> dict[str, Any]:
    if argv and argv[0] == FLUXON_CHILD:  # a round of fluxon_owner_kill9_scenario: its row, then exit at once
        kind, cfg, seed, work = argv[1], json.loads(argv[2]), int(argv[3]), Path(argv[4])
        print("ROW " + json.dumps(fluxon_owner_kill9_round(cfg, work, random.Random(seed), kind)), flush=True)
        os._exit(0)  # not through fluxon-py's exit handlers, which wait on clients stuck in the dead owner
    args = dict(a.split("=", 1) for a in argv)
    short = args.pop("short", "false").lower() == "true"
    cfg = dict(SHORT_CONF if short else FULL_CONF)
    out_dir = Path(args.pop("out_dir", str(HERE / ("results_short" if short else "results"))))
    faults = [f for f in args.pop("faults", ",".join(FAULTS)).split(",") if f]
    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        raise SystemExit(f"unknown faults {unknown}; known: {', '.join(FAULTS)}")
    for key, value in args.items():
        if key not in cfg:
            raise SystemExit(f"unknown option {key!r}; known: {sorted(cfg)} short out_dir faults")
        cfg[key] = int(value)
    res = run(cfg, out_dir, faults)
    print(table(res["rows"], res["totals"]))
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
