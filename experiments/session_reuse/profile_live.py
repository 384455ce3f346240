"""Where a restored live chunk's time goes, per store (issue 32's target: at most 15 ms).

One child process per store in ``stores`` (``--one STORE``), each built as `bench_session_reuse`'s
child (`gate_children.child_stack`: the ``lingbot_world_14b`` experiment on TeleFuser's real
pipeline, ``manager.decoder_state_every=2``):

1. one warm-up chunk without a cache; one live session (streamed, one control per chunk) computes
   the gate's P+X path and writes it; one following session warms what a restored chunk uses
   (pinned host blocks, the image threads), not counted;
2. ``plain``: ``live_sessions`` sessions follow the path, each restored chunk (chunks 1..n-1)
   timed three ways as the bench times them: ``generate_next_chunk`` as attached (``chunk_seam``),
   that plus TeleFuser's build of the control (``service``), the session's whole chunk (``chunk``:
   with the runtime's frame hash);
3. ``steps``: as many sessions again with every sub-step wrapped and synchronized (`STEPS`:
   the control's build and its key, the lookup, the frames read, the copy out of the store, the
   checks, the images, the frame hash), medians per restored chunk;
4. ``profiled``: as many sessions again under cProfile: the top functions by cumulative time
   among CacheSeek's and TeleFuser's frames, and by own time over everything;
5. ``reads``: the frames value of a restored chunk read straight from the store ``reads`` times
   (median ms): ``get_skeleton`` as the product reads it, the copy out of the store's memory
   as it is now (``Reader._raw``) against as it was before this change (a pageable ``.cpu()``
   then ``bytes`` for HBM, ``ctypes.string_at`` for the Plan tier), measured in the same run;
   the checks (`frames.unpack`), the images (`pil_images`, and on `IMAGE_THREADS` threads), the
   runtime's frame hash, the key of one control (`chunk_action_key`).

Writes under ``out_dir`` (default outputs/experiments/session_reuse_profile/): ``store_<store>.json``,
``profile_<store>.txt``, ``results.json`` and ``results.md`` (machine, versions, commit, the tables).

    python experiments/session_reuse/profile_live.py [key=value ...]   # conf/session_reuse.yaml
"""

from __future__ import annotations

import ctypes
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from benchlib import REPO, compose, env_info, git_state, median, timed, write_json  # noqa: E402
from gate_children import built, child_stack, device_sync, entry, nocache_run, plain, run_children  # noqa: E402

READS = 20
IMAGE_THREADS = (1, 2, 4, 8, 12)  # the hand-out's image threads, measured straight (`_reads`)
TARGET_MS = 15.0
_RL = "cacheseek.reuse.exact_prefix"
STEPS = {  # the sub-steps of a restored live chunk, in the order they run
    "control_build": "cacheseek.runtime.telefuser:TeleFuserRuntimeFactory.chunk_override",
    "on_control_arrived": f"{_RL}.live_chunks:LiveChunks.on_control_arrived",
    "chunk_seam": "cacheseek.integrations.telefuser.chunk_controls:NextChunkSeam.__call__",
    "on_chunk_control": f"{_RL}.live_chunks:LiveChunks.on_chunk_control",
    "action_key_wait": f"{_RL}.lazy_keys:_Keys.key",
    "index_child": f"{_RL}.shared_index:SharedIndex.child",
    "next_chunk": f"{_RL}.telefuser_lingbot:LingBotWorldKVBinding.next_chunk",
    "frames_read": f"{_RL}.frames:ChunkFrames.read",
    "get_skeleton": "cacheseek.stores.plan_tier.store:PlanTierStore.get_skeleton",
    "copy_out": "cacheseek.stores.plan_tier.read:Reader._raw",
    "frames_checks": "cacheseek.kv.frames:unpack",
    "hand_out": "cacheseek.integrations.telefuser.handout:hand_out",
    "pil_images": "cacheseek.integrations.telefuser.handout:pil_images",
    "chunk_finished": f"{_RL}.live_chunks:LiveChunks.chunk_finished",
    "frame_hash": "cacheseek.runtime.telefuser:images_hash",
}


