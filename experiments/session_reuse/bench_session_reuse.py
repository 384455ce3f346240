"""Whole-session reuse on TeleFuser's real pipeline at LingBot-World 14B's size (issue 32).

A restored chunk hands out its stored frames; KV, latents and the decoder's state move into the
runtime only where the session computes. One child process per store in ``stores`` (``--one
STORE``), each on TeleFuser 0.1.0.post3's pipeline with the ``lingbot_world_14b`` preset (random
bf16 weights on the GPU, real Wan VAE and umT5), 480x832:

1. builds the stack; one warm-up chunk without a cache;
2. P+X without a cache (``nocache_before``), the gate (A cold + write, B full hit, C 2/3 hit, D cold
   fork; no ring check), P+X without a cache again (``nocache_after``): each request's ratio is
   against the mean of the two, timed as the gate times a request;
3. B again with each stage timed (synchronized; ``b_stages``): TeleFuser's prompt and condition
   encodes in ``create_runtime``, CacheSeek's creation hook, each chunk's frames read and hand-out;
   then B as a fresh worker's first session (``b_fresh_worker``: the process's keep of encodes
   forgotten, both loaded from the store) and the encoders' fingerprints such a worker pays once;
4. the time to the first frame of a planned session whose chunks are all cached (creation and its
   chunk 0);
5. live sessions streamed one action per chunk: one that computes a path, then ``live_sessions``
   that follow it: each chunk's seconds (chunk 0's with the session's creation: the time to the
   first frame), their frames checked equal to the first's;
6. (``sweep_stores``) a session of ``max(sweep_k) + 2`` chunks computed and written, then for each
   k a session sharing its first k chunks: the seconds of its first computed chunk (the served
   prefix restored, the decoder's state rebuilt by decoding the k served latents, then the chunk)
   against the same chunk of a run without a cache, and the decoder's state priced both ways:
   rebuilt (the replay's seconds, measured) or stored (its bytes after chunk k, its copy from pinned
   host memory and from device memory);
7. (``write_pairs``) what writing costs a cold session, paired: new actions run cold without
   writing and cold writing, in alternating order (`_write_pairs`); last, as their writes evict
   the gate's chunks; with ``write_profile`` one more pair profiled (`_profile_pair`, `trace_gaps`);
8. the bytes stored beyond the KV (frames) against the KV's, from the metrics.

The parent writes ``store_<store>.json`` per store, ``results.json`` (machine, versions, commit,
every figure), ``results.md`` (the tables) and ``session_reuse.png``.

    python experiments/session_reuse/bench_session_reuse.py [key=value ...]   # conf/session_reuse.yaml
    python experiments/session_reuse/bench_session_reuse.py device=cpu stores=[fluxon_plan] sweep_k=[1,2] \\
        "store_overrides.fluxon_plan=['+store=fluxon_plan','store.backing=private']" \\
        "runtime_overrides=['runtime.n_layers=1','runtime.n_heads=1','runtime.head_dim=14','runtime.ffn_dim=32','runtime.text_dim=16','runtime.text_layers=1','runtime.height=32','runtime.width=32']"
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from benchlib import REPO, compose, env_info, git_state, write_json  # noqa: E402
from gate_children import built, child_stack, device_sync, entry, nocache_run, plain, profiled, run_children  # noqa: E402

REQUESTS = ("A", "B", "C", "D")
TARGETS = {"B_ratio": 0.03, "C_ratio": 0.40, "live_restored_ms": 15.0, "ttff_ms": 60.0, "first_computed_ratio": 1.3,
           "A_over": 0.02, "bytes_beyond_kv": 0.15}
TABLE_EVERY = (1, 2, 4, 8)  # resume points priced in the decoder-state table


def run_names(cfg: Any) -> list[str]:
    """``STORE.decN`` for each value of ``decoder_state_every`` (the first value first, every store)."""
    return [f"{store}.dec{int(n)}" for n in cfg.decoder_state_every for store in cfg.stores]


def main(argv: list[str]) -> dict:
    cfg = compose(HERE / "conf", "session_reuse", argv)
    out_dir = Path(cfg.out_dir) if cfg.out_dir else REPO / "outputs" / "experiments" / "session_reuse"
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "what": "whole-session reuse (issue 32) on TeleFuser's real pipeline at lingbot_world_14b, one process per "
                "store and decoder_state_every, no-cache P+X bracketing the requests in the same process",
        "command": " ".join(["python", "experiments/session_reuse/bench_session_reuse.py", *argv]),
        "config": plain(cfg), "env": {**env_info(), **git_state()}, "targets": TARGETS, "stores": {},
    }
    t_all = time.perf_counter()
    run_children(Path(__file__), run_names(cfg), argv, cfg, out_dir, results)
    results["summary"] = {s: _summary(r) for s, r in results["stores"].items() if "requests" in r}
    results["decoder_state_table"] = _decoder_state_table(results)
    write_json(out_dir / "results.json", results)
    text = _markdown(results)
    (out_dir / "results.md").write_text(text)
    try:
        _plot(results, out_dir / "session_reuse.png")
    except Exception as exc:  # noqa: BLE001 - the figures are in results.json whatever the plot does
        print(f"plot failed: {exc!r}", flush=True)
    print(text, flush=True)
    print(f"wrote {out_dir / 'results.json'} ({time.perf_counter() - t_all:.0f} s)", flush=True)
    return results


# -- one store's process ---------------------------------------------------------------------------

def run_one(name: str, argv: list[str]) -> None:
    """One run ``STORE.decN``: with the first value of ``decoder_state_every`` everything (module
    docstring, steps 1-7); with another the gate and the sweep (what the decoder's state changes)."""
    from stages import stage_timers

    cfg = compose(HERE / "conf", "session_reuse", argv)
    out_dir = Path(cfg.out_dir) if cfg.out_dir else REPO / "outputs" / "experiments" / "session_reuse"
    store, _, dec = name.rpartition(".dec")
    every = int(dec)
    full = every == int(cfg.decoder_state_every[0])
    sync = device_sync(cfg.device)
    t0 = time.perf_counter()
    stack, overrides = child_stack(cfg, store, out_dir, name, [f"manager.decoder_state_every={every}"])
    row: dict[str, Any] = {"store": store, "decoder_state_every": every, "overrides": overrides}
    try:
        factory, gate = stack.runtime_factory, stack.workload
        row.update(built(stack, t0))
        print(f"  built in {row['build_s']:.1f} s: {row['runtime']['model']}, decoder_state_every={every}", flush=True)
        px = gate.P + gate.X

        def nocache(actions: list, label: str) -> float:
            return nocache_run(factory, actions, label, sync)[0]

        nocache(px[:1], "warm-up (1 chunk, no cache)")
        row["nocache_before_s"] = nocache(px, "no cache P+X (before)")
        res = gate.run(stack)
        row["passed"], row["verdicts"] = res["passed"], res["verdicts"]
        row["requests"] = {r["name"]: {k: r[k] for k in ("wall_s", "hit_depth", "bytes_restored", "bytes_written",
                                                         "frames_served", "chunks_materialized", "verdict")}
                           for r in res["requests"]}
        for req, r in row["requests"].items():
            print(f"  {req}: {r['wall_s']:.3f} s, K={r['hit_depth']}, frames served {r['frames_served']}, "
                  f"materialized {r['chunks_materialized']}, {r['verdict']}", flush=True)
        print(f"  gate {'PASS' if res['passed'] else 'FAIL'} {res['verdicts']}", flush=True)
        row["gate_metrics"] = {k: v for k, v in stack.metrics.as_dict().items()
                               if k.startswith(("decoder_", "frames_")) or k in ("write_bytes", "materializations")}
        g = row["gate_metrics"]
        print(f"  decoder states: {g['decoder_states_written']} stored ({g['decoder_state_write_bytes'] / 2**30:.2f} GiB), "
              f"{g['decoder_states_dropped']} dropped, {g['decoder_states_restored']} loaded, "
              f"{g['decoder_states_missing']} missing, {g['decoder_states_corrupt']} corrupt; "
              f"{g['decoder_replays']} chunks replayed; frames {g['frames_written']} stored, "
              f"{g['frames_dropped']} dropped", flush=True)

        if full:
            with stage_timers(sync) as stages, profiled(out_dir, f"{name}.B2"):  # B again, each stage synchronized
                again = gate._request(stack, "B2", px, "P+X")
            row["b_stages"] = {"wall_s": again.wall_s, "hit_depth": again.hit_depth, **stages}
            print("  B stages (ms): " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in stages.items()), flush=True)
            row["b_fresh_worker"] = _fresh_worker_b(stack, factory, gate, px, sync)

            binding = stack.new_binding()
            session = factory.make(px, hooks=binding)
            sync()
            start = time.perf_counter()
            session.generate(stop_after=1)
            sync()
            row["ttff_planned_s"] = time.perf_counter() - start
            row["ttff_planned_served"] = binding.frames_served
            session.generate()
            print(f"  time to first frame, planned session on a cached path: {row['ttff_planned_s'] * 1e3:.1f} ms",
                  flush=True)

            with profiled(out_dir, f"{name}.C2"):
                c2 = gate._request(stack, "C2", gate.P + gate.Z[len(gate.P):], "P+Z")  # a suffix not cached yet
            row["c_again"] = {"wall_s": c2.wall_s, "hit_depth": c2.hit_depth, "frames_served": c2.frames_served}
            print(f"  C again (P+Z): {c2.wall_s:.3f} s, K={c2.hit_depth}", flush=True)
            with profiled(out_dir, f"{name}.live"):
                row["live"] = _live(stack, factory, px, int(cfg.live_sessions), sync)
            lv = row["live"]
            print(f"  live: restored chunk median {_ms(lv['restored_median_s'])} (generate_next_chunk "
                  f"{_ms(lv['restored_seam_median_s'])}, with the control's build {_ms(lv['restored_service_median_s'])}),"
                  f" computed {_ms(lv['computed_median_s'])}, time to first frame median {_ms(lv['ttff_median_s'])},"
                  f" frames equal {lv['frames_equal']}", flush=True)
        if store in cfg.sweep_stores:
            row["sweep"] = _sweep(stack, factory, list(cfg.sweep_k), bool(cfg.sweep_nocache_ref), sync)
        if full and int(cfg.write_pairs):  # last: its writes evict the gate's chunks
            row["write_pairs"] = _write_pairs(stack, gate, int(cfg.write_pairs),
                                              out_dir / f"writes_{name}" if cfg.write_profile else None)
        row["nocache_after_s"] = nocache(px, "no cache P+X (after)")
        m = stack.metrics.as_dict()
        row["metrics"] = m
        kv = m["write_bytes"]
        row["bytes_beyond_kv"] = (m["frames_write_bytes"] + m["decoder_state_write_bytes"]) / kv if kv else None
        row["frames_beyond_kv"] = m["frames_write_bytes"] / kv if kv else None
        row["decoder_state_beyond_kv"] = m["decoder_state_write_bytes"] / kv if kv else None
    finally:
        stack.close()
    write_json(out_dir / f"store_{name}.json", row)


