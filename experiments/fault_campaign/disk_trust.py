"""The fault campaign's issue-23 classes: what a LocalDisk root holds must not be trusted.

Each scenario takes the campaign module ``c`` (its sessions, cold references and counting) and
returns one row. A committed root (`committed`) is the starting point: requests of two images and
two branches written through a LocalDisk store, its forest snapshot saved in the root.

- ``swap``: pairs of self-consistent value files exchanged (K and V of a layer, two layers, two
  chunks, two namespaces, two latents), then every request again;
- ``crafted_snapshot``: the root's ``forest.json`` edited (``n_layers`` 0, 1, true, 2.7, a
  ``"pinned"`` string, a blob or latent locator of another node, bit flips, a truncation), each
  on a copy of the root, reopened as a restart does (load, reconcile, sessions); a snapshot that
  is refused counts ``refused`` (``not_config_errors`` of them raised something else than one
  clear `ConfigError`), and nothing may be deleted;
- ``links``: a shard folder that is a link to a victim folder outside the root (files named like
  values and temp files in it) and a value file linked to a victim file, then a restart and
  sessions; ``outside_changes`` counts victim files deleted, changed or added (must be 0);
- ``fifo``: value files replaced by FIFOs, then sessions (each must end: a FIFO is no value);
- ``stalled``: the real disk backend's reads, then writes, block (a hung medium) while sessions
  run (``hung`` sessions must be 0), then the medium comes back: what was committed restores, no
  file is left that the tier does not count (``orphan_files``);
- ``enospc_recovery``: a 256 KiB tmpfs shared with another tenant's file fills; the tenant
  frees its file; time to recover is from then to the end of the first session whose chunks were
  all stored (needs root to mount; skipped otherwise);
- ``shared_root``: the product's path (`build_stack`, the gate): a run commits; a second process
  holds the root open while another run starts (it shares the root live: it must pass, hitting
  what was committed, deleting nothing, ``shared_ok``); once the holder is gone the next run hits
  what the first committed.

Committed lost: a chunk committed and sound on disk (`sound_prefix`) that a session could not
restore, plus ready nodes whose values are gone; for ``shared_root``, value files of a committed
run gone after the run beside the holder or the next one.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Optional

__all__ = ["SCENARIOS"]

HANG_S = 120.0  # a session still running after this is hung


# -- shared steps ---------------------------------------------------------------------------------


def requests(c: Any, cfg: dict) -> list[tuple[list, int]]:
    """Requests of two images (namespaces) and two branches."""
    return [(c.request(i, cfg["chunks"], branch=b), img) for img in (0, 1) for i in range(cfg["requests"])
            for b in (0, 1)]


def committed(c: Any, cfg: dict, root: Path, **store_kw: Any) -> tuple[Any, Any, list]:
    """A LocalDisk store at ``root`` holding every request, its snapshot saved in the root."""
    from cacheseek.reuse.exact_prefix import save_forest_snapshot
    from cacheseek.stores.localdisk import LocalDiskTierStore

    reqs = requests(c, cfg)
    c.prime(reqs)
    store = LocalDiskTierStore(str(root), **store_kw)
    mgr = c.manager(store)
    for actions, img in reqs:
        c.session(mgr, actions, img=img)
    save_forest_snapshot(mgr.forest, (store.root / "forest.json"))
    return store, mgr, reqs


def reference_of(c: Any, store: Any) -> Any:
    """A manager over the forest the root's snapshot committed (before any fault): the chains a
    restore must reach, whatever a session invalidated since."""
    from cacheseek.reuse.exact_prefix import load_forest_snapshot

    return c.manager(c._memory(), load_forest_snapshot((store.root / "forest.json")))


def replay(c: Any, out: dict, mgr: Any, store: Any, reqs: list, *, ingest: bool, t_fault: Optional[float] = None,
           reference: Any = None) -> None:
    """Every request once; counts sessions, wrong outputs, committed chunks not restored (against
    ``reference``'s chains, default ``mgr``'s) and the time to the first correct session."""
    ref = reference if reference is not None else mgr
    for actions, img in reqs:
        expect = c.sound_prefix(store, c.chain_nodes(ref, actions, img))
        depth, ok = guarded(lambda: c.session(mgr, actions, img=img, ingest=ingest), out)
        out["sessions"] += 1
        out["wrong_outputs"] += not ok
        out["committed_lost"] += max(0, expect - depth)
        if ok and t_fault is not None and out["recover_s"] is None:
            out["recover_s"] = round(time.perf_counter() - t_fault, 3)


def guarded(fn: Callable[[], tuple[int, bool]], out: dict) -> tuple[int, bool]:
    """``fn()`` on a thread; a session still running after HANG_S counts as hung (and wrong)."""
    box: dict = {}

    def run() -> None:
        try:
            box["out"] = fn()
        except Exception as exc:  # noqa: BLE001 - a session that raises is a wrong output
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(HANG_S)
    if t.is_alive():
        out["hung"] = out.get("hung", 0) + 1
        return 0, False
    if "error" in box:
        out["errors"] = out.get("errors", 0) + 1
        out["last_error"] = f"{type(box['error']).__name__}: {box['error']}"[:160]
        return 0, False
    return box["out"]


def value_files(root: Path) -> dict[str, bytes]:
    """Every value file under ``root`` (not following links) with its bytes."""
    out = {}
    for shard in root.iterdir():
        if len(shard.name) == 2 and not shard.is_symlink() and shard.is_dir():
            for p in shard.iterdir():
                if "." not in p.name and stat.S_ISREG(p.lstat().st_mode):
                    out[f"{shard.name}/{p.name}"] = p.read_bytes()
    return out


def exchange(a: Path, b: Path) -> None:
    tmp = a.with_name(a.name + ".swap")
    os.rename(a, tmp)
    os.rename(b, a)
    os.rename(tmp, b)


# -- swap -----------------------------------------------------------------------------------------

SWAP_KINDS = ("k_v", "layer", "chunk", "namespace", "latent")


def swap_partner(kind: str, key: str, keys: list[str], rng: Any, namespace_of: dict) -> Optional[str]:
    if kind == "latent":
        pool = [k for k in keys if k.endswith(":lat") and k != key]
    else:
        loc, layer, half = key.rsplit(":", 2)
        if kind == "k_v":
            pool = [f"{loc}:{layer}:{'v' if half == 'k' else 'k'}"]
        elif kind == "layer":
            pool = [k for k in keys if k.startswith(loc + ":") and not k.startswith(f"{loc}:{layer}:")
                    and k.endswith(":" + half)]
        else:
            same_ns = kind == "chunk"
            pool = [k for k in keys if not k.endswith(":lat") and not k.startswith(loc + ":")
                    and k.endswith(f":{layer}:{half}")
                    and (namespace_of.get(k.rsplit(":", 2)[0]) == namespace_of.get(loc)) == same_ns]
    pool = [k for k in pool if k in keys]
    return rng.choice(pool) if pool else None


def swap_scenario(c: Any, cfg: dict, work: Path, rng: Any) -> dict[str, Any]:
    from cacheseek.reuse.exact_prefix import save_forest_snapshot

    store, mgr, reqs = committed(c, cfg, work / "swap-kv")
    out = c.row("swap", **{f"swapped_{k}": 0 for k in SWAP_KINDS})
    namespace_of = {n.blob.locator: ns.root_hash for ns in mgr.forest.namespaces() for n in ns.iter_nodes()
                    if n.blob is not None}
    try:
        for r in range(cfg["rounds"]):
            keys = [k for k in store.keys() if not k.endswith(":rec")]  # values; records are checked on their own
            for s in range(cfg["swaps"]):
                kind = SWAP_KINDS[s % len(SWAP_KINDS)]
                first = rng.choice([k for k in keys if k.endswith(":lat") == (kind == "latent")])
                other = swap_partner(kind, first, keys, rng, namespace_of)
                if other is None:
                    continue
                exchange(store.disk.path_of(first), store.disk.path_of(other))
                out["injected"] += 1
                out[f"swapped_{kind}"] += 1
            t_fault = time.perf_counter()
            replay(c, out, mgr, store, reqs, ingest=True, t_fault=t_fault, reference=reference_of(c, store))
            out["committed_lost"] += c.lost_values(mgr)
            replay(c, out, mgr, store, reqs, ingest=False)
            save_forest_snapshot(mgr.forest, (store.root / "forest.json"))  # what is committed now
        out.update(corrupt_values=store.stats.corrupt_values, invalidations=mgr.metrics.invalidations)
    finally:
        store.close()
    return out


# -- crafted snapshots ----------------------------------------------------------------------------


def _nodes(data: dict) -> list[dict]:
    return [n for ns in data["namespaces"] for n in ns["nodes"]]


def _with_blob(data: dict) -> list[dict]:
    return [n for n in _nodes(data) if n.get("blob")]


def _set_n_layers(value: Any) -> Callable[[dict, Any], None]:
    def craft(data: dict, rng: Any) -> None:
        rng.choice(_with_blob(data))["blob"]["n_layers"] = value
    return craft


def _pinned_string(data: dict, rng: Any) -> None:
    rng.choice(_nodes(data))["pinned"] = "false"


def _locator_of_another(field: str) -> Callable[[dict, Any], None]:
    def craft(data: dict, rng: Any) -> None:
        a, b = rng.sample(_with_blob(data), 2)
        if field == "blob":
            a["blob"]["locator"] = b["blob"]["locator"]
        else:
            a["skeleton"] = b["skeleton"]
    return craft


CRAFTED_JSON = {
    "n_layers_0": _set_n_layers(0),
    "n_layers_1": _set_n_layers(1),
    "n_layers_true": _set_n_layers(True),
    "n_layers_2.7": _set_n_layers(2.7),
    "pinned_string": _pinned_string,
    "blob_of_another": _locator_of_another("blob"),
    "latent_of_another": _locator_of_another("skeleton"),
}


def crafted_scenario(c: Any, cfg: dict, work: Path, rng: Any) -> dict[str, Any]:
    from cacheseek.errors import ConfigError
    from cacheseek.reuse.exact_prefix import load_forest_snapshot
    from cacheseek.stores.localdisk import LocalDiskTierStore

    honest_root = work / "crafted-kv"
    store, mgr, reqs = committed(c, cfg, honest_root)
    store.close()
    honest = mgr.forest
    reference = c.manager(c._memory(), honest)
    text = (honest_root / "forest.json").read_bytes()
    variants: list[tuple[str, bytes]] = []
    for name, craft in CRAFTED_JSON.items():
        data = json.loads(text)
        craft(data, rng)
        variants.append((name, json.dumps(data).encode()))
    for i in range(cfg["snapshot_flips"]):
        data = bytearray(text)
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        variants.append((f"bitflip_{i}", bytes(data)))
    variants.append(("truncated", text[: rng.randrange(1, len(text))]))
    out = c.row("crafted_snapshot", refused=0, not_config_errors=0, wrong_variants=[], lost_variants=[])
    for name, data in variants:
        root = work / f"crafted-{name}"
        shutil.copytree(honest_root, root, ignore=shutil.ignore_patterns(".lock"))
        (root / "forest.json").write_bytes(data)
        before = value_files(root)
        out["injected"] += 1
        t_fault = time.perf_counter()
        store = LocalDiskTierStore(str(root))
        try:
            try:
                forest = load_forest_snapshot(root / "forest.json")
            except Exception as exc:  # noqa: BLE001 - refused: the process does not start on it
                out["refused"] += 1
                if not isinstance(exc, ConfigError):  # a traceback, not one clear error
                    out["not_config_errors"] += 1
                lost = len(set(before) - set(value_files(root)))
                out["committed_lost"] += lost
                continue
            crafted_mgr = c.manager(store, forest)
            crafted_mgr.reconcile()
            wrong, lost = out["wrong_outputs"], out["committed_lost"]
            for _ in range(2):  # a failed restore that is not invalidated fails every later session too
                replay(c, out, crafted_mgr, store, reqs, ingest=False, t_fault=t_fault, reference=reference)
            if out["wrong_outputs"] > wrong:
                out["wrong_variants"].append(name)
            if out["committed_lost"] > lost:
                out["lost_variants"].append(name)
        finally:
            store.close()
    return out


# -- links ----------------------------------------------------------------------------------------

VICTIM_FILES = {"passwd": b"root:x:0:0\n", "notes": b"my notes\n", "id_rsa": b"-----BEGIN KEY-----\n",
                ".notes.swp.tmp": b"editor temp\n", "abcdef": b"a value-like name\n"}


def links_scenario(c: Any, cfg: dict, work: Path, rng: Any) -> dict[str, Any]:
    from cacheseek.reuse.exact_prefix import load_forest_snapshot
    from cacheseek.stores.localdisk import LocalDiskTierStore

    out = c.row("links", outside_changes=0, open_errors=0)
    for r in range(cfg["rounds"]):
        root = work / f"links-kv-{r}"
        store, mgr, reqs = committed(c, cfg, root)
        store.close()
        victim = work / f"victim-{r}"
        victim.mkdir()
        for name, body in VICTIM_FILES.items():
            (victim / name).write_bytes(body)
        secret = work / f"secret-{r}"
        secret.write_bytes(b"secret outside the root\n")
        value = rng.choice(sorted(value_files(root)))
        (root / value).unlink()
        os.symlink(secret, root / value)  # a value file that is a link: sessions run on the root
        out["injected"] += 1
        t_fault = time.perf_counter()
        store = LocalDiskTierStore(str(root))
        try:
            mgr = c.manager(store, load_forest_snapshot(root / "forest.json"))
            mgr.reconcile()
            replay(c, out, mgr, store, reqs, ingest=True, t_fault=t_fault)
            replay(c, out, mgr, store, reqs, ingest=False)
            out["committed_lost"] += c.lost_values(mgr)
        finally:
            store.close()
        shards = {p.name for p in root.iterdir()}
        free = [f"{i:02x}" for i in range(256) if f"{i:02x}" not in shards]
        os.symlink(victim, root / rng.choice(free))  # then a shard folder that is a link
        out["injected"] += 1
        try:
            LocalDiskTierStore(str(root)).close()
        except Exception as exc:  # noqa: BLE001 - a root refused with a clear error is the outcome
            out["open_errors"] += 1
            out["last_error"] = f"{type(exc).__name__}: {exc}"[:160]
        now = {p.name: p.read_bytes() for p in victim.iterdir() if p.is_file()}
        out["outside_changes"] += sum(now.get(k) != v for k, v in VICTIM_FILES.items())
        out["outside_changes"] += len(set(now) - set(VICTIM_FILES))
        out["outside_changes"] += secret.read_bytes() != b"secret outside the root\n"
    return out


# -- FIFOs ----------------------------------------------------------------------------------------


def fifo_scenario(c: Any, cfg: dict, work: Path, rng: Any) -> dict[str, Any]:
    root = work / "fifo-kv"
    store, mgr, reqs = committed(c, cfg, root, op_timeout_s=cfg["op_timeout_s"])
    store.flush_timeout_s = 5.0
    out = c.row("fifo", hung=0)
    fifos = []
    try:
        for path in rng.sample(sorted(value_files(root)), cfg["fifos"]):
            (root / path).unlink()
            os.mkfifo(root / path)
            fifos.append(root / path)
            out["injected"] += 1
        t_fault = time.perf_counter()
        ref = reference_of(c, store)
        replay(c, out, mgr, store, reqs, ingest=True, t_fault=t_fault, reference=ref)
        replay(c, out, mgr, store, reqs, ingest=False)
        _unblock(fifos)
        out["stuck_after"] = store.calls.bounded.wait_quiet(10.0)
        # A value a FIFO replaced is destroyed by the fault itself (no store can keep it): the
        # audit invalidates the committed chunks that lost one, which no session happened to reach,
        # so they are counted as destroyed, not lost by the store.
        out["destroyed_by_fault"] = mgr.audit()
        out["committed_lost"] += c.lost_values(mgr)
        out.update(corrupt_values=store.stats.corrupt_values, restore_failures=mgr.metrics.restore_failures)
    finally:
        _unblock(fifos)
        try:
            store.close()
        except Exception as exc:  # noqa: BLE001
            out["close_error"] = f"{type(exc).__name__}: {exc}"[:160]
    return out


def _unblock(fifos: list[Path]) -> None:
    """A reader still blocked in open() on one of ``fifos`` gets a writer, then EOF."""
    for fifo in fifos:
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:  # no reader waiting, or no FIFO there any more
            pass


# -- stalled media --------------------------------------------------------------------------------


class Stall:
    """The real disk backend's ``op`` blocks while armed (a hung medium)."""

    def __init__(self, disk: Any, op: str) -> None:
        self.released = threading.Event()
        self.blocked = 0
        real = getattr(disk, op)

        def stalled(*args: Any, **kw: Any) -> Any:
            if not self.released.is_set():
                self.blocked += 1
                self.released.wait()
            return real(*args, **kw)

        setattr(disk, op, stalled)
        self._undo = lambda: setattr(disk, op, real)

    def release(self) -> None:
        self.released.set()
        self._undo()