def out_dir_of(cfg: Any) -> Path:
    return Path(cfg.out_dir) if cfg.out_dir else REPO / "outputs" / "experiments" / "session_reuse_profile"


def main(argv: list[str]) -> dict:
    cfg = compose(HERE / "conf", "session_reuse", argv)
    out_dir = out_dir_of(cfg)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "what": "a restored live chunk's time by sub-step (issue 32), one process per store",
        "command": " ".join(["python", "experiments/session_reuse/profile_live.py", *argv]),
        "config": plain(cfg), "env": {**env_info(), **git_state()}, "target_ms": TARGET_MS, "stores": {},
    }
    t0 = time.perf_counter()
    run_children(Path(__file__), list(cfg.stores), argv, cfg, out_dir, results)
    write_json(out_dir / "results.json", results)
    text = markdown(results)
    (out_dir / "results.md").write_text(text)
    print(text, flush=True)
    print(f"wrote {out_dir / 'results.json'} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return results


def run_one(store: str, argv: list[str]) -> None:
    cfg = compose(HERE / "conf", "session_reuse", argv)
    out_dir = out_dir_of(cfg)
    sync = device_sync(cfg.device)
    t0 = time.perf_counter()
    stack, overrides = child_stack(cfg, store, out_dir, f"profile_{store}", ["manager.decoder_state_every=2"])
    row: dict[str, Any] = {"store": store, "overrides": overrides}
    try:
        factory, gate = stack.runtime_factory, stack.workload
        row.update(built(stack, t0))
        actions = gate.P + gate.X
        nocache_run(factory, actions[:1], "warm-up (1 chunk, no cache)", sync)
        manager = stack.new_manager()
        row["computed_s"] = _session(stack, factory, manager, actions, sync)["chunk"]
        stack.store.flush()
        print(f"  path computed: {', '.join(f'{s:.2f}' for s in row['computed_s'])} s", flush=True)
        _session(stack, factory, manager, actions, sync)  # warms the restored chunk's path
        n = int(cfg.live_sessions)
        row["plain"] = _sessions(stack, factory, manager, actions, sync, n)
        row["steps"] = _sessions(stack, factory, manager, actions, sync, n, steps=True)
        prof = cProfile.Profile()
        prof.enable()
        row["profiled"] = _sessions(stack, factory, manager, actions, sync, n)
        prof.disable()
        (out_dir / f"profile_{store}.txt").write_text(_profile_text(prof))
        row["reads"] = _reads(stack, factory, manager, actions, sync)
        row["metrics"] = {k: v for k, v in stack.metrics.as_dict().items() if k.startswith(("frames_", "live_"))}
        p = row["plain"]
        print(f"  restored live chunk median: generate_next_chunk {p['chunk_seam_ms']:.1f} ms, with the control's "
              f"build {p['service_ms']:.1f} ms, the session's chunk {p['chunk_ms']:.1f} ms", flush=True)
        print("  sub-steps (ms, median a chunk): " + ", ".join(f"{k} {v:.2f}" for k, v in row["steps"]["steps_ms"].items()),
              flush=True)
        print("  reads (ms, median): " + ", ".join(f"{k} {v:.2f}" for k, v in row["reads"].items() if k.endswith("_ms")),
              flush=True)
    finally:
        stack.close()
    write_json(out_dir / f"store_{store}.json", row)


def _session(stack: Any, factory: Any, manager: Any, actions: list, sync: Any, steps: bool = False) -> dict:
    """One live session along ``actions``: each chunk's seconds (``chunk``), and where timed the
    seconds of each sub-step per chunk (``steps``: `STEPS`; else the seam and the control's build)."""
    from stages import stage_timers

    binding = stack.new_binding(manager)
    session = factory.make(actions, hooks=binding, streamed=True)
    where = STEPS if steps else {k: STEPS[k] for k in ("control_build", "chunk_seam")}
    out: dict[str, Any] = {"chunk": [], "per_step": {k: [] for k in where}, "served": 0}
    with stage_timers(sync, stages=where) as st:
        for i in range(len(actions)):
            before = dict(st)
            sync()
            start = time.perf_counter()
            session.generate(stop_after=i + 1)
            sync()
            out["chunk"].append(time.perf_counter() - start)
            for k in where:
                out["per_step"][k].append(st.get(k, 0.0) - before.get(k, 0.0))
    out["served"] = binding.frames_served
    out["hashes"] = list(session.frame_hashes)
    binding.close()
    return out


def _sessions(stack: Any, factory: Any, manager: Any, actions: list, sync: Any, n: int, steps: bool = False) -> dict:
    """``n`` following sessions: the medians over their restored chunks (1..len-1), in ms."""
    runs = [_session(stack, factory, manager, actions, sync, steps) for _ in range(n)]
    med = lambda xs: 1e3 * statistics.median(xs) if xs else None  # noqa: E731
    chunk = [s for r in runs for s in r["chunk"][1:]]
    per = {k: [s for r in runs for s in r["per_step"][k][1:]] for k in runs[0]["per_step"]}
    out: dict[str, Any] = {"sessions": n, "served": [r["served"] for r in runs],
                           "frames_equal": all(r["hashes"] == runs[0]["hashes"] for r in runs),
                           "chunk_ms": med(chunk), "chunk_s": chunk, "ttff_ms": med([r["chunk"][0] for r in runs])}
    if steps:
        out["steps_ms"] = {k: med(v) for k, v in per.items()}
    else:
        seam, build = per["chunk_seam"], per["control_build"]
        out.update(chunk_seam_ms=med(seam), service_ms=med([a + b for a, b in zip(seam, build)]), seam_s=seam)
    return out


def _timed(fn: Any, sync: Any, n: int = READS) -> float:
    """The median ms of ``fn()`` over ``n`` runs after one more, synchronized."""
    fn()
    return 1e3 * median(timed(fn, n, sync=sync))


def _reads(stack: Any, factory: Any, manager: Any, actions: list, sync: Any) -> dict:
    """The frames value of chunk 1 of the path read straight from the store (module docstring, 5)."""
    import torch

    from cacheseek.integrations.telefuser import handout
    from cacheseek.integrations.telefuser.handout import frames_spec, pil_images
    from cacheseek.kv import frames as frames_value
    from cacheseek.kv.locators import frames_locator
    from cacheseek.reuse.exact_prefix.actions import chunk_action_key
    from cacheseek.runtime.telefuser_frames import images_hash

    binding = stack.new_binding(manager)
    session = factory.make(actions, hooks=binding, streamed=True)
    session.generate(stop_after=2)
    node = binding._served_path[1] if binding._served_path else binding._lazy[1]
    spec = frames_spec(session.runtime, 1)
    loc, size = frames_locator(node.node_key), frames_value.packed_nbytes(spec)
    store = stack.store
    out: dict[str, Any] = {"frames_bytes": size}
    out["get_skeleton_ms"] = _timed(lambda: store.get_skeleton(loc, nbytes=size), sync)
    reader = store._reader
    with reader.reading([loc], [1]) as read:  # the value's views held while both copies are timed
        table, n = read.transfer(None)
        (src,) = reader._value_pointers(read, table, [size], raw=True)
        out["copy_out_ms"] = _timed(lambda: reader._raw(src, size), sync)
        if reader.values.on_device:
            out["copy_out_before_ms"] = _timed(lambda: bytes(reader.client.value_tensor(src, size).cpu().numpy()), sync)
        else:
            out["copy_out_before_ms"] = _timed(lambda: ctypes.string_at(src, size), sync)
    value = store.get_skeleton(loc, nbytes=size)
    out["copy_out_type"] = type(value).__name__ + (f" pinned={value.is_pinned()}" if isinstance(value, torch.Tensor) else "")
    frames = frames_value.unpack(node.node_key, value, spec, loc)
    out["frames_checks_ms"] = _timed(lambda: frames_value.unpack(node.node_key, value, spec, loc), sync)
    out["pil_images_ms"] = _timed(lambda: pil_images(frames), sync)
    saved = handout._IMAGE_THREADS
    try:  # the images on other numbers of threads (a fresh pool each)
        for threads in IMAGE_THREADS:
            _image_threads(handout, threads)
            out[f"pil_images_{threads}_threads_ms"] = _timed(lambda: pil_images(frames), sync)
    finally:
        _image_threads(handout, saved)
    images = pil_images(frames)
    out["frame_hash_ms"] = _timed(lambda: images_hash(images), sync)
    control = factory.chunk_override(session.runtime, actions, 2)
    out["control_build_ms"] = _timed(lambda: factory.chunk_override(session.runtime, actions, 2), sync)
    out["action_key_ms"] = _timed(lambda: chunk_action_key(2, control), sync)
    binding.close()
    return out


def _image_threads(handout: Any, threads: int) -> None:
    """`handout.pil_images` on ``threads`` threads from now on (its pool started again)."""
    with handout._pool_lock:
        for pool in handout._pool:
            pool.shutdown(wait=True)
        handout._pool.clear()
    handout._IMAGE_THREADS = threads


def _profile_text(prof: Any, top: int = 60) -> str:
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    text.write("== CacheSeek's and TeleFuser's frames, by cumulative time ==\n")
    stats.sort_stats("cumulative").print_stats(r"cacheseek|telefuser", top)
    text.write("\n== everything, by own time ==\n")
    stats.sort_stats("tottime").print_stats(top)
    return text.getvalue().replace(f"{REPO}/", "")  # the repo's files by their paths in it


def markdown(results: dict) -> str:
    e = results["env"]
    lines = [f"# A restored live chunk by sub-step: {e.get('gpu', 'no GPU')}, torch {e.get('torch')}, git "
             f"{e.get('git_commit')}{' (dirty)' if e.get('git_dirty') else ''}, {e.get('time')}", "",
             f"Target: at most {results['target_ms']} ms. Medians over the following sessions' restored chunks.", "",
             "| store | generate_next_chunk ms | + control build ms | session's chunk ms | time to first frame ms "
             "| frames equal | served |", "| --- | ---: | ---: | ---: | ---: | --- | --- |"]
    for store, r in results["stores"].items():
        p = r.get("plain")
        if p:
            lines.append(f"| {store} | {p['chunk_seam_ms']:.1f} | {p['service_ms']:.1f} | {p['chunk_ms']:.1f} | "
                         f"{p['ttff_ms']:.1f} | {p['frames_equal']} | {p['served']} |")
        else:
            lines.append(f"| {store} | failed: returncode {r.get('returncode')} | | | | | |")
    rows = {s: r["steps"]["steps_ms"] for s, r in results["stores"].items() if r.get("steps")}
    if rows:
        names = list(next(iter(rows.values())))
        lines += ["", "## Sub-steps (each synchronized; nested steps are counted in their parents), median ms a chunk",
                  "", "| step | " + " | ".join(rows) + " |", "| --- |" + " ---: |" * len(rows)]
        for k in names:
            lines.append(f"| {k} | " + " | ".join("-" if rows[s].get(k) is None else f"{rows[s][k]:.2f}" for s in rows)
                         + " |")
    reads = {s: r["reads"] for s, r in results["stores"].items() if r.get("reads")}
    if reads:
        names = [k for k in next(iter(reads.values())) if k.endswith("_ms")]
        lines += ["", "## The frames value read straight from the store, median ms of "
                  f"{READS} (copy_out_before: the copy as it was before this change, same run)", "",
                  "| what | " + " | ".join(reads) + " |", "| --- |" + " ---: |" * len(reads)]
        for k in names:
            lines.append(f"| {k[:-3]} | " + " | ".join(f"{reads[s][k]:.2f}" for s in reads) + " |")
        lines.append("| value type | " + " | ".join(str(reads[s]["copy_out_type"]) for s in reads) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    entry(main, run_one)