def _fresh_worker_b(stack: Any, factory: Any, gate: Any, px: list, sync: Any) -> dict:
    """B as a fresh worker's first session runs it: the process's keep of encodes forgotten, so
    both come from the store (`encodes_loaded`); plus what such a worker pays once at ``attach``,
    the encoders' weights fingerprints (the keys of the stored encodes)."""
    import torch
    from stages import stage_timers

    from cacheseek import weights
    from cacheseek.integrations.telefuser import hooks_of

    p = factory.pipeline
    out = {}
    for name, enc in (("text_encoder", p.text_encoder), ("vae", p.vae)):
        sync()
        t = time.perf_counter()
        named = (enc.state_dict().items() if callable(getattr(enc, "state_dict", None))  # a stand-in: its tensors
                 else [(k, v) for k, v in vars(enc).items() if isinstance(v, torch.Tensor)])
        weights.tensor_fingerprint(sorted(named))
        sync()
        out[f"fingerprint_{name}_s"] = time.perf_counter() - t
    hooks_of(p).encodes.clear()
    loaded = stack.metrics.as_dict()["encodes_loaded"]
    with stage_timers(sync, only=("create_runtime", "encode_prompt", "encode_condition")) as stages:
        b = gate._request(stack, "B3", px, "P+X")
    out.update(wall_s=b.wall_s, hit_depth=b.hit_depth, encodes_loaded=stack.metrics.as_dict()["encodes_loaded"] - loaded,
               **stages)
    print(f"  B, a fresh worker's keep: {b.wall_s:.3f} s, {out['encodes_loaded']} encodes loaded; "
          + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in stages.items())
          + f"; at attach, once per worker: fingerprints umT5 {out['fingerprint_text_encoder_s'] * 1e3:.1f} ms, "
          f"VAE {out['fingerprint_vae_s'] * 1e3:.1f} ms", flush=True)
    return out


