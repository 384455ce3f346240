"""How much the Plan tier's write-side waits slow a thread that launches short torch ops.

    python experiments/write_polls/bench_write_polls.py [key=value ...]     # conf/write_polls.yaml

On the H200 a writing session's model stream sits idle 142 ms longer a 6 s session than a
non-writing one, in gaps mostly under 0.5 ms (experiments/session_reuse, ``trace_gaps``): its
launching thread is held back. The suspect is the Plan tier's completion thread, which submits
each write piece and waits for it in `PendingBatch.wait`: a first sleep, then a poll every
``store.write_poll_s`` (200 us), each wake taking the GIL from the launching thread.

This bench runs that thread's own code (`Completion._trickle`: ``pieces_in_flight`` pieces in
flight, each waited for by the real `PendingBatch.wait`) against a simulated copy engine: one
engine, pieces in submission order at ``copy_gib_s``, a piece's event done once its time has
passed. Beside it, the launch loop: ``launch_ops`` torch additions of ``launch_numel`` floats in
one Python thread (each op releases the GIL while it runs, as a kernel launch does). Each round
runs every setting (piece size, poll interval) in a rotated order, the loop once with the writer
writing chunk after chunk and once without, in alternating order; a setting's slowdown is the
median of its pairs' ratios (with their quartiles). The writer's
side: its wakes (event queries) per chunk and the engine's idle share (the copies' own time
against the span: a coarser poll that leaves the engine idle makes the write longer).

What it does not show: the H200's figures. The CPU's GIL hand-offs and sleeps are this machine's
and the launch loop is not TeleFuser's; it ranks the settings, the H200 (``session_reuse
write_pairs``) decides. Writes ``results.json``, ``results.md`` and ``write_polls.png``.
"""

from __future__ import annotations

import sys
import threading
import time
import types
from pathlib import Path
from typing import Any, NamedTuple

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchlib import Progress, compose, cpu_model, env_info, git_state, median, plain, write_json  # noqa: E402

MiB = 1 << 20


class SimulatedCopyEngine:
    """A transfer runtime's submit and event calls over one simulated copy engine (the
    `EventSource` a `PendingBatch` asks): a batch starts when the engine is free and takes its
    bytes at ``gib_s``; its event is done once that time has passed. Nothing is copied."""

    wait_timeout_s = 30.0

    def __init__(self, gib_s: float) -> None:
        self.seconds_per_byte = 1.0 / (gib_s * (1 << 30))
        self.free_at = 0.0
        self.busy_s = 0.0
        self.queries = 0

    def submit_batch(self, batch: Any, *, stream: Any, device_ranges: Any = (), after: Any = ()) -> Any:
        from cacheseek.transfer.pending import Event, PendingBatch

        now = time.perf_counter()
        copy_s = batch.nbytes * self.seconds_per_byte
        self.free_at = max(now, self.free_at) + copy_s
        self.busy_s += copy_s
        return PendingBatch(self, batch, stream, Event(handle=self.free_at, stream=stream), now)

    def _event_query(self, event: Any) -> bool:
        self.queries += 1
        return time.perf_counter() >= event.handle

    def _event_synchronize(self, event: Any) -> None:
        left = event.handle - time.perf_counter()
        if left > 0:
            time.sleep(left)

    def release_event(self, event: Any) -> None:
        event.released = True

    def _record_dirs(self, per_dir: Any, seconds: float) -> None:
        return None