def stalled_scenario(c: Any, cfg: dict, work: Path, rng: Any) -> dict[str, Any]:
    root = work / "stalled-kv"
    store, mgr, reqs = committed(c, cfg, root, op_timeout_s=cfg["op_timeout_s"])
    out = c.row("stalled", hung=0, orphan_files=0, blocked_calls=0)
    fresh = [(c.request(50 + i, cfg["chunks"]), 0) for i in range(cfg["requests"])]
    c.prime(fresh)
    recover: list[float] = []
    try:
        for op, batch in (("read", reqs), ("write", fresh)):
            stall = Stall(store.disk, op)
            out["injected"] += 1
            for actions, img in batch:  # the medium hangs: each session must end, cold
                _, ok = guarded(lambda: c.session(mgr, actions, img=img), out)
                out["sessions"] += 1
                out["wrong_outputs"] += not ok
            stall.release()
            out["blocked_calls"] += stall.blocked
            t_back = time.perf_counter()
            store.calls.bounded.wait_quiet(HANG_S)  # the stuck calls finish (late writes removed again)
            out["orphan_files"] += len(set(store.keys()) - set(store.ledger.sizes))
            sub = c.row("")
            replay(c, sub, mgr, store, batch, ingest=op == "write", t_fault=t_back,
                   reference=reference_of(c, store) if op == "read" else None)
            replay(c, sub, mgr, store, batch, ingest=False)
            for k in ("sessions", "wrong_outputs", "committed_lost"):
                out[k] += sub[k]
            out["hung"] += sub.get("hung", 0)
            if sub["recover_s"] is not None:
                recover.append(sub["recover_s"])
        out["committed_lost"] += c.lost_values(mgr)
        out.update(recover_s=max(recover) if recover else None, failed_writes=store.stats.failed_writes,
                   restore_failures=mgr.metrics.restore_failures)
    finally:
        store.close()
    return out