def _write_pairs(stack: Any, gate: Any, pairs: int, profile_dir: Optional[Path] = None) -> dict:
    """What writing costs a cold session, paired: for each of ``pairs`` fresh action lists (no
    chunk of them cached), the session twice through the same binding path, once cold without
    writing (a fresh trie, no ingest: the gate's D) and once cold and writing into the shared cache
    (the gate's A), in alternating order so that a drift of the device's speed over the process
    favours neither. Both load the session's encodes from the store (the gate's A stored them), so
    the pair differs only in the chunks' KV, frames and decoder states written. The gate's own A
    also pays the process's first writes and its encodes computed. With ``profile_dir``, one more
    pair under the profiler (`_profile_pair`)."""
    rows = []
    for i in range(pairs):
        order = ("cold", "write") if i % 2 == 0 else ("write", "cold")
        walls = _pair(stack, gate, f"{i}", _new_actions(gate, 9001 + i), order)
        rows.append({"pair": i, "first": order[0], "cold_s": walls["cold"],
                     "write_s": walls["write"], "ratio": walls["write"] / walls["cold"]})
        print(f"  write pair {i}: cold without writing {walls['cold']:.3f} s, cold writing {walls['write']:.3f} s "
              f"({rows[-1]['ratio']:.4f}x)", flush=True)
    ratios = [r["ratio"] for r in rows]
    out = {"rows": rows, "median_ratio": statistics.median(ratios), "min_ratio": min(ratios), "max_ratio": max(ratios)}
    if profile_dir is not None:
        out["profiled"] = _profile_pair(stack, gate, profile_dir)
    return out


