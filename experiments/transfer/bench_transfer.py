"""Transfer benchmark: how close the Plan tier's copies come to the PCIe limit, in one run.

1. peak: one large pinned copy each way (torch, a side stream), both directions at once on two
   streams, and one large copy from the registered Plan segment;
2. Plan write and read of lingbot_480p chunks (80 tensors of 45.7 MiB, latents of 585 KiB)
   through `PlanTierStore`: the synchronous write (D2H, commit), the overlapped write (submit, then
   ready), the read of one chunk, the full-hit restore of a 3-chunk path (request B);
3. rolled-ring restores: a rolling ring whose window is many small copy runs per tensor, through
   the store with the batch API and with a loop of single copies;
4. copies of 64 KiB / 256 KiB / 1 MiB: cudaMemcpyBatchAsync vs a Python loop of cudaMemcpyAsync.

Every figure is GiB/s and the fraction of the same-run peak of its direction.

    python experiments/transfer/bench_transfer.py [key=value ...]   # conf/transfer.yaml
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchlib import GiB, Progress, compose, env_info, gib_s, median, plain, timed, write_json  # noqa: E402


def main(argv: list[str]) -> dict:
    import numpy as np
    import torch

    from cacheseek.kv.ring import RingGeometry
    from cacheseek.reuse.exact_prefix.types import Skeleton, Tier, TrieNode
    from cacheseek.stores.base import RestoreTarget
    from cacheseek.stores.plan_tier import PlanTierStore
    from cacheseek.transfer.batch import CopyBatch, Direction
    from cacheseek.transfer.host_transfer import HostTransferRuntime

    cfg = compose(HERE / "conf", "transfer", argv)
    out_dir = Path(cfg.out_dir)
    cuda = cfg.device == "cuda"
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    reps = int(cfg.reps)
    results: dict = {"config": dict(plain(cfg)), "env": env_info(), "rows": []}
    prog = Progress(8, "transfer")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def new_runtime(batch: bool = True):
        if not cuda:
            return HostTransferRuntime()
        from cacheseek.transfer.cuda_transfer import CudaTransferRuntime

        return CudaTransferRuntime(use_batch_api=None if batch else False)

    def row(section: str, what: str, direction: str, nbytes: int, seconds: list[float], **extra) -> dict:
        peak = results["peak"].get("bidirectional_total" if direction == "both" else direction)
        s = median(seconds)
        r = dict(section=section, what=what, direction=direction, bytes=int(nbytes), seconds_median=s,
                 seconds_all=seconds, gib_s=gib_s(nbytes, s), peak_gib_s=peak,
                 fraction_of_peak=gib_s(nbytes, s) / peak if peak else None, **extra)
        results["rows"].append(r)
        prog.note(f"{section:8s} {what:44s} {direction:4s} {r['gib_s']:7.2f} GiB/s "
                  f"({(r['fraction_of_peak'] or 0) * 100:5.1f}% of peak)")
        write_json(out_dir / "results.json", results)
        return r

    # -- 1. peak -----------------------------------------------------------------------------
    n = int(cfg.peak_bytes)
    host = torch.empty(n, dtype=torch.uint8, pin_memory=cuda)
    host2 = torch.empty(n, dtype=torch.uint8, pin_memory=cuda)
    host.fill_(0x5A)  # a pattern: copy engines do not look at the values (random 4 GiB on a CPU is slow)
    d1 = torch.empty(n, dtype=torch.uint8, device=dev)
    d2 = torch.empty(n, dtype=torch.uint8, device=dev)
    d2.random_(0, 255) if cuda else d2.fill_(3)
    s1 = torch.cuda.Stream() if cuda else None
    s2 = torch.cuda.Stream() if cuda else None

    def on(stream, fn):
        if stream is None:
            return fn()
        with torch.cuda.stream(stream):
            return fn()

    h2d = timed(lambda: on(s1, lambda: d1.copy_(host, non_blocking=True)), reps + 1, sync=sync)[1:]
    d2h = timed(lambda: on(s2, lambda: host2.copy_(d2, non_blocking=True)), reps + 1, sync=sync)[1:]

    def both() -> None:
        on(s1, lambda: d1.copy_(host, non_blocking=True))
        on(s2, lambda: host2.copy_(d2, non_blocking=True))

    bidir = timed(both, reps + 1, sync=sync)[1:]
    results["peak"] = {"h2d": gib_s(n, median(h2d)), "d2h": gib_s(n, median(d2h)),
                       "bidirectional_total": gib_s(2 * n, median(bidir))}
    prog.step(f"peak: H2D {results['peak']['h2d']:.2f}, D2H {results['peak']['d2h']:.2f}, "
              f"both at once {results['peak']['bidirectional_total']:.2f} GiB/s ({n / GiB:.0f} GiB pinned)")
    row("peak", "one pinned copy (torch, side stream)", "h2d", n, h2d)
    row("peak", "one pinned copy (torch, side stream)", "d2h", n, d2h)
    row("peak", "both directions at once, two streams", "both", 2 * n, bidir)
    host = host2 = d2 = None  # free the pinned 8 GiB before the segment is made

    # -- 2. Plan write / read of lingbot_480p chunks --------------------------------------------
    c = cfg.chunk
    L, T, H, D = int(c.n_layers), int(c.chunk_tokens), int(c.heads), int(c.head_dim)
    K = int(c.path_chunks)
    t0 = time.perf_counter()
    store = PlanTierStore(segment_bytes=int(cfg.segment_bytes), backing=str(cfg.backing), overlap=False,
                          transfer=new_runtime(), device=str(dev), register_piece_bytes=cfg.register_piece_bytes)
    st = store.stats
    results["warmup"] = {k: getattr(st, k) for k in ("warmup_seconds", "map_seconds", "fault_seconds",
                                                      "fault_method", "fault_threads", "huge_page_bytes",
                                                      "register_seconds")}
    prog.step(f"Plan segment {int(cfg.segment_bytes) / GiB:.0f} GiB ready in {time.perf_counter() - t0:.2f} s "
              f"(fault {st.fault_seconds:.2f} s, register {st.register_seconds:.2f} s, "
              f"{max(st.huge_page_bytes, 0) / GiB:.1f} GiB in 2 MiB pages)")
    # 3-chunk full-length ring (what the runtime holds after 3 chunks), random bf16
    ring = [tuple(torch.randn(1, K * T, H, D, device=dev, dtype=torch.bfloat16) for _ in range(2)) for _ in range(L)]
    latents = [torch.randn(*c.latent_shape, device=dev, dtype=torch.bfloat16) for _ in range(K)]
    chunk_views = [[(k[:, i * T:(i + 1) * T], v[:, i * T:(i + 1) * T]) for k, v in ring] for i in range(K)]
    chunk_bytes = 2 * L * T * H * D * 2
    lat_bytes = latents[0].numel() * 2
    sync()

    def put_sync(i: int) -> None:
        h = store.put_async(f"w{i}:kv", chunk_views[0], tier=Tier.FLUXON_DRAM)
        store.free(h)

    put_sync(-1)  # warm
    w = timed(lambda: None, 0)
    for r in range(reps):
        sync()
        t = time.perf_counter()
        h = store.put_async(f"w{r}:kv", chunk_views[0], tier=Tier.FLUXON_DRAM)
        w.append(time.perf_counter() - t)
        store.free(h)
    row("plan", "write one chunk (80 x 45.7 MiB), sync", "d2h", chunk_bytes, w)
    lw = timed(lambda: store.put_skeleton("lat:warm", latents[0]), reps)
    row("plan", "write one latent (585 KiB)", "d2h", lat_bytes, lw)
    prog.step("Plan synchronous writes")

    for label, piece in (("pieces of 32 MiB, 2 in flight (default)", 32 << 20), ("one batch", 0)):
        ov = PlanTierStore(plan_client=store.plan_client, transfer=store.transfer, overlap=True,
                           staging_slots=2, staging_slot_bytes=chunk_bytes, write_piece_bytes=piece)
        submit, ready = [], []
        for r in range(reps + 1):
            sync()
            t = time.perf_counter()
            h = ov.put_async(f"o{r}:kv", chunk_views[0], tier=Tier.FLUXON_DRAM)
            ts = time.perf_counter() - t
            ov.flush()
            tr = time.perf_counter() - t
            assert h.ready, h.error
            ov.free(h)
            if r:
                submit.append(ts)
                ready.append(tr)
        row("plan", f"write one chunk, overlapped, {label}: put_async to ready", "d2h", chunk_bytes, ready,
            submit_seconds_median=median(submit))
        prog.note(f"overlapped ({label}): put_async returns in {median(submit) * 1e3:.2f} ms")
        ov.close()  # the client and runtime belong to `store`
    prog.step("Plan overlapped writes")

    nodes, parent = [], None
    for i in range(K):
        key = bytes([i + 1]) * 32
        store.put_skeleton(f"{key.hex()}:lat", latents[i])
        h = store.put_async(f"{key.hex()}:kv", chunk_views[i], tier=Tier.FLUXON_DRAM)
        node = TrieNode(key, b"a", i, parent, skeleton=Skeleton(f"{key.hex()}:lat"), blob=h)
        nodes.append(node)
        parent = node
    geom = RingGeometry(chunk_size=3, frame_tokens=T // 3)
    tb = H * D * 2

    def target(depth: int, kv_tokens: int):
        return RestoreTarget(
            kv=tuple(tuple(torch.zeros(1, kv_tokens, H, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
                     for _ in range(L)),
            runs=geom.restore_runs(depth), window_depths=tuple(geom.window_depths(depth)), token_bytes=tb,
            chunk_tokens=T, latents=tuple(torch.empty_like(latents[0]) for _ in range(depth)))

    for depth, label in ((1, "read one chunk + latent"), (K, f"full-hit restore of {K} chunks (request B)")):
        tgt = target(depth, K * T)
        sync()
        assert store.read_path(nodes[:depth], nodes[:depth], tgt)
        sync()
        ok = all(torch.equal(tgt.kv[l][j][:, :depth * T], ring[l][j][:, :depth * T]) for l in range(L) for j in range(2))
        ok = ok and all(torch.equal(a, b) for a, b in zip(tgt.latents, latents))
        secs = timed(lambda: store.read_path(nodes[:depth], nodes[:depth], tgt), reps, sync=sync)
        row("plan", label, "h2d", depth * (chunk_bytes + lat_bytes), secs, verified=bool(ok))
        prog.note(f"restored bytes equal the source: {ok}")
        tgt = None
    prog.step("Plan reads")
    for node in nodes:
        store.free(node.blob)

    # -- 3. rolled-ring restores: many small runs ----------------------------------------------
    rc = cfg.rolled
    rnodes, window, rtarget, rlat = rolled_case(store, dev, rc)
    runs, rtb, RL = rtarget.runs, rtarget.token_bytes, rtarget.n_layers
    run_bytes = sum(r.n_tokens for r in runs) * rtb * 2 * RL
    n_desc = len(runs) * 2 * RL
    loop_store = PlanTierStore(plan_client=store.plan_client, transfer=new_runtime(batch=False), overlap=False)
    variants = [("batched (cudaMemcpyBatchAsync)", store), ("loop of cudaMemcpyAsync", loop_store)]
    if cuda:  # the range-copy kernel reading the segment through the device's mapping of it
        from cacheseek.transfer.cuda_transfer import CudaTransferRuntime

        kernel_store = PlanTierStore(plan_client=store.plan_client, overlap=False, transfer=CudaTransferRuntime(
            copy_kernel=True, kernel_h2d_max_mean_bytes=1 << 40))
        variants.append(("range-copy kernel", kernel_store))
    for label, st_ in variants:
        assert st_.read_path(rnodes, window, rtarget)
        secs = timed(lambda: st_.read_path(rnodes, window, rtarget), reps, sync=sync)
        row("rolled", f"restore depth {int(rc.depth)}: {n_desc} runs, {label}", "h2d", run_bytes + sum(x.numel() * 2 for x in rlat),
            secs, descriptors=n_desc, mean_run_bytes=run_bytes / n_desc)
    for _, st_ in variants[1:]:
        st_.close()
    prog.step(f"rolled-ring restores: {len(runs)} runs per tensor, {n_desc} copies of "
              f"{run_bytes / n_desc / 1024:.0f} KiB on average")

    # -- 4. small copies: batched vs a Python loop ---------------------------------------------
    transfer = store.transfer
    seg = store.plan_client.wait_local_segments_ready()[0]
    total = int(cfg.small.total_bytes)
    dbuf = torch.empty(total, dtype=torch.uint8, device=dev)
    drange = transfer.device_range(dbuf)
    loop_rt = new_runtime(batch=False)
    from cacheseek.transfer.memory import HostMapping

    loop_rt.register([HostMapping(seg.ptr, seg.length, seg.generation, seg.writable)])
    side, side2 = transfer.new_stream(), transfer.new_stream()
    base = seg.ptr + (seg.length - total) // 4096 * 4096  # the segment's tail (free: nothing stored there)
    for size in [int(x) for x in cfg.small.sizes]:
        count = total // size
        offs = np.arange(count, dtype=np.int64) * size
        for direction in ("h2d", "d2h"):
            if direction == "h2d":
                batch = CopyBatch.of(dbuf.data_ptr() + offs, base + offs, size, Direction.H2D)
            else:
                batch = CopyBatch.of(base + offs, dbuf.data_ptr() + offs, size, Direction.D2H)
            b, sub = [], []
            for _ in range(reps + 1):
                t = time.perf_counter()
                pend = transfer.submit_batch(batch, stream=side, device_ranges=[drange])
                t_sub = time.perf_counter() - t
                pend.wait()
                b.append(time.perf_counter() - t)
                sub.append(t_sub)
            b, sub = b[1:], sub[1:]
            batched = row("small", f"{size // 1024} KiB x {count}: batched", direction, total, b, copies=count,
                          submit_seconds_median=median(sub))
            if size == 65536:  # an experiment: the same copies split over two streams
                half = count // 2
                parts = [CopyBatch(batch.dsts[a:z], batch.srcs[a:z], batch.sizes[a:z], batch.codes[a:z])
                         for a, z in ((0, half), (half, count))]

                def two_streams() -> None:
                    ps = [transfer.submit_batch(p, stream=st_, device_ranges=[drange]) for p, st_ in zip(parts, (side, side2))]
                    for p in ps:
                        p.wait()

                b2 = timed(two_streams, reps + 1)[1:]
                row("small", f"{size // 1024} KiB x {count}: batched, split over 2 streams", direction, total, b2,
                    copies=count)
            lp = timed(lambda: loop_rt.copy_batch(batch, stream=side, device_ranges=[drange]), reps + 1)[1:]
            row("small", f"{size // 1024} KiB x {count}: loop (validated)", direction, total, lp, copies=count)
            if cuda:
                raw = _raw_loop(batch, side)
                rl = timed(raw, reps + 1)[1:]
                row("small", f"{size // 1024} KiB x {count}: raw Python loop", direction, total, rl, copies=count)
                batched["speedup_vs_raw_loop"] = median(rl) / median(b)
                prog.note(f"  batched is {median(rl) / median(b):.2f}x the raw Python loop")
            batched["speedup_vs_loop"] = median(lp) / median(b)
    transfer.destroy_stream(side)
    transfer.destroy_stream(side2)
    loop_rt.close()
    prog.step("small copies")

    store.close()
    results["targets"] = _targets(results)
    write_json(out_dir / "results.json", results)
    _plot(results, out_dir / "transfer.png")
    prog.step(f"results in {out_dir}")
    return results


def rolled_case(store, dev, rc) -> tuple:
    """Section 3's data: ``rc.depth`` chunks of a rolling ring (random bf16, ``rc`` as in
    conf/transfer.yaml ``rolled``) written through ``store``; returns ``(nodes, window, target,
    latents)``, the restore of the deepest node being ``store.read_path(nodes, window, target)``."""
    import torch

    from cacheseek.kv.ring import RingGeometry
    from cacheseek.reuse.exact_prefix.types import Skeleton, Tier, TrieNode
    from cacheseek.stores.base import RestoreTarget

    rg = RingGeometry(chunk_size=int(rc.chunk_size), frame_tokens=int(rc.frame_tokens),
                      local_attn_size=int(rc.local_attn_size), sink_size=int(rc.sink_size))
    layers, heads, dim, depth = int(rc.n_layers), int(rc.heads), int(rc.head_dim), int(rc.depth)
    ct = rg.chunk_size * rg.frame_tokens
    chunks = [[tuple(torch.randn(1, ct, heads, dim, device=dev, dtype=torch.bfloat16) for _ in range(2)) for _ in range(layers)]
              for _ in range(depth)]
    lats = [torch.randn(1, 16, 3, 2, 2, device=dev, dtype=torch.bfloat16) for _ in range(depth)]
    nodes, parent = [], None
    for i in range(depth):
        key = bytes([0x80 + i]) * 32
        store.put_skeleton(f"{key.hex()}:lat", lats[i])
        handle = store.put_async(f"{key.hex()}:kv", chunks[i], tier=Tier.FLUXON_DRAM)
        parent = TrieNode(key, b"r", i, parent, skeleton=Skeleton(f"{key.hex()}:lat"), blob=handle)
        nodes.append(parent)
    store.flush()
    window = [nodes[d] for d in rg.window_depths(depth)]
    kv_size = rg.local_attn_size * rg.frame_tokens
    target = RestoreTarget(
        kv=tuple(tuple(torch.zeros(1, kv_size, heads, dim, device=dev, dtype=torch.bfloat16) for _ in range(2))
                 for _ in range(layers)),
        runs=rg.restore_runs(depth), window_depths=tuple(rg.window_depths(depth)), token_bytes=heads * dim * 2,
        chunk_tokens=ct, latents=tuple(torch.empty_like(lats[0]) for _ in range(depth)))
    return nodes, window, target, lats


def _raw_loop(batch, stream: int):
    """A Python loop of single cudaMemcpyAsync calls, no validation (the baseline)."""
    from cuda.bindings import runtime as rt

    kind = (rt.cudaMemcpyKind.cudaMemcpyHostToDevice if int(batch.codes[0]) == 0
            else rt.cudaMemcpyKind.cudaMemcpyDeviceToHost)
    dsts, srcs, sizes = batch.dsts.tolist(), batch.srcs.tolist(), batch.sizes.tolist()

    def run() -> None:
        memcpy = rt.cudaMemcpyAsync
        for d, s, n in zip(dsts, srcs, sizes):
            memcpy(d, s, n, kind, stream)
        rt.cudaStreamSynchronize(stream)

    return run


def _targets(results: dict) -> dict:
    rows = {(r["section"], r["what"], r["direction"]): r for r in results["rows"]}

    def frac(section, prefix, direction):
        for (s, w, d), r in rows.items():
            if s == section and w.startswith(prefix) and d == direction:
                return r["fraction_of_peak"]
        return None

    small = {}
    for (s, w, d), r in rows.items():
        if s == "small" and w.startswith("64 KiB") and w.endswith("batched"):
            small[d] = r.get("speedup_vs_raw_loop", r.get("speedup_vs_loop"))
    return {
        "plan_d2h_chunk_fraction": frac("plan", "write one chunk (80", "d2h"),
        "plan_h2d_chunk_fraction": frac("plan", "read one chunk", "h2d"),
        "full_hit_restore_fraction": frac("plan", "full-hit restore", "h2d"),
        "small_64k_batched_speedup": small,
    }


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results["rows"] if r["section"] != "peak"]
    labels = [f"{r['section']}: {r['what'].replace(': put_async to ready', '')} [{r['direction']}]" for r in rows]
    fr = [100 * (r["fraction_of_peak"] or 0) for r in rows]
    fig, ax = plt.subplots(figsize=(13, 0.32 * len(rows) + 1.5))
    colors = ["#2b7bba" if r["direction"] == "h2d" else "#e08a1e" for r in rows]
    ax.barh(range(len(rows)), fr, color=colors)
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.axvline(97, color="k", ls="--", lw=0.8)
    for i, r in enumerate(rows):
        ax.text(fr[i] + 0.5, i, f"{r['gib_s']:.1f} GiB/s", va="center", fontsize=7)
    p = results["peak"]
    ax.set_xlabel(f"% of same-run peak (H2D {p['h2d']:.1f}, D2H {p['d2h']:.1f} GiB/s; blue H2D, orange D2H)")
    ax.set_title(f"Plan tier transfers on {results['env'].get('gpu', 'cpu')}")
    ax.set_xlim(0, 115)
    fig.subplots_adjust(left=0.5, right=0.97, top=0.95, bottom=0.08)
    fig.savefig(path, dpi=120)



if __name__ == "__main__":
    if sys.argv[1:2] == ["--plot"]:  # re-plot a results file: --plot results.json out.png
        import json

        _plot(json.loads(Path(sys.argv[2]).read_text()), Path(sys.argv[3]))
    else:
        main(sys.argv[1:])