# -- ENOSPC recovery ------------------------------------------------------------------------------


def enospc_recovery_scenario(c: Any, cfg: dict, work: Path, rng: Any) -> dict[str, Any]:
    from cacheseek.stores.localdisk import LocalDiskTierStore

    where = work / f"tmpfs-{uuid.uuid4().hex[:6]}"
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(where)], capture_output=True)
    if done.returncode != 0:
        return c.row("enospc_recovery", skipped=f"cannot mount a tmpfs: {done.stderr.strip()[:80]!r}")
    out = c.row("enospc_recovery", capped_at=None, raised_to=None)
    reqs = [(c.request(i, cfg["chunks"]), i) for i in range(cfg["enospc_sessions"])]
    c.prime(reqs)
    try:
        filler = where / "other-tenant"
        filler.write_bytes(b"\0" * (200 << 10))
        store = LocalDiskTierStore(str(where / "kv"))
        try:
            mgr = c.manager(store)
            half = len(reqs) // 2
            for actions, img in reqs[:half]:
                _, ok = c.session(mgr, actions, img=img)
                out["sessions"] += 1
                out["wrong_outputs"] += not ok
            out["capped_at"] = store.stats.capacity_bytes
            out["injected"] = int(store.stats.capacity_bytes is not None)
            filler.unlink()  # the other tenant frees the disk
            t_free = time.perf_counter()
            for actions, img in reqs[half:]:
                writes = mgr.metrics.writes
                _, ok = c.session(mgr, actions, img=img)
                out["sessions"] += 1
                out["wrong_outputs"] += not ok
                if ok and out["recover_s"] is None and mgr.metrics.writes == writes + cfg["chunks"]:
                    out["recover_s"] = round(time.perf_counter() - t_free, 3)
            out["raised_to"] = store.stats.capacity_bytes
            replay(c, out, mgr, store, reqs[half:], ingest=False)
            out["committed_lost"] += c.lost_values(mgr)
        finally:
            store.close()
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)
    return out