def _pair(stack: Any, gate: Any, tag: str, actions: list, order: tuple, around: Any = None) -> dict:
    """One write pair on ``actions`` in ``order`` (kinds ``cold`` and ``write``): each kind's wall.
    ``around(kind)``: a context manager each session runs in (default none)."""
    walls = {}
    for kind in order:
        extra = _not_writing(stack) if kind == "cold" else {}
        with (around(kind) if around is not None else contextlib.nullcontext()):
            req = gate._request(stack, f"{kind}{tag}", actions, f"Z{tag}", **extra)
        if req.hit_depth:
            raise SystemExit(f"write pair {tag}: the {kind} session hit {req.hit_depth} chunks; its actions must be new")
        walls[kind] = req.wall_s
    return walls


def _not_writing(stack: Any) -> dict:
    """A request's arguments for a session that neither finds nor writes a chunk (the gate's D)."""
    from cacheseek.reuse.exact_prefix import NamespaceForest

    return {"manager": stack.new_manager(forest=NamespaceForest(), shared_index=False), "ingest": False}


def _new_actions(gate: Any, seed: int) -> list:
    """A session of the gate's length and action width whose actions no other session has."""
    import random

    rng = random.Random(seed)
    return [[round(rng.uniform(-1, 1), 4) for _ in range(len(gate.P[0]))] for _ in range(gate.n)]


def _profile_pair(stack: Any, gate: Any, out_dir: Path) -> dict:
    """One more pair under torch's profiler (CPU and, on a GPU, CUDA activities, with Python
    frames), to find where writing's cost goes. Per kind: the ``key_averages`` tables sorted by
    device time and by CPU time (``<kind>_by_device.txt``, ``<kind>_by_cpu.txt``, diffable op by op),
    and from the trace the model stream's busy and idle time and what the launching thread was
    doing in each idle gap (`trace_gaps`; ``gaps.md``, ``gaps.json``). The profiler's own
    overhead is in both sessions alike."""
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile

    import trace_gaps

    out_dir.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    gaps = {}

    @contextlib.contextmanager
    def around(kind: str) -> Any:
        with profile(activities=activities, with_stack=True, acc_events=True) as prof:
            yield
        table = prof.key_averages()
        (out_dir / f"{kind}_by_device.txt").write_text(
            table.table(sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=60))
        (out_dir / f"{kind}_by_cpu.txt").write_text(table.table(sort_by="cpu_time_total", row_limit=60))
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(path))
            gaps[kind] = trace_gaps.analyse(json.loads(path.read_text()))

    walls = _pair(stack, gate, "P", _new_actions(gate, 9901), ("cold", "write"), around)
    delta = trace_gaps.compare(gaps["cold"], gaps["write"])
    (out_dir / "gaps.md").write_text(trace_gaps.markdown(gaps, delta))
    write_json(out_dir / "gaps.json", {"sessions": gaps, "delta": delta})
    print(f"  write pair profiled: cold {walls['cold']:.3f} s, writing {walls['write']:.3f} s; model stream busy "
          f"{delta['busy_s'] * 1e3:+.1f} ms, idle {delta['idle_s'] * 1e3:+.1f} ms writing; tables in {out_dir}", flush=True)
    for name, v in list(delta["by_host_call"].items())[:4]:
        print(f"    gaps opened in host call {name}: {v * 1e3:+.1f} ms", flush=True)
    for name, v in list(delta["by_frame"].items())[:6]:
        print(f"    gaps across CacheSeek frame {name}: {v * 1e3:+.1f} ms", flush=True)
    return {"cold_s": walls["cold"], "write_s": walls["write"], "dir": out_dir.name, "busy_delta_s": delta["busy_s"],
            "idle_delta_s": delta["idle_s"]}


def _ms(seconds: Any) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"


def _chunks(session: Any, n: int, sync: Any, start: int = 0) -> list[float]:
    """The seconds of each of chunks ``start..start+n-1`` (chunk 0's with the session's creation)."""
    times = []
    for i in range(start, start + n):
        sync()
        start = time.perf_counter()
        session.generate(stop_after=i + 1)
        sync()
        times.append(time.perf_counter() - start)
    return times