class Writer:
    """The completion thread writing chunk after chunk until stopped: per chunk ``values`` copies
    of ``chunk_bytes`` in all, cut into pieces of ``piece_bytes`` by the Plan tier's own `split`, through `Completion._trickle` with ``poll_s`` as the
    piece wait's poll (``store.write_poll_s``)."""

    def __init__(self, chunk_bytes: int, values: int, piece_bytes: int, pieces_in_flight: int, gib_s: float,
                 poll_s: float) -> None:
        from cacheseek.stores.plan_tier import write
        from cacheseek.stores.plan_tier.capacity import split
        from cacheseek.transfer.batch import CopyBatch, Direction

        self.engine = SimulatedCopyEngine(gib_s)
        size = chunk_bytes // values  # the chunk's D2H, one copy per value, cut as put_async cuts it
        offsets = [1 + i * size for i in range(values)]
        pieces = split(CopyBatch.of(offsets, offsets, [size] * values, Direction.D2H), piece_bytes)
        counters = types.SimpleNamespace(count=lambda **_: None)
        self.completion = write.Completion(None, counters, pieces_in_flight=pieces_in_flight, poll_s=poll_s,
                                           timeout_s=30.0)
        attached = types.SimpleNamespace(transfer=self.engine, write_stream=None,
                                         values=types.SimpleNamespace(device_ranges=[]))
        self.item = types.SimpleNamespace(attached=attached, slot=types.SimpleNamespace(range=lambda: None),
                                          snapshot=None, pieces=pieces)
        self.stop = threading.Event()
        self.chunks = 0
        self.span_s = 0.0
        self.thread = threading.Thread(target=self._run, name="plan-tier-commit", daemon=True)

    def _run(self) -> None:
        t0 = time.perf_counter()
        while not self.stop.is_set():
            self.completion._trickle(self.item)
            self.chunks += 1
        self.span_s = time.perf_counter() - t0

    def __enter__(self) -> "Writer":
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.thread.join(timeout=60)


class Loop(NamedTuple):
    """One run of the launch loop: its wall seconds, and its stalls (iterations longer than
    ``stall_s``: the thread waited, for the GIL or for a core) in number and seconds."""

    seconds: float
    stalls: int
    stall_s: float


def launch_loop(ops: int, numel: int, stall_s: float) -> Loop:
    """``ops`` torch additions of ``numel`` floats in this thread, each iteration timed."""
    import torch

    a, b, c = torch.ones(numel), torch.ones(numel), torch.empty(numel)
    stalls, stalled = 0, 0.0
    t0 = prev = time.perf_counter()
    for _ in range(ops):
        torch.add(a, b, out=c)
        now = time.perf_counter()
        if now - prev > stall_s:
            stalls += 1
            stalled += now - prev
        prev = now
    return Loop(prev - t0, stalls, stalled)


def main(argv: list[str]) -> dict:
    import torch

    torch.set_num_threads(1)  # one launch thread; the op itself does not spread over cores
    cfg = compose(HERE / "conf", "write_polls", argv)
    out_dir = Path(cfg.out_dir)
    settings = [(int(p), float(s)) for p in cfg.piece_bytes for s in cfg.poll_s]
    prog = Progress(int(cfg.reps) + 1, "write_polls")
    ops, numel, reps = int(cfg.launch_ops), int(cfg.launch_numel), int(cfg.reps)
    stall_s = float(cfg.stall_us) * 1e-6
    launch_loop(ops, numel, stall_s)  # warm-up
    prog.step(f"warm-up: {ops} ops in {launch_loop(ops, numel, stall_s).seconds * 1e3:.0f} ms without a writer")
    runs = {setting: {"alone": [], "beside": [], "wakes": [], "wakes_in_loop": [], "idle": []} for setting in settings}
    for rep in range(reps):  # every setting once a round, in a rotated order: drift falls on all alike
        for setting in settings[rep % len(settings):] + settings[:rep % len(settings)]:
            run = runs[setting]
            for with_writer in ((False, True) if rep % 2 == 0 else (True, False)):
                if not with_writer:
                    run["alone"].append(launch_loop(ops, numel, stall_s))
                    continue
                with Writer(int(cfg.chunk_bytes), int(cfg.values_per_chunk), setting[0], int(cfg.pieces_in_flight),
                            float(cfg.copy_gib_s), setting[1]) as w:
                    run["beside"].append(launch_loop(ops, numel, stall_s))
                run["wakes"].append(w.engine.queries / w.chunks)
                run["idle"].append(max(0.0, 1.0 - w.engine.busy_s / w.span_s))
                run["wakes_in_loop"].append(w.engine.queries * run["beside"][-1].seconds / w.span_s)
        prog.step(f"round {rep + 1} of {reps}: {len(settings)} settings, each with and without the writer")
    rows = []
    for (piece_bytes, poll_s), run in runs.items():
        alone, beside = run["alone"], run["beside"]
        ratios = sorted(b.seconds / a.seconds for a, b in zip(alone, beside))
        per_wake = [(b.stall_s - a.stall_s) / n for a, b, n in zip(alone, beside, run["wakes_in_loop"])]
        rows.append({"piece_mib": piece_bytes // MiB, "poll_ms": poll_s * 1e3,
                     "launch_alone_ms": median([a.seconds for a in alone]) * 1e3,
                     "launch_beside_ms": median([b.seconds for b in beside]) * 1e3,
                     "slowdown": median(ratios), "slowdown_q1_q3": [ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]],
                     "ratios": ratios, "stalls_alone": median([a.stalls for a in alone]),
                     "stalls_beside": median([b.stalls for b in beside]),
                     "stall_us_per_wake": median(per_wake) * 1e6,
                     "wakes_per_chunk": median(run["wakes"]), "engine_idle": median(run["idle"]),
                     "product_default": piece_bytes == 32 * MiB and abs(poll_s - 2e-4) < 1e-9})
    results = {"command": "python experiments/write_polls/bench_write_polls.py " + " ".join(argv),
               "config": plain(cfg), "env": {**env_info(), **git_state(), "cpu_model": cpu_model()}, "rows": rows}
    write_json(out_dir / "results.json", results)
    (out_dir / "results.md").write_text(_table(results))
    _plot(rows, out_dir / "write_polls.png")
    print(_table(results))
    return results