# -- two processes on one root --------------------------------------------------------------------

HOLD = ("import sys; from cacheseek.stores.localdisk import LocalDiskTierStore; "
        "s = LocalDiskTierStore(sys.argv[1]); print('held', flush=True); sys.stdin.read(); s.close()")


def _gate_run(cfg: Any, run_dir: Path, out: dict) -> dict:
    from cacheseek.orchestrator import build_stack

    stack = build_stack(cfg, run_dir=run_dir)
    try:
        results = stack.workload.run(stack)
    finally:
        stack.close()
    rows = results["requests"]
    out["sessions"] += len(rows) + len(results["ring_check"])
    out["wrong_outputs"] += sum(r["frames"] != "ok" for r in rows)
    out["wrong_outputs"] += sum(r["verdict"] == "MISMATCH" for r in results["ring_check"])
    return results


def shared_root_scenario(c: Any, cfg: dict, work: Path, rng: Any) -> dict[str, Any]:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import cacheseek.schema  # noqa: F401  (the root schema)
    from cacheseek.cli_help import CONF_DIR
    from cacheseek.errors import ConfigError
    from cacheseek.registry import import_backends

    import_backends()
    root = work / "shared-kv"
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        conf = compose(config_name="config", overrides=["+store=localdisk", f"store.root={root}"])
    GlobalHydra.instance().clear()
    out = c.row("shared_root", shared_ok=0, refused=0, warm_hit_depth=None)
    _gate_run(conf, work / "shared-run0", out)
    for k in range(cfg["shared_faults"]):
        committed_files = set(value_files(root))
        holder = subprocess.Popen([sys.executable, "-c", HOLD, str(root)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(c.benchlib.REPO)})
        try:
            assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
            out["injected"] += 1
            try:  # a run beside another process on the root shares it (issue 31): it passes, loses nothing
                out["shared_ok"] += bool(_gate_run(conf, work / f"shared-beside{k}", out)["passed"])
            except ConfigError as exc:
                out["refused"] += exc.field == "store.root"
            out["committed_lost"] += len(committed_files - set(value_files(root)))
        finally:
            holder.communicate("", timeout=HANG_S)
        t_free = time.perf_counter()
        results = _gate_run(conf, work / f"shared-run{k + 1}", out)
        if results["passed"] and out["recover_s"] is None:
            out["recover_s"] = round(time.perf_counter() - t_free, 3)
        out["warm_hit_depth"] = next(r["hit_depth"] for r in results["requests"] if r["name"] == "A")
        out["committed_lost"] += len(committed_files - set(value_files(root)))
    return out


SCENARIOS = {
    "swap": swap_scenario,
    "crafted_snapshot": crafted_scenario,
    "links": links_scenario,
    "fifo": fifo_scenario,
    "stalled": stalled_scenario,
    "enospc_recovery": enospc_recovery_scenario,
    "shared_root": shared_root_scenario,
}