def _live(stack: Any, factory: Any, actions: list, sessions: int, sync: Any) -> dict:
    """One live session computes the path, ``sessions`` follow it. Each following chunk's seconds
    three ways: the session's chunk (with this bench's frame hash), ``generate_next_chunk`` as
    attached (what the service's call costs: the key of the control, the lookup, the frames read
    and checked, the images), and that with TeleFuser's build of the control before it."""
    from stages import stage_timers

    manager = stack.new_manager()
    first = stack.new_binding(manager)
    s = factory.make(actions, hooks=first, streamed=True)
    computed = _chunks(s, len(actions), sync)
    reference = list(s.frame_hashes)
    first.close()
    restored, seam, service, ttff, equal, served = [], [], [], [], True, []
    for _ in range(sessions):
        b = stack.new_binding(manager)
        s = factory.make(actions, hooks=b, streamed=True)
        with stage_timers(sync, only=("chunk_seam", "control_build")) as st:
            times = []
            for i in range(len(actions)):
                before = dict(st)
                times += _chunks(s, 1, sync, start=i)
                if i:
                    seam.append(st["chunk_seam"] - before["chunk_seam"])
                    service.append(seam[-1] + st.get("control_build", 0.0) - before.get("control_build", 0.0))
        ttff.append(times[0])
        restored += times[1:]
        equal = equal and s.frame_hashes == reference
        served.append(b.frames_served)
        b.close()
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    return {"computed_s": computed, "restored_s": restored, "restored_seam_s": seam, "restored_service_s": service,
            "ttff_s": ttff, "frames_equal": equal, "served": served,
            "computed_median_s": statistics.median(computed[1:] or computed), "restored_median_s": med(restored),
            "restored_seam_median_s": med(seam), "restored_service_median_s": med(service), "ttff_median_s": med(ttff)}


def _sweep(stack: Any, factory: Any, ks: list[int], nocache_ref: bool, sync: Any) -> dict:
    """The first computed chunk after k served chunks, against the same chunk of a cold run; the
    decoder's state rebuilt by replay, or loaded where it was stored (``decoder_state_every``)."""
    import random

    import torch

    from stages import STAGES, stage_timers

    n = max(ks) + 2  # chunk k is never the last: its decode keeps the decoder's state (the last clears it)
    rng = random.Random(32)
    z = [[rng.uniform(-1, 1) for _ in range(3)] for _ in range(n)]
    manager = stack.new_manager()
    writer = stack.new_binding(manager)
    cold_written = _chunks(factory.make(z, hooks=writer), n, sync)
    stack.store.flush()
    cold = _chunks(factory.make(z, hooks=None), n, sync) if nocache_ref else cold_written
    print(f"  sweep: {n} chunks cold {sum(cold):.2f} s (written {sum(cold_written):.2f} s)", flush=True)
    rows = []
    vae = factory.pipeline.vae
    metrics = stack.metrics
    for k in ks:
        actions = z[:k] + [[rng.uniform(-1, 1) for _ in range(3)] for _ in range(n - k)]
        b = stack.new_binding(manager, ingest_enabled=False)
        s = factory.make(actions, hooks=b)
        served = _chunks(s, k, sync)
        before = metrics.as_dict()
        on_main = [name for name in STAGES if name != "decoder_state_read"]
        # a late state is read on a reader thread while the chunk denoises: timed there without a
        # device synchronize (one would wait for the model's queued work, not the read's)
        with stage_timers(sync, only=on_main) as st, stage_timers(lambda: None, only=("decoder_state_read",)) as rd:
            sync()
            start = time.perf_counter()
            s.generate(stop_after=k + 1)
            sync()
            first = time.perf_counter() - start
        after = metrics.as_dict()
        cache = [t for t in getattr(vae, "_feat_cache", None) or [] if isinstance(t, torch.Tensor)]
        stored = _decoder_state_copies(cache, sync)
        rows.append({"k": k, "served_s": served, "first_computed_s": first, "cold_chunk_s": cold[k],
                     "ratio": first / cold[k], "frames_served": b.frames_served,
                     "chunks_materialized": b.chunks_materialized, "replay_s": st.get("decoder_replay", 0.0) + st.get("decoder_catch_up", 0.0),
                     "materialize_s": st.get("materialize", 0.0), "state_read_s": rd.get("decoder_state_read", 0.0),
                     "replayed": after["decoder_replays"] - before["decoder_replays"],
                     "state_loaded": after["decoder_states_restored"] - before["decoder_states_restored"], **stored})
        x = rows[-1]
        print(f"  k={k}: first computed chunk {first:.3f} s vs cold {cold[k]:.3f} s ({x['ratio']:.3f}x); "
              f"decoder state loaded {x['state_loaded']} ({x['state_read_s'] * 1e3:.1f} ms), {x['replayed']} chunks "
              f"replayed ({x['replay_s']:.3f} s); a state is {stored['decoder_state_bytes'] / 2**30:.2f} GiB "
              f"({stored['decoder_state_from_host_s'] * 1e3:.1f} ms from pinned host)", flush=True)
        b.close()
    return {"chunks": n, "cold_s": cold, "cold_written_s": cold_written, "rows": rows}


