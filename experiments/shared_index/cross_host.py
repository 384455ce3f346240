#!/usr/bin/env python3
"""Cross-host first read of a 480p chunk over Fluxon, against the link's raw TCP speed measured in
the same run, broken down into fluxon-py's transfer and CacheSeek's own work (needs root).

Two emulated hosts (tools/emulated_hosts.py: namespaces on a bridge, each its own /dev/shm and
/tmp), a Fluxon control plane and owner on ``a``, an owner on ``b`` (tools/multi_host_demo.py
`FluxonHosts`). One worker process per host (this script with ``--worker``) attaches the
project's generic Fluxon tier, ``FluxonTensorTier`` (``+store=fluxon``). Per case and rep, on a
fresh chunk: ``a`` writes the chunk's values (``put_async``, as the manager's ``ingest`` does), ``b`` reads
them (the first read: a value on ``a``'s owner crosses the link), ``b`` reads them again (every
value now in ``b``'s segment: the same-host reference), ``a`` frees them. The chunk's record is
not involved: ``b`` builds the handle from the digests ``a``'s write returned, as an adopted
record hands them over.

Placement (``--placement``): ``remote`` (default) stops ``b``'s owner while ``a`` writes the
rep's chunks and starts it before ``b`` reads, so every value lies on ``a``'s owner; a
``warmup`` chunk, read first after the join, takes the freshly joined owner's slow first pulls
and counts in no case. ``random``: both owners up, each value where fluxon-py 0.2.4's master
puts it (at random), each chunk written, read and freed in turn.

Cases (``--cases``):

  serial          today's restore (`Restorer` before this change): ``get_layer`` of each layer in
                  turn, K then V, one value at a time
  parallel        ``get_layers`` (`KeyValueTier.read_parallelism` = ``--parallelism``): the fix
  raw             fluxon-py alone, no CacheSeek code: ``get_blocking`` + ``access`` per value,
                  serial, no copy out and no checksum (the floor of a serial reader)
  raw_parallel    the same with ``--parallelism`` gets in flight
  split_parallel  the same bytes as values that fit their power-of-two slot (each K/V value cut
                  in 3: 15.2 MiB payloads in 16 MiB slots instead of 45.7 MiB in 64 MiB), read as
                  ``parallel``

Per value the read worker records the tier's backend read (wall), fluxon-py's ``get_blocking``
inside it, the copy out of the segment and the xxh3 check (`fluxon_bytes.decode_value`,
`checksum.Sealed.verify`, timed by wrapping them in the worker), and in serial cases the bytes
its link received meanwhile (a value read from the other host's owner received about its size).
Placement: the writer's link sent about a value's size while writing it when the master placed
it on ``b``'s owner. ``tcp``: a plain socket sender on ``a`` and receiver on ``b`` move one
value's bytes (3 times) and the chunk's bytes (once) per rep.

A whole 480p chunk (40 layers, 80 values of 47,923,200 bytes, 3.57 GiB) does not fit this
2-core, 24 GiB VM twice over (writer's tensors, both segments, b's replicas, reader's tensors),
so ``--layers`` (default 8: 16 values, 731 MiB) measures a subset; the README scales it to 80
values explicitly.

    python experiments/shared_index/cross_host.py [--layers 8] [--reps 3] [--parallelism 4]
        [--placement remote|random] [--cases serial,parallel,parallel8,...]   # as root, ~9 min
    python experiments/shared_index/cross_host.py --render [--placement random]  # from the JSON

Writes cross_host.json and cross_host.png (``--placement random``: cross_host_random.*) beside
this script and prints the tables of the README section.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import selectors
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tools"), str(REPO / "experiments")]

MiB = 1 << 20
VALUE_480P = 47_923_200  # one layer's K (or V) of a 480p chunk, bf16
LAYERS_480P = 40
SPLIT = 3  # pieces per value in split cases: 15,974,400 B + header fits a 16 MiB slot
CASES = ("serial", "parallel", "raw", "raw_parallel", "split_parallel")
TCP_PORT = 47123


# -- the worker (runs inside one emulated host) --------------------------------------------------


def _link() -> tuple[int, int]:
    """(received, sent) bytes of this host's eth0."""
    with open("/proc/self/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "eth0":
                fields = rest.split()
                return int(fields[0]), int(fields[8])
    return 0, 0


def _cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


class Worker:
    """One host's side: a `FluxonTensorTier` and the timing wrappers around its read path."""

    def __init__(self, cluster: str, share: str) -> None:
        import torch

        from cacheseek.stores import checksum, fluxon_bytes

        self.torch = torch
        t0 = time.perf_counter()
        self.tier = fluxon_bytes.FluxonTensorTier(cluster, share, "xhost", op_timeout_s=120.0,
                                                  attach_timeout_s=60.0, read_parallelism=1)
        self.attach_s = time.perf_counter() - t0
        self.client = self.tier.backend.client
        self.rec: dict[str, dict[str, float]] = {}
        self._lock = threading.Lock()
        self._base: dict[int, Any] = {}
        # timing wrappers: the experiment's instruments, not product code
        native = self.client._store
        worker = self

        class TimedNative:
            def get_blocking(self, key: str) -> Any:
                t = time.perf_counter()
                try:
                    return native.get_blocking(key)
                finally:
                    worker._add(key, "fluxon_get_s", time.perf_counter() - t)

            def __getattr__(self, name: str) -> Any:
                return getattr(native, name)

        self._native = native
        self.client._store = TimedNative()
        decode = fluxon_bytes.decode_value

        def timed_decode(key: str, *args: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return decode(key, *args, **kw)
            finally:
                self._add(key, "decode_s", time.perf_counter() - t)

        fluxon_bytes.decode_value = timed_decode
        verify = checksum.Sealed.verify

        def timed_verify(sealed: Any, *bodies: Any) -> None:
            t = time.perf_counter()
            try:
                verify(sealed, *bodies)
            finally:
                self._add(sealed.key, "verify_s", time.perf_counter() - t)

        checksum.Sealed.verify = timed_verify
        read, write = self.tier.backend.read, self.tier.backend.write

        def timed_read(key: str, *args: Any) -> Any:
            rx, t = _link()[0], time.perf_counter()
            try:
                return read(key, *args)
            finally:
                self._add(key, "read_s", time.perf_counter() - t)
                self._add(key, "rx", _link()[0] - rx)

        def timed_write(key: str, value: Any) -> Any:
            tx, t = _link()[1], time.perf_counter()
            try:
                return write(key, value)
            finally:
                self._add(key, "write_s", time.perf_counter() - t)
                self._add(key, "tx", _link()[1] - tx)

        self.tier.backend.read, self.tier.backend.write = timed_read, timed_write

    def _add(self, key: str, field: str, value: float) -> None:
        with self._lock:
            self.rec.setdefault(key, {})[field] = value

    def _take(self) -> dict[str, dict[str, float]]:
        with self._lock:
            rec, self.rec = self.rec, {}
        return rec

    def _handle(self, locator: str, layers: int, value_bytes: int, digests: Optional[dict] = None) -> Any:
        from cacheseek.kv.handles import BlobHandle, Tier

        return BlobHandle(tier=Tier.FLUXON_DRAM, locator=locator, nbytes=2 * layers * value_bytes,
                          n_layers=layers, ready=True, pairs=True, digests=digests)

    def _value(self, value_bytes: int, index: int) -> Any:
        import numpy as np

        if value_bytes not in self._base:
            self._base[value_bytes] = np.random.default_rng(value_bytes).integers(0, 256, value_bytes, dtype=np.uint8)
        arr = self._base[value_bytes].copy()
        arr[:8] = np.frombuffer(index.to_bytes(8, "little"), dtype=np.uint8)  # every value its own bytes
        return self.torch.from_numpy(arr).view(self.torch.bfloat16)

    def write(self, locator: str, layers: int, value_bytes: int) -> dict[str, Any]:
        from cacheseek.kv.handles import Tier

        payload = [(self._value(value_bytes, 2 * i), self._value(value_bytes, 2 * i + 1)) for i in range(layers)]
        self._take()
        t0 = time.perf_counter()
        handle = self.tier.put_async(locator, payload, tier=Tier.FLUXON_DRAM)
        wall = time.perf_counter() - t0
        if not handle.ready:
            raise RuntimeError(f"write of {locator} failed: {handle.error}")
        return {"wall_s": wall, "digests": handle.digests, "values": self._take()}

    def read(self, locator: str, layers: int, value_bytes: int, digests: dict, mode: str,
             parallelism: int) -> dict[str, Any]:
        from cacheseek.kv.locators import blob_keys

        handle = self._handle(locator, layers, value_bytes, digests)
        keys = blob_keys(locator, layers)
        self._take()
        rx0, cpu0, t0 = _link()[0], _cpu_s(), time.perf_counter()
        if mode == "serial":
            got = [self.tier.get_layer(handle, layer) for layer in range(layers)]
        elif mode == "parallel":
            self.tier.read_parallelism = parallelism
            got = self.tier.get_layers([(handle, layer) for layer in range(layers)])
            self.tier.read_parallelism = 1
        elif mode in ("raw", "raw_parallel"):
            from concurrent.futures import ThreadPoolExecutor

            def raw(key: str) -> bool:
                res = self.client._store.get_blocking(key)
                if not res.is_ok():
                    return False
                holder = res.unwrap()
                t = time.perf_counter()
                fields = holder.access().unwrap()
                self._add(key, "access_s", time.perf_counter() - t)
                ok = bool(fields)
                del fields, holder
                return ok

            def timed_raw(key: str) -> bool:
                rx, t = _link()[0], time.perf_counter()
                try:
                    return raw(key)
                finally:
                    self._add(key, "read_s", time.perf_counter() - t)
                    self._add(key, "rx", _link()[0] - rx)

            with ThreadPoolExecutor(parallelism if mode == "raw_parallel" else 1) as pool:
                got = list(pool.map(timed_raw, keys))
            got = [g or None for g in got]
        else:
            raise ValueError(f"unknown read mode {mode!r}")
        wall = time.perf_counter() - t0
        cpu, rx = _cpu_s() - cpu0, _link()[0] - rx0
        missing = sum(g is None for g in got)
        got = None  # the tensors go before the next case
        return {"wall_s": wall, "cpu_s": cpu, "rx": rx, "missing": missing, "values": self._take()}

    def free(self, locator: str, layers: int, value_bytes: int) -> dict[str, Any]:
        self.tier.free(self._handle(locator, layers, value_bytes))  # the writer's tier counts its bytes
        return {}

    def close(self) -> None:
        self.client._store = self._native
        self.tier.close()


def _tcp_serve(sizes: list[int]) -> dict[str, Any]:
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", TCP_PORT))
    srv.listen(1)

    def serve() -> None:
        block = memoryview(bytearray(4 * MiB))
        with srv:
            for size in sizes:
                conn, _ = srv.accept()
                with conn:
                    left = size
                    while left > 0:
                        left -= conn.send(block[:min(left, len(block))])

    threading.Thread(target=serve, daemon=True).start()
    return {"port": TCP_PORT}


def _tcp_recv(host: str, size: int) -> dict[str, Any]:
    buf = memoryview(bytearray(4 * MiB))
    total, t0 = 0, time.perf_counter()
    with socket.create_connection((host, TCP_PORT), timeout=60) as s:
        while total < size:
            n = s.recv_into(buf)
            if not n:
                break
            total += n
    return {"s": time.perf_counter() - t0, "bytes": total}


def _idle_cpu(seconds: float) -> dict[str, float]:
    """Cores each Fluxon process of this host (tools/fluxon_service.py's info file) uses while
    nothing is asked of it."""
    pids = json.loads(Path(f"/tmp/shared/service-{socket.gethostname()}.json").read_text())["pids"]

    def ticks() -> dict[str, int]:
        out = {}
        for name, pid in pids.items():
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            out[name] = int(fields[11]) + int(fields[12])  # utime + stime
        return out

    t0, c0 = time.monotonic(), ticks()
    time.sleep(seconds)
    t1, c1 = time.monotonic(), ticks()
    hz = os.sysconf("SC_CLK_TCK")
    return {name: (c1[name] - c0[name]) / hz / (t1 - t0) for name in pids}


def worker_main(cluster: str, share: str) -> int:
    w = Worker(cluster, share)
    print(json.dumps({"ready": True, "hostname": socket.gethostname(), "attach_s": w.attach_s}), flush=True)
    try:
        for line in sys.stdin:
            req = json.loads(line)
            op = req.pop("op")
            if op == "quit":
                break
            try:
                if op == "tcp_serve":
                    out = _tcp_serve(req["sizes"])
                elif op == "tcp_recv":
                    out = _tcp_recv(req["host"], req["size"])
                elif op == "idle_cpu":
                    out = _idle_cpu(req["seconds"])
                else:
                    out = getattr(w, op)(**req)
            except Exception as exc:  # noqa: BLE001 - answered; the driver stops on it
                out = {"error": f"{type(exc).__name__}: {exc}"}
            print(json.dumps(out), flush=True)
    finally:
        w.close()
    return 0


# -- the driver ------------------------------------------------------------------------------


class Remote:
    """This script's worker on one host, one JSON line per call, each answer bounded."""

    def __init__(self, hosts: Any, host: str, cluster: str, share: str, timeout_s: float = 600.0) -> None:
        self.host, self.timeout_s = host, timeout_s
        env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
        self.proc = hosts.popen(host, [sys.executable, str(Path(__file__).resolve()), "--worker",
                                       "--cluster", cluster, "--share", share],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                text=True, env=env, cwd=str(REPO))
        self.ready = self._line()
        if not self.ready.get("ready"):
            raise RuntimeError(f"worker on {host} did not attach: {self.ready}")

    def _line(self) -> dict[str, Any]:
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        if not sel.select(self.timeout_s):
            raise TimeoutError(f"worker on {self.host}: no answer within {self.timeout_s:.0f} s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker on {self.host} exited with status {self.proc.wait(10)}")
        return json.loads(line)

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.proc.stdin.flush()
        out = self._line()
        if "error" in out:
            raise RuntimeError(f"{op} on {self.host}: {out['error']}")
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write('{"op": "quit"}\n')
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(timeout=10)


def case_shape(case: str, layers: int) -> tuple[int, int]:
    """(layers, value bytes) a case writes: the same bytes for every case."""
    if case.startswith("split"):
        return layers * SPLIT, VALUE_480P // SPLIT
    return layers, VALUE_480P


def read_mode(case: str, parallelism: int) -> tuple[str, int]:
    """(read mode, reads in flight) of a case; a trailing number overrides ``--parallelism``
    (``parallel8``, ``raw_parallel2``); ``warmup`` reads as ``parallel``."""
    base = case.rstrip("0123456789")
    n = int(case[len(base):]) if base != case else parallelism
    base = base.removeprefix("split_")
    return ("parallel" if base == "warmup" else base), n


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every rep: the link's raw TCP speed, then every case on a fresh chunk (rotated order).
    ``--placement remote``: b's owner is stopped while a writes the rep's chunks and joins before
    b reads them, so every value lies on a's owner (b's first read pulls the whole chunk over the
    link); ``random``: both owners up, values where fluxon-py 0.2.4's master puts them (at random,
    about half on each owner), each chunk written, read and freed in turn."""
    from benchlib import Progress
    from emulated_hosts import EmulatedHosts
    from multi_host_demo import FluxonHosts

    cases = [c for c in args.cases.split(",") if c]
    unknown = sorted({c.rstrip("0123456789") for c in cases} - set(CASES) - {"split_serial"})
    if unknown:
        raise SystemExit(f"--cases: unknown {unknown} (known: {', '.join(CASES)}, split_serial)")
    chunk_bytes = 2 * args.layers * VALUE_480P
    rows: list[dict[str, Any]] = []
    tcp: list[dict[str, Any]] = []
    out: dict[str, Any] = {"rows": rows, "tcp": tcp, "attach_s": {"a": [], "b": []}}
    prog = Progress(args.reps * (2 * len(cases) + (4 if args.placement == "remote" else 1)), "cross_host")
    remote = args.placement == "remote"

    def locator(rep: int, case: str) -> str:
        return hashlib.sha256(f"cross-host {rep} {case}".encode()).hexdigest() + ":kv"  # a node key

    def write(wa: Remote, rep: int, case: str) -> dict[str, Any]:
        layers, vbytes = case_shape(case, args.layers)
        w = wa.call("write", locator=locator(rep, case), layers=layers, value_bytes=vbytes)
        placed_b = sum(v.get("tx", 0) > vbytes // 2 for v in w["values"].values())
        prog.step(f"rep {rep} {case:>14}: a wrote {len(w['values'])} values in {w['wall_s']:.1f} s "
                  f"({placed_b} placed on b)")
        return w

    def read(wa: Remote, wb: Remote, rep: int, case: str, w: dict[str, Any]) -> None:
        layers, vbytes = case_shape(case, args.layers)
        mode, par = read_mode(case, args.parallelism)
        load0 = os.getloadavg()[0]
        kw = dict(locator=locator(rep, case), layers=layers, value_bytes=vbytes, digests=w["digests"], mode=mode,
                  parallelism=par)
        first = wb.call("read", **kw)
        again = wb.call("read", **kw)
        wa.call("free", locator=locator(rep, case), layers=layers, value_bytes=vbytes)  # b's replicas go too
        rows.append({"rep": rep, "case": case, "layers": layers, "value_bytes": vbytes,
                     "load1": [load0, os.getloadavg()[0]], "write": w, "first": first, "replica": again})
        prog.step(f"rep {rep} {case:>14}: b's first read {first['wall_s']:.2f} s ({first['rx'] / MiB:.0f} MiB "
                  f"over the link, {first['missing']} missing), again {again['wall_s']:.2f} s, load {load0:.1f}")
        if first["missing"] or again["missing"]:
            prog.note(f"  {case}: values missing (evicted? raise --dram)")

    def measure_tcp(wa: Remote, wb: Remote, rep: int) -> None:
        sizes = [VALUE_480P] * 3 + [chunk_bytes]
        wa.call("tcp_serve", sizes=sizes)
        got = [wb.call("tcp_recv", host=hosts.address("a"), size=n) for n in sizes]
        tcp.extend(dict(g, rep=rep) for g in got)
        prog.step(f"rep {rep}: raw TCP a -> b: {VALUE_480P / MiB:.1f} MiB in "
                  f"{statistics.median(g['s'] for g in got[:3]):.3f} s, {chunk_bytes / MiB:.0f} MiB in {got[3]['s']:.3f} s")

    def attach(host: str) -> Remote:
        w_ = Remote(hosts, host, cluster.cluster, cluster.share)
        out["attach_s"][host].append(w_.ready["attach_s"])
        return w_

    with tempfile.TemporaryDirectory(prefix="cacheseek-xhost-") as shared:
        os.chmod(shared, 0o777)
        dram_gib = int(args.dram.removesuffix("GiB"))
        with EmulatedHosts(["a", "b"], shared_dir=shared, shm_size=f"{dram_gib + 1}g") as hosts:
            cluster = FluxonHosts(hosts, dram=args.dram, geometry="lingbot_480p", values=args.values)
            wa = wb = None
            try:
                t0 = time.perf_counter()
                cluster.start_owner("a")
                if not remote:
                    cluster.start_owner("b")
                out["service_s"] = time.perf_counter() - t0
                wa = attach("a")
                for rep in range(args.reps):
                    order = cases[rep % len(cases):] + cases[:rep % len(cases)]  # rotated: the load drifts
                    if remote:
                        written = {case: write(wa, rep, case) for case in ["warmup", *order]}  # b's owner is down
                        cluster.start_owner("b")
                    wb = attach("b")
                    if remote:  # a freshly joined owner's first pulls run slower: not any case's
                        read(wa, wb, rep, "warmup", written.pop("warmup"))
                    if rep == 0:
                        out["idle_cpu"] = {h: w_.call("idle_cpu", seconds=5.0) for h, w_ in (("a", wa), ("b", wb))}
                        prog.note("idle Fluxon processes, cores each: " + "; ".join(
                            f"{h}: " + ", ".join(f"{n} {c:.2f}" for n, c in v.items())
                            for h, v in out["idle_cpu"].items()))
                    measure_tcp(wa, wb, rep)
                    for case in order:
                        read(wa, wb, rep, case, written[case] if remote else write(wa, rep, case))
                        time.sleep(1.0)
                    if remote:
                        wb.close()
                        wb = None
                        cluster.stop_owner("b")
            finally:
                for w_ in (wa, wb):
                    if w_ is not None:
                        w_.close()
                cluster.close()
    return out


# -- analysis -----------------------------------------------------------------------------


def compact(data: dict[str, Any]) -> None:
    """Per-value records keyed by what follows the locator (``L3:k``), seconds to 0.1 ms: the
    JSON stays small (idempotent)."""
    def short(values: dict[str, dict]) -> dict[str, dict]:
        return {k.split(":kv:")[-1]: {f: round(x, 4) if isinstance(x, float) else x for f, x in v.items()}
                for k, v in values.items()}

    for r in data["rows"]:
        for part in ("write", "first", "replica"):
            r[part]["values"] = short(r[part]["values"])


def write_results(path: Path, data: dict[str, Any]) -> None:
    """The JSON, one line per row (the per-value records)."""
    head = json.dumps({k: v for k, v in data.items() if k != "rows"}, indent=2, default=str)
    rows = ",\n".join("    " + json.dumps(r, separators=(",", ":")) for r in data["rows"])
    tmp = path.with_suffix(".tmp")
    tmp.write_text(head[:-2] + ',\n  "rows": [\n' + rows + "\n  ]\n}\n")
    tmp.replace(path)


def med(xs: list[float]) -> Optional[float]:
    xs = [x for x in xs if x is not None]
    return float(statistics.median(xs)) if xs else None


def placement(row: dict[str, Any]) -> dict[str, bool]:
    """key -> True when the master placed the value on b's owner (the writer sent it over)."""
    return {k: v.get("tx", 0) > row["value_bytes"] // 2 for k, v in row["write"]["values"].items()}


def summarize(data: dict[str, Any], layers: int, parallelism: int) -> dict[str, Any]:
    tcp_value = med([t["s"] for t in data["tcp"] if t["bytes"] == VALUE_480P])
    chunk_bytes = 2 * layers * VALUE_480P
    tcp_chunk = med([t["s"] for t in data["tcp"] if t["bytes"] == chunk_bytes])
    out: dict[str, Any] = {"tcp_value_s": tcp_value, "tcp_chunk_s": tcp_chunk,
                           "tcp_MiB_s": VALUE_480P / MiB / tcp_value if tcp_value else None,
                           "chunk_bytes": chunk_bytes, "cases": {}}
    for case in dict.fromkeys(r["case"] for r in data["rows"]):
        rows = [r for r in data["rows"] if r["case"] == case]
        n_values = 2 * rows[0]["layers"]
        remote, local, writes_b, writes_a = [], [], [], []
        for r in rows:
            on_b = placement(r)
            for k, v in r["first"]["values"].items():
                (local if on_b.get(k) else remote).append(v)
            for k, v in r["write"]["values"].items():
                (writes_b if on_b.get(k) else writes_a).append(v["write_s"])
        first = [r["first"]["wall_s"] for r in rows]
        crossed = [sum(not b for b in placement(r).values()) for r in rows]

        def part(vals: list[dict], field: str) -> Optional[float]:
            return med([v.get(field) for v in vals])

        def cs_part(vals: list[dict]) -> Optional[float]:
            """CacheSeek's share of one value's read: the backend read minus fluxon-py's get."""
            xs = [v["read_s"] - v["fluxon_get_s"] for v in vals if "fluxon_get_s" in v and "read_s" in v]
            return med(xs)

        per_remote = [r["first"]["wall_s"] / max(1, c) for r, c in zip(rows, crossed)]
        c = {
            "values": n_values, "value_bytes": rows[0]["value_bytes"], "reps": len(rows),
            "first_wall_s": med(first), "first_wall_s_all": first,
            "replica_wall_s": med([r["replica"]["wall_s"] for r in rows]),
            "first_cpu_s": med([r["first"]["cpu_s"] for r in rows]),
            "first_rx_MiB": med([r["first"]["rx"] / MiB for r in rows]),
            "values_over_link": crossed,
            "write_wall_s": med([r["write"]["wall_s"] for r in rows]),
            "write_value_local_s": med(writes_a), "write_value_remote_s": med(writes_b),
            "missing": sum(r["first"]["missing"] + r["replica"]["missing"] for r in rows),
            "load1": med([sum(r["load1"]) / 2 for r in rows]),
            "remote_value": {"n": len(remote), "read_s": part(remote, "read_s"),
                             "fluxon_get_s": part(remote, "fluxon_get_s"), "decode_s": part(remote, "decode_s"),
                             "verify_s": part(remote, "verify_s"), "cacheseek_s": cs_part(remote),
                             "rx_MiB": med([v.get("rx", 0) / MiB for v in remote])},
            "local_value": {"n": len(local), "read_s": part(local, "read_s"),
                            "fluxon_get_s": part(local, "fluxon_get_s"), "decode_s": part(local, "decode_s"),
                            "verify_s": part(local, "verify_s"), "cacheseek_s": cs_part(local)},
            # the chunk's first read per value that crossed the link (the others are local)
            "wall_per_crossed_value_s": med(per_remote),
        }
        # a whole chunk (80 values): the measured subset scaled by its value count
        scale = (2 * LAYERS_480P * VALUE_480P) / (n_values * rows[0]["value_bytes"])
        c["scaled_full_chunk_s"] = c["first_wall_s"] * scale
        c["vs_tcp_chunk"] = c["first_wall_s"] / tcp_chunk if tcp_chunk else None
        out["cases"][case] = c
    out["scale_to_full_chunk"] = (2 * LAYERS_480P) / (2 * layers)
    out["parallelism"] = parallelism
    return out


def slot_bytes(n: int) -> int:
    from cacheseek.fluxon.values import slot_bytes as slot

    return slot(n)


def table(summary: dict[str, Any], layers: int) -> list[str]:
    tc = summary["tcp_chunk_s"]
    lines = ["| case | values | first read s (median) | over the link | x raw TCP (same bytes) | "
             "scaled to 80 values s | replica read s | reader CPU s | write s |",
             "|---|---|---|---|---|---|---|---|---|",
             f"| raw TCP | - | {tc:.2f} ({summary['chunk_bytes'] / MiB:.0f} MiB) | all | 1.0 | "
             f"{tc * summary['scale_to_full_chunk']:.2f} | | | |"]
    for case, c in summary["cases"].items():
        over = "/".join(str(x) for x in c["values_over_link"])
        lines.append(f"| {case} | {c['values']} | {c['first_wall_s']:.2f} | {over} | {c['vs_tcp_chunk']:.1f} | "
                     f"{c['scaled_full_chunk_s']:.1f} | {c['replica_wall_s']:.2f} | {c['first_cpu_s']:.2f} | "
                     f"{c['write_wall_s']:.1f} |")
    return lines


def breakdown(summary: dict[str, Any]) -> list[str]:
    lines = ["| case | values | one value's read s | x raw TCP | fluxon-py get_blocking s | CacheSeek s (copy "
             "out, checksum, threads) | of which copy+check s | of which xxh3 s | MiB received |",
             "|---|---|---|---|---|---|---|---|---|"]
    tcp_per_byte = summary["tcp_value_s"] / VALUE_480P
    for case, c in summary["cases"].items():
        for where in ("remote_value", "local_value"):
            v = c[where]
            if not v["n"] or v.get("read_s") is None:
                continue

            def f(x: Optional[float], d: int = 3) -> str:
                return "-" if x is None else f"{x:.{d}f}"

            rx = f(v.get("rx_MiB"), 1) if where == "remote_value" and case in ("serial", "raw") else ""
            lines.append(f"| {case} | {'from a (over the link)' if where == 'remote_value' else 'own owner (b)'}, "
                         f"n={v['n']} | {f(v['read_s'])} | {v['read_s'] / (tcp_per_byte * c['value_bytes']):.1f} | "
                         f"{f(v['fluxon_get_s'])} | {f(v['cacheseek_s'])} | "
                         f"{f(v['decode_s'])} | {f(v['verify_s'])} | {rx} |")
    return lines


def plot(path: Path, data: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = data["summary"]
    cases = list(s["cases"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    labels = ["raw TCP"] + [c if c != "warmup" else "warmup\n(1st after join)" for c in cases]
    vals = [s["tcp_chunk_s"]] + [s["cases"][c]["first_wall_s"] for c in cases]
    ax1.bar(labels, vals, color=["grey"] + [f"C{i}" for i in range(len(cases))])
    for i, c in enumerate(cases, start=1):
        ax1.scatter([i] * len(s["cases"][c]["first_wall_s_all"]), s["cases"][c]["first_wall_s_all"], color="k", s=8,
                    zorder=3)
    ax1.set_ylabel(f"s: b's first read of a's chunk ({data['meta']['layers']} layers, "
                   f"{s['chunk_bytes'] / MiB:.0f} MiB)")
    ax1.set_title("first read across hosts vs raw TCP of the same bytes")
    ax1.tick_params(axis="x", labelsize=8, rotation=20)
    parts = [("fluxon_get_s", "fluxon-py get_blocking"), ("decode_s", "CacheSeek copy out + check"),
             ("other", "CacheSeek other (thread, header)")]
    names, stacks = [], {p: [] for p, _ in parts}
    for c in cases:
        v = s["cases"][c]["remote_value"]
        if read_mode(c, 1)[0] in ("serial", "raw") and v["n"] and v.get("fluxon_get_s") is not None:
            names.append(c)
            stacks["fluxon_get_s"].append(v["fluxon_get_s"])
            stacks["decode_s"].append(v.get("decode_s") or 0.0)
            stacks["other"].append(max(0.0, (v["read_s"] or 0) - v["fluxon_get_s"] - (v.get("decode_s") or 0.0)))
    bottom = [0.0] * len(names)
    for p, label in parts:
        ax2.bar(names, stacks[p], bottom=bottom, label=label)
        bottom = [b + x for b, x in zip(bottom, stacks[p])]
    ax2.axhline(s["tcp_value_s"], color="grey", ls="--", label=f"raw TCP, {VALUE_480P / MiB:.1f} MiB")
    ax2.set_ylabel("s per value pulled from a (median)")
    ax2.set_title("one value read alone (serial cases): whose time")
    ax2.legend(fontsize=7)
    ax2.tick_params(axis="x", labelsize=8, rotation=20)
    m = data["meta"]
    fig.suptitle(f"2 emulated hosts, commit {m['git']['git_commit']}, fluxon-py {m['fluxon_py']}, "
                 f"{m['env']['cpus']} CPUs (shared), read_parallelism {s['parallelism']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def readme_section(data: dict[str, Any]) -> str:
    m, s = data["meta"], data["summary"]
    lines = [f"`python experiments/shared_index/cross_host.py --layers {m['layers']} --reps {m['reps']} "
             f"--parallelism {s['parallelism']} --placement {m.get('placement', 'random')} --cases "
             f"{','.join(m['cases'])}` (as root) at commit {m['git']['git_commit']}"
             f"{' (dirty)' if m['git'].get('git_dirty') else ''}, fluxon-py {m['fluxon_py']}, torch "
             f"{m['env'].get('torch')}, Python {m['env']['python']}, {m['env']['cpus']} CPUs, "
             f"{m['env']['meminfo'].get('MemTotal', 0) / 2**30:.0f} GiB, {m['env']['platform']}, {m['env']['time']}; "
             f"owners {m['dram']} each, placement {m.get('placement', 'random')}; {m['wall_s'] / 60:.1f} min. "
             f"Medians of {m['reps']} reps; load average "
             f"during the cases {min(c['load1'] for c in s['cases'].values()):.1f}-"
             f"{max(c['load1'] for c in s['cases'].values()):.1f} (other jobs share the 2 CPUs).", "",
             f"Subset of a 480p chunk: {m['layers']} of 40 layers ({2 * m['layers']} values of "
             f"{VALUE_480P:,} B, {s['chunk_bytes'] / MiB:.0f} MiB); \"scaled to 80 values\" multiplies by "
             f"{s['scale_to_full_chunk']:.0f}. Raw TCP: {VALUE_480P / MiB:.1f} MiB in {s['tcp_value_s']:.3f} s "
             f"({s['tcp_MiB_s']:.0f} MiB/s), the subset's bytes in {s['tcp_chunk_s']:.2f} s.", ""]
    lines += table(s, m["layers"]) + [""]
    lines += ["Per value (median):", ""] + breakdown(s) + [""]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    global VALUE_480P
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--cluster", default="cacheseek", help=argparse.SUPPRESS)
    p.add_argument("--share", default="/dev/shm/cacheseek-fluxon", help=argparse.SUPPRESS)
    p.add_argument("--layers", type=int, default=8, help="layers of the 480p chunk measured (default 8 of 40)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--parallelism", type=int, default=4, help="reads in flight in the parallel cases")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--placement", choices=("remote", "random"), default="remote",
                   help="remote: every value on a's owner (b's joins after the writes); random: fluxon's own")
    p.add_argument("--dram", default=None, help="each owner, whole GiB (default: 14GiB remote, 4GiB random)")
    p.add_argument("--values", type=int, default=None, help="64 MiB-slot values one owner keeps (the dram check)")
    p.add_argument("--value-bytes", type=int, default=VALUE_480P,
                   help="bytes of one value (default one 480p layer's K: 47,923,200; experiments/codecs "
                        "passes a lossless-encoded value's size)")
    p.add_argument("--out", default=str(HERE))
    p.add_argument("--render", action="store_true", help="only redo the summary, plot and section from the JSON")
    args = p.parse_args(argv)
    if args.dram is None:
        args.dram = "14GiB" if args.placement == "remote" else "4GiB"
    if args.values is None:
        args.values = 8 * (int(args.dram.removesuffix("GiB")) * 1024 // 640)
    if args.worker:
        return worker_main(args.cluster, args.share)
    VALUE_480P = args.value_bytes  # every case's value size (the workers are told each value's size per call)
    from benchlib import env_info, git_state

    out = Path(args.out)
    name = "cross_host" if args.placement == "remote" else "cross_host_random"
    if args.render:
        data = json.loads((out / f"{name}.json").read_text())
        data["meta"].setdefault("placement", args.placement)
    else:
        import importlib.metadata as md

        t0 = time.monotonic()
        data = run(args)
        data["meta"] = {"git": git_state(), "fluxon_py": md.version("fluxon-py"), "env": env_info(),
                        "dram": args.dram, "reps": args.reps, "layers": args.layers, "placement": args.placement,
                        "cases": args.cases.split(","), "wall_s": time.monotonic() - t0,
                        "slot_bytes": {"value": slot_bytes(VALUE_480P), "split": slot_bytes(VALUE_480P // SPLIT)}}
    data["summary"] = summarize(data, data["meta"]["layers"], args.parallelism if not args.render
                                else data["summary"]["parallelism"])
    compact(data)
    write_results(out / f"{name}.json", data)
    plot(out / f"{name}.png", data)
    print(readme_section(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