def _table(results: dict) -> str:
    env = results["env"]
    lines = [f"# write_polls ({env['git_commit']}{' with local changes' if env.get('git_dirty') else ''}, {env['cpu_model']}, "
             f"{env['cpus']} CPUs, Python {env['python']}, torch {env['torch']})", "",
             f"`{results['command']}`", "",
             "| pieces | poll | launch loop alone | beside the writer | slowdown (median of pairs) | quartiles | stalls alone / beside | stall a wake | wakes a chunk | engine idle |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results["rows"]:
        mark = " (product)" if r["product_default"] else ""
        lines.append(f"| {r['piece_mib']} MiB{mark} | {r['poll_ms']:.1f} ms | {r['launch_alone_ms']:.0f} ms | "
                     f"{r['launch_beside_ms']:.0f} ms | {r['slowdown']:.3f}x | {r['slowdown_q1_q3'][0]:.3f}-{r['slowdown_q1_q3'][1]:.3f} | "
                     f"{r['stalls_alone']:.0f} / {r['stalls_beside']:.0f} | {r['stall_us_per_wake']:.1f} us | {r['wakes_per_chunk']:.0f} | "
                     f"{r['engine_idle']:.1%} |")
    return "\n".join(lines) + "\n"


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(14, 4))
    polls = sorted({r["poll_ms"] for r in rows})
    for piece in sorted({r["piece_mib"] for r in rows}):
        mine = [r for r in rows if r["piece_mib"] == piece]
        label = f"{piece} MiB pieces"
        ax1.plot([r["poll_ms"] for r in mine], [r["slowdown"] for r in mine], marker="o", label=label)
        ax2.plot([r["wakes_per_chunk"] for r in mine], [r["stalls_beside"] - r["stalls_alone"] for r in mine],
                 marker="o", label=label)
        ax3.plot([r["poll_ms"] for r in mine], [100 * r["engine_idle"] for r in mine], marker="o", label=label)
    ax1.axhline(1.0, color="grey", lw=0.8)
    for ax in (ax1, ax3):
        ax.set_xscale("log")
        ax.set_xticks(polls, [f"{p:g}" for p in polls])
        ax.minorticks_off()
        ax.set_xlabel("piece wait's poll, store.write_poll_s (ms)")
    ax1.set(ylabel="launch loop beside the writer / alone", title="launch thread slowdown (median of pairs)")
    ax2.set(xlabel="writer's wakes a chunk", ylabel="launch-loop stalls added (median)",
            title="stalls follow the wakes")
    ax3.set(ylabel="copy engine idle (%)", title="writer's engine idle")
    ax1.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main(sys.argv[1:])