def _decoder_state_copies(tensors: list, sync: Any) -> dict:
    """The decoder state's bytes and its copies: from pinned host memory (a host tier's restore)
    and device to device (an HBM tier's)."""
    import torch

    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    if not tensors:
        return {"decoder_state_bytes": 0, "decoder_state_from_host_s": 0.0, "decoder_state_d2d_s": 0.0}
    cuda = tensors[0].is_cuda
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda) for t in tensors]
    for h, t in zip(host, tensors):
        h.copy_(t)
    back = [torch.empty_like(t) for t in tensors]
    sync()
    start = time.perf_counter()
    for b, h in zip(back, host):
        b.copy_(h, non_blocking=True)
    sync()
    from_host = time.perf_counter() - start
    start = time.perf_counter()
    for b, t in zip(back, tensors):
        b.copy_(t)
    sync()
    return {"decoder_state_bytes": nbytes, "decoder_state_from_host_s": from_host,
            "decoder_state_d2d_s": time.perf_counter() - start}


# -- results --------------------------------------------------------------------------------------

def _summary(r: dict) -> dict:
    base = (r["nocache_before_s"] + r["nocache_after_s"]) / 2 if r.get("nocache_after_s") else r.get("nocache_before_s")
    out: dict[str, Any] = {"nocache_mean_s": base, "passed": r.get("passed"), "every": r.get("decoder_state_every")}
    for name in REQUESTS:
        req = (r.get("requests") or {}).get(name)
        out[f"{name}_s"] = req["wall_s"] if req else None
        out[f"{name}_ratio"] = req["wall_s"] / base if req and base else None
    lv = r.get("live") or {}
    for key in ("restored", "restored_seam", "restored_service", "ttff"):
        v = lv.get(f"{key}_median_s")
        out[f"live_{key}_ms"] = None if v is None else 1e3 * v
    out["ttff_planned_ms"] = 1e3 * r["ttff_planned_s"] if r.get("ttff_planned_s") is not None else None
    sw = (r.get("sweep") or {}).get("rows") or []
    out["first_computed_ratio_max"] = max((x["ratio"] for x in sw if x["k"] <= 8), default=None)
    out["first_computed_ratios"] = {x["k"]: x["ratio"] for x in sw}
    for key in ("bytes_beyond_kv", "frames_beyond_kv", "decoder_state_beyond_kv"):
        out[key] = r.get(key)
    out["write_pairs"] = r.get("write_pairs")
    return out


def _decoder_state_table(results: dict) -> dict:
    """Bytes stored against seconds added at divergence for a resume point every N chunks, from
    the sweeps: the replay's seconds per chunk (runs with N = 0), a stored state's load (runs that
    loaded one), its bytes, a chunk's KV bytes (the gate's A: 3 chunks written)."""
    replay, load, state_bytes, kv_chunk = [], [], [], []
    for r in results["stores"].values():
        for x in (r.get("sweep") or {}).get("rows") or []:
            if x.get("replayed"):
                replay.append(x["replay_s"] / x["replayed"])
            if x.get("state_loaded"):
                load.append(x["state_read_s"])
            if x.get("decoder_state_bytes"):
                state_bytes.append(x["decoder_state_bytes"])
        a = (r.get("requests") or {}).get("A")
        if a and a.get("bytes_written"):
            kv_chunk.append(a["bytes_written"] / 3)
    if not (replay and state_bytes and kv_chunk):
        return {}
    per_replay = statistics.median(replay)
    per_load = statistics.median(load) if load else None
    size, kv = statistics.median(state_bytes), statistics.median(kv_chunk)
    rows = [{"every": 0, "bytes_beyond_kv": 0.0, "worst_added_s": 8 * per_replay, "mean_added_s": 4.5 * per_replay}]
    for n in TABLE_EVERY:
        lo = per_load or 0.0
        added = [(k % n) * per_replay + lo if k >= n else k * per_replay
                 for k in range(1, 9)]  # k served: the state after chunk n*floor(k/n)-1 loaded, the rest replayed
        rows.append({"every": n, "bytes_beyond_kv": size / (n * kv), "worst_added_s": max(added),
                     "mean_added_s": sum(added) / len(added)})
    return {"replay_s_per_chunk": per_replay, "state_load_s": per_load, "state_bytes": size, "kv_bytes_per_chunk": kv,
            "rows": rows}


def _markdown(results: dict) -> str:
    e = results["env"]
    lines = [f"# session_reuse: {e.get('gpu', 'no GPU')}, torch {e.get('torch')}, git {e.get('git_commit')}"
             f"{' (dirty)' if e.get('git_dirty') else ''}, {e.get('time')}", "",
             "| store | decoder state every | no cache P+X | A cold + write | B full hit | C 2/3 hit | D cold fork | live "
             "restored chunk: generate_next_chunk / with the control's build / session (median) | time to first frame: "
             "planned / live | first computed after k = 1, 2, 4, 8 | bytes beyond KV: frames + decoder state | gate |",
             "| --- | ---: | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for run, s in results.get("summary", {}).items():
        def cell(name: str) -> str:
            v, q = s[f"{name}_s"], s[f"{name}_ratio"]
            return "-" if v is None else f"{v:.3f} s ({q:.3f}x)"

        def ms(v: Any) -> str:
            return "-" if v is None else f"{v:.1f}"

        fc = ", ".join(f"{q:.2f}x" for q in s["first_computed_ratios"].values()) or "-"
        bb = "-" if s["bytes_beyond_kv"] is None else (f"{s['bytes_beyond_kv']:.1%} ({s['frames_beyond_kv']:.2%} + "
                                                       f"{s['decoder_state_beyond_kv']:.1%})")
        live = (f"{ms(s['live_restored_seam_ms'])} / {ms(s['live_restored_service_ms'])} / {ms(s['live_restored_ms'])} ms"
                if s["live_restored_ms"] is not None else "-")
        ttff = (f"{ms(s['ttff_planned_ms'])} / {ms(s['live_ttff_ms'])} ms" if s["ttff_planned_ms"] is not None else "-")
        lines.append(f"| {run.rpartition('.dec')[0]} | {s['every'] or 'off (replay)'} | {s['nocache_mean_s']:.3f} s | "
                     f"{cell('A')} | {cell('B')} | {cell('C')} | {cell('D')} | {live} | {ttff} | {fc} | {bb} | "
                     f"{'PASS' if s['passed'] else 'FAIL'} |")
    t = results["targets"]
    lines += ["", f"Targets: B <= {t['B_ratio']}x, C <= {t['C_ratio']}x, a restored live chunk <= {t['live_restored_ms']} ms, "
                  f"time to first frame <= {t['ttff_ms']} ms, first computed chunk after k <= 8 restored <= "
                  f"{t['first_computed_ratio']}x a cold chunk, A within {t['A_over']:.0%} of no cache, bytes beyond the "
                  f"KV <= {t['bytes_beyond_kv']:.0%}. Ratios: wall over the mean of the two no-cache P+X runs of the same "
                  "process. A live restored chunk: `generate_next_chunk` as attached (the control's key, the lookup, "
                  "the frames read and checked, the images), then with TeleFuser's build of the control before it "
                  "(as its service calls both), then the session's whole chunk (with this bench's frame hash)."]
    for run, s in results.get("summary", {}).items():
        wp = s.get("write_pairs")
        if wp:
            lines += ["", f"## What writing costs a cold session ({run}, paired, alternating order)", "",
                      "| pair | first | cold, not writing s | cold, writing s | ratio |", "| ---: | --- | ---: | ---: | ---: |"]
            lines += [f"| {x['pair']} | {x['first']} | {x['cold_s']:.3f} | {x['write_s']:.3f} | {x['ratio']:.4f}x |"
                      for x in wp["rows"]]
            lines += ["", f"Median {wp['median_ratio']:.4f}x (range {wp['min_ratio']:.4f}-{wp['max_ratio']:.4f}x). Both "
                      "sessions of a pair run through the same binding on new actions and load the session's encodes "
                      "from the store; only the writes of the chunks' KV, frames and decoder states differ."]
    table = results.get("decoder_state_table") or {}
    if table:
        lines += ["", "## The decoder's state: stored every N chunks against rebuilt (replayed) at divergence", "",
                  f"Measured: the replay {table['replay_s_per_chunk']:.3f} s per served chunk; a stored state "
                  f"{table['state_bytes'] / 2**30:.2f} GiB ({table['state_bytes'] / table['kv_bytes_per_chunk']:.1%} of a "
                  f"chunk's KV), loaded in " + ("-" if table["state_load_s"] is None else f"{table['state_load_s'] * 1e3:.1f} ms")
                  + ". Seconds added to the first computed chunk after k = 1..8 served chunks:", "",
                  "| decoder state every | bytes beyond the KV | worst added s (k <= 8) | mean added s (k = 1..8) |",
                  "| ---: | ---: | ---: | ---: |"]
        for x in table["rows"]:
            lines.append(f"| {x['every'] or 'off (replay)'} | {x['bytes_beyond_kv']:.1%} | {x['worst_added_s']:.3f} | "
                         f"{x['mean_added_s']:.3f} |")
    for run, r in results["stores"].items():
        st = r.get("b_stages")
        if st:
            lines += ["", f"## B, stage by stage ({run}, B again with each stage synchronized: {st['wall_s']:.3f} s)", "",
                      "| stage | ms |", "| --- | ---: |"]
            named = {k: v for k, v in st.items() if k not in ("wall_s", "hit_depth")}
            for k, v in named.items():
                lines.append(f"| {k} | {v * 1e3:.1f} |")
            inside = sum(v for k, v in named.items() if k in ("create_runtime", "chunk_seam"))
            lines.append(f"| rest (the session object, the flush, Python) | {(st['wall_s'] - inside) * 1e3:.1f} |")
            fw = r.get("b_fresh_worker")
            if fw:
                lines += ["", f"B as a fresh worker's first session (its keep empty: {fw['encodes_loaded']} encodes "
                          f"loaded from the store): {fw['wall_s']:.3f} s; encode_prompt {fw['encode_prompt'] * 1e3:.1f} ms, "
                          f"encode_condition {fw['encode_condition'] * 1e3:.1f} ms; once per worker, at attach, the "
                          f"encoders' fingerprints: umT5 {fw['fingerprint_text_encoder_s'] * 1e3:.1f} ms, "
                          f"VAE {fw['fingerprint_vae_s'] * 1e3:.1f} ms."]
        sw = r.get("sweep")
        if sw:
            lines += ["", f"## Divergence after k served chunks ({run}; a session of {sw['chunks']} chunks)", "",
                      "| k | first computed chunk s | cold chunk k s | ratio | materialize s | decoder state loaded "
                      "| load ms | chunks replayed | replay s | a state: GiB | from pinned host ms | HBM copy ms |",
                      "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
            for x in sw["rows"]:
                lines.append(f"| {x['k']} | {x['first_computed_s']:.3f} | {x['cold_chunk_s']:.3f} | {x['ratio']:.3f} | "
                             f"{x['materialize_s']:.3f} | {x['state_loaded']} | {x['state_read_s'] * 1e3:.1f} | "
                             f"{x['replayed']} | {x['replay_s']:.3f} | {x['decoder_state_bytes'] / 2**30:.3f} | "
                             f"{x['decoder_state_from_host_s'] * 1e3:.1f} | {x['decoder_state_d2d_s'] * 1e3:.1f} |")
    return "\n".join(lines) + "\n"


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = results.get("summary") or {}
    if not summary:
        return
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    names = list(summary)
    for i, req in enumerate(REQUESTS):
        axes[0].bar([j + 0.2 * i for j in range(len(names))], [summary[n][f"{req}_ratio"] or 0 for n in names],
                    width=0.2, label=req)
    axes[0].set_xticks([j + 0.3 for j in range(len(names))], names, fontsize=7)
    axes[0].set_ylabel("wall / no cache")
    axes[0].axhline(TARGETS["C_ratio"], color="red", lw=0.5, ls="--", label="C target")
    axes[0].legend(fontsize=7)
    axes[0].set_title("A/B/C/D against no cache")
    for run, r in results["stores"].items():
        sw = (r.get("sweep") or {}).get("rows")
        if sw:
            axes[1].plot([x["k"] for x in sw], [x["ratio"] for x in sw], "o-", label=run)
    axes[1].axhline(TARGETS["first_computed_ratio"], color="red", lw=0.5, ls="--", label="target")
    axes[1].set_xlabel("chunks served before the divergence (k)")
    axes[1].set_ylabel("first computed chunk / cold chunk")
    axes[1].legend(fontsize=7)
    axes[1].set_title("first computed chunk after k served")
    table = sorted((results.get("decoder_state_table") or {}).get("rows") or [], key=lambda x: x["bytes_beyond_kv"])
    if table:
        xs = [100 * x["bytes_beyond_kv"] for x in table]
        axes[2].plot(xs, [x["worst_added_s"] for x in table], "o-", label="worst (k <= 8)")
        axes[2].plot(xs, [x["mean_added_s"] for x in table], "s--", label="mean (k = 1..8)")
        for x, row in zip(xs, table):
            axes[2].annotate(f"N={row['every'] or 'off'}", (x, row["worst_added_s"]), fontsize=7)
        axes[2].axvline(100 * TARGETS["bytes_beyond_kv"], color="red", lw=0.5, ls="--", label="bytes target")
        axes[2].set_xlabel("decoder state bytes beyond the KV (%)")
        axes[2].set_ylabel("seconds added at divergence")
        axes[2].legend(fontsize=7)
        axes[2].set_title("decoder state: stored every N vs replayed")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    entry(main, run_one)
