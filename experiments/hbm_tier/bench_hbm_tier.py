"""The HBM tier in one run (issue 14), against same-run baselines:

- ``peak``: the device-to-device copy peak (one large copy; torch's ``copy_`` and the transfer
  runtime's batch, the larger counts);
- ``full_hit``: a full hit of ``chunks`` chunks (lingbot_480p: 3 x 3.57 GiB) restored by the
  tiered store's ``read_path`` from the HBM tier and, after demoting every chunk, from the Plan tier
  (the same store, the same ring); then one read that promotes back into HBM (from the ring) and
  one more from HBM. Every restored ring is compared byte for byte with the written one. Targets:
  HBM restore >= 80% of the D2D peak, >= 20x faster than the Plan tier;
- ``cold_a``: request A (cold, every chunk written through HBM to the Plan tier, the Plan tier's
  D2H overlapped with compute) against the same request with no cache, alternating, fresh actions
  each rep; then the A/B/C/D gate on the tiered store (B from HBM), and B again after demoting
  every chunk (from the Plan tier, promoted) and once more (from HBM again). Target: A within 3%;
- ``mixed``: many sessions with Zipf-popular prefixes (the ``stress`` workload's session plan),
  one at a time, for each tier layout (no cache, Plan tier, HBM alone, HBM over the Plan tier):
  hit rate, hits per tier, mean time to first frame (``run_chunks(1)``: restore + first chunk)
  and mean session wall; every session's frames equal the no-cache run's.

Writes results.json (after every section), results.md and hbm_tier.png to ``out_dir``; prints a
progress line per step and the ratios. ``device=cpu`` with tiny geometries is the CI smoke run.

    python experiments/hbm_tier/bench_hbm_tier.py [key=value ...]   # conf/hbm_tier.yaml
"""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchlib import GiB, Progress, TimedHooks, compose, env_info, gib_s, median, plain, timed, write_json  # noqa: E402

ALIGN = 256  # the Plan clients' value blocks


# -- sizes ----------------------------------------------------------------------------------------
def chunk_sizes(geometry: str) -> dict[str, int]:
    from cacheseek.runtime.geometry import get_geometry

    g = get_geometry(geometry)
    kv = g.kv_nbytes_per_chunk(2)
    lat = g.latent_nbytes(2)
    block = lambda n: -(-n // ALIGN) * ALIGN  # noqa: E731
    return {"kv_value": kv, "chunk_kv": g.chunk_kv_nbytes(2), "latent": lat,
            "stored": 2 * g.n_layers * block(kv) + block(lat)}


def capacity(geometry: str, chunks: int, slack: int = 1 << 20) -> int:
    """Bytes for ``chunks`` chunks (KV and latent, in value blocks) plus ``slack`` (1 MiB)."""
    return chunks * chunk_sizes(geometry)["stored"] + slack


# -- peak -----------------------------------------------------------------------------------------
def section_peak(cfg, dev, transfer, sync) -> dict:
    import numpy as np
    import torch

    from cacheseek.transfer.batch import CopyBatch, Direction

    n = int(cfg.peak_bytes)
    src = torch.empty(n, dtype=torch.uint8, device=dev).random_(0, 256)
    dst = torch.empty(n, dtype=torch.uint8, device=dev)
    cuda = dev.type == "cuda"
    stream = torch.cuda.Stream() if cuda else None

    def torch_copy() -> None:
        if cuda:
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
            stream.synchronize()
        else:
            dst.copy_(src)

    rt_stream = transfer.new_stream() if hasattr(transfer, "new_stream") else None
    batch = CopyBatch.of([dst.data_ptr()], [src.data_ptr()], [n], Direction.D2D)
    ranges = [transfer.device_range(src), transfer.device_range(dst)]

    def runtime_copy() -> None:
        transfer.copy_batch(batch, stream=rt_stream, device_ranges=ranges)

    out = {"bytes": n}
    for name, fn in (("torch_copy", torch_copy), ("runtime_batch", runtime_copy)):
        secs = []
        for _ in range(int(cfg.reps) + 1):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            secs.append(time.perf_counter() - t0)
        out[f"{name}_gib_s"] = gib_s(n, median(secs[1:] or secs))
    out["verified"] = bool(torch.equal(src, dst))
    out["d2d_peak_gib_s"] = max(out["torch_copy_gib_s"], out["runtime_batch_gib_s"])
    # restore-shaped: one chunk's values (2 x layers copies) in one batch, batched call vs a loop
    sizes = chunk_sizes(cfg.full_hit.geometry)
    copies, size = sizes["chunk_kv"] // sizes["kv_value"], sizes["kv_value"]
    if copies * size <= n:
        shaped = CopyBatch.of(dst.data_ptr() + np.arange(copies) * size, src.data_ptr() + np.arange(copies) * size,
                              [size] * copies, Direction.D2D)
        runtimes = [("runtime", transfer, rt_stream)]
        if cuda:
            from cacheseek.transfer.cuda_transfer import CudaTransferRuntime

            for name, kw in (("batched", dict(copy_kernel=False)), ("loop", dict(copy_kernel=False, use_batch_api=False))):
                rt = CudaTransferRuntime(**kw)
                runtimes.append((name, rt, rt.new_stream()))
        for name, rt, st in runtimes:
            secs = timed(lambda: rt.copy_batch(shaped, stream=st, device_ranges=ranges), int(cfg.reps) + 1, sync=sync)
            out[f"chunk_{name}_gib_s"] = gib_s(copies * size, median(secs[1:] or secs))
            if rt is not transfer:
                rt.destroy_stream(st)
                rt.close()
        out["chunk_copies"], out["chunk_copy_bytes"] = copies, size
    if rt_stream is not None:
        transfer.destroy_stream(rt_stream)
    src = dst = None  # free the 8 GiB before the next section
    return out


# -- full hit -------------------------------------------------------------------------------------
def bare_ring_batch(src, dst, target):
    """The KV of a full hit as one D2D batch from the source ring ``src`` to ``dst`` (both lists
    of ``(k, v)`` per layer), run by run as the store restores it: the copies alone, no store."""
    import numpy as np

    from cacheseek.transfer.batch import CopyBatch, Direction

    tb = target.token_bytes
    ring_src = np.array([t.data_ptr() for pair in src for t in pair], dtype=np.int64)
    ring_dst = np.array([t.data_ptr() for pair in dst for t in pair], dtype=np.int64)
    offs = np.array([r.dst_token * tb for r in target.runs], dtype=np.int64)
    return CopyBatch.of((ring_dst[None, :] + offs[:, None]).ravel(), (ring_src[None, :] + offs[:, None]).ravel(),
                        np.repeat(np.array([r.n_tokens * tb for r in target.runs], dtype=np.int64), len(ring_src)),
                        Direction.D2D)


def section_full_hit(cfg, dev, transfer, sync, prog) -> dict:
    import torch

    from cacheseek.reuse.exact_prefix.keys import kv_locator, latent_locator
    from cacheseek.kv.ring import RingGeometry
    from cacheseek.reuse.exact_prefix.types import Skeleton, Tier, TrieNode
    from cacheseek.runtime.geometry import get_geometry
    from cacheseek.stores.base import RestoreTarget
    from cacheseek.stores.hbm import HbmTierStore
    from cacheseek.stores.plan_tier import PlanTierStore
    from cacheseek.stores.tiered import TieredStore

    c = cfg.full_hit
    g = get_geometry(c.geometry)
    n = int(c.chunks)
    ct = g.chunk_tokens
    shape = (1, n * ct, g.n_heads, g.head_dim)
    src = [tuple(torch.empty(shape, dtype=torch.bfloat16, device=dev) for _ in range(2)) for _ in range(g.n_layers)]
    for pair in src:
        for t in pair:
            t.view(torch.uint8).random_(0, 256)
    lats = [torch.randn(g.latent_shape, dtype=torch.bfloat16, device=dev) for _ in range(n)]
    t0 = time.perf_counter()
    hbm = HbmTierStore(capacity_bytes=capacity(c.geometry, int(c.hbm_chunks)), transfer=transfer)
    plan = PlanTierStore(segment_bytes=capacity(c.geometry, int(c.plan_chunks)), backing="private",
                         overlap=False, transfer=transfer, device=str(dev))
    store = TieredStore(stores=[("hbm", hbm), ("fluxon_plan", plan)], transfer=transfer, promote=False)
    warm_s = time.perf_counter() - t0
    out: dict = {"geometry": c.geometry, "chunks": n, "store_warmup_s": warm_s}
    try:
        nodes, parent = [], None
        write_s = []
        for d in range(n):
            key = bytes([d + 1]) * 32
            payload = [(k[:, d * ct : (d + 1) * ct], v[:, d * ct : (d + 1) * ct]) for k, v in src]
            sync()
            t1 = time.perf_counter()
            store.put_skeleton(latent_locator(key), lats[d])
            handle = store.put_async(kv_locator(key), payload, tier=Tier.HBM_STAGING)
            store.flush()
            sync()
            write_s.append(time.perf_counter() - t1)
            parent = TrieNode(key, b"a", d, parent, skeleton=Skeleton(latent_locator(key)), blob=handle)
            nodes.append(parent)
        out["write_through_s_per_chunk"] = median(write_s)
        out["levels_after_write"] = [list(store.levels_of(nd.blob)) for nd in nodes]
        prog.note(f"wrote {n} chunks through hbm > fluxon_plan in {sum(write_s):.2f} s (warm-up {warm_s:.1f} s)")

        ring = RingGeometry(chunk_size=g.chunk_size, frame_tokens=g.frame_tokens)
        dst = [tuple(torch.zeros(shape, dtype=torch.bfloat16, device=dev) for _ in range(2)) for _ in range(g.n_layers)]
        target = RestoreTarget(kv=tuple(dst), runs=ring.restore_runs(n), window_depths=tuple(range(n)),
                               token_bytes=g.n_heads * g.head_dim * 2, chunk_tokens=ct,
                               latents=tuple(torch.empty_like(lat) for lat in lats))
        nbytes = sum(r.n_tokens for r in target.runs) * target.token_bytes * 2 * g.n_layers + n * lats[0].numel() * 2
        out["bytes"] = nbytes

        def verify() -> bool:
            ok = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for pa, pb in zip(src, dst) for a, b in zip(pa, pb))
            return ok and all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(lats, target.latents))

        def clear() -> None:
            for pair in dst:
                for t in pair:
                    t.zero_()
            for t in target.latents:
                t.zero_()

        def read() -> float:
            sync()
            t1 = time.perf_counter()
            if not store.read_path(nodes, nodes, target):
                raise RuntimeError("full hit missed")
            sync()
            return time.perf_counter() - t1

        def reads(label: str) -> tuple[list[float], bool]:
            clear()
            secs = [read()]
            ok = verify()
            secs += [read() for _ in range(int(cfg.reps))]
            timed = secs[1:] or secs
            prog.note(f"{label}: {median(timed) * 1e3:.2f} ms median of {len(timed)} "
                      f"({gib_s(nbytes, median(timed)):.1f} GiB/s), bytes equal: {ok}")
            return timed, ok

        # the same bytes as one bare batch between the two rings (no store): the copies alone
        bare = bare_ring_batch(src, dst, target)
        bare_ranges = [transfer.device_range(t) for pair in src + dst for t in pair]
        bare_stream = transfer.new_stream() if hasattr(transfer, "new_stream") else None
        bare_secs = timed(lambda: transfer.copy_batch(bare, stream=bare_stream, device_ranges=bare_ranges),
                          int(cfg.reps) + 1, sync=sync)
        if bare_stream is not None:
            transfer.destroy_stream(bare_stream)
        out["bare_batch_s"] = median(bare_secs[1:] or bare_secs)
        out["bare_batch_bytes"] = bare.nbytes
        prog.note(f"the same KV as one bare batch between two rings: {out['bare_batch_s'] * 1e3:.2f} ms "
                  f"({gib_s(bare.nbytes, out['bare_batch_s']):.1f} GiB/s)")

        hbm_secs, hbm_ok = reads("full hit from hbm")
        for nd in reversed(nodes):
            store.demote(nd.blob, 0)
        out["levels_after_demote"] = [list(store.levels_of(nd.blob)) for nd in nodes]
        plan_secs, plan_ok = reads("full hit from fluxon_plan")
        store.promote = True
        clear()
        promote_s = read()
        promote_ok = verify()
        clear()
        again_s = read()
        again_ok = verify()
        rows = {r["name"]: r for r in store.stats.as_dict()["tiers"]}
        out.update(
            hbm_s=median(hbm_secs), hbm_s_all=hbm_secs, plan_s=median(plan_secs), plan_s_all=plan_secs,
            hbm_gib_s=gib_s(nbytes, median(hbm_secs)), plan_gib_s=gib_s(nbytes, median(plan_secs)),
            promote_read_s=promote_s, after_promote_s=again_s,
            verified=bool(hbm_ok and plan_ok and promote_ok and again_ok),
            hits={name: r.get("hits", 0) for name, r in rows.items()},
            promotions=rows["hbm"].get("promotions", 0),
            promotions_from_ring=rows["hbm"].get("promotions_from_ring", 0),
            plan_over_hbm=median(plan_secs) / median(hbm_secs),
            hbm_over_bare_batch=median(hbm_secs) / out["bare_batch_s"],
        )
    finally:
        store.close()
        hbm.close()
        plan.close()
    return out


# -- cold A and the gate --------------------------------------------------------------------------
def request(stack, actions, sync, *, manager=None, ingest=True, hooks=True) -> dict:
    """One session: wall (generate + flush), hook times, hit depth, frame hashes."""
    h = TimedHooks(stack.new_binding(manager, ingest_enabled=ingest), sync) if hooks else None
    rt = stack.runtime_factory.make(actions, hooks=h)
    sync()
    t0 = time.perf_counter()
    hashes = rt.generate()
    sync()
    t1 = time.perf_counter()
    if hooks:
        stack.store.flush()
    t2 = time.perf_counter()
    return {"wall_s": t2 - t0, "generate_s": t1 - t0, "flush_s": t2 - t1,
            "restore_s": h.restore_s if h else 0.0, "write_s": h.write_s if h else 0.0,
            "hit_depth": h.last_fast_forward if h else 0, "frames": [x.hex() for x in hashes]}


def store_overrides(layout: str, geometry: str, hbm_chunks: int, plan_chunks: int, staging: int,
                    slack: int = 1 << 20) -> list[str]:
    hbm = capacity(geometry, hbm_chunks, slack)
    plan = capacity(geometry, plan_chunks, slack)
    if layout == "nocache":
        return []
    if layout == "plan":
        return ["+store=fluxon_plan", f"store.segment_bytes={plan}", "store.backing=private",
                f"store.staging_slot_bytes={staging}"]
    if layout == "hbm":
        return ["+store=hbm", f"store.capacity_bytes={hbm}"]
    if layout == "hbm+plan":
        return ["+store=tiered", "store.tiers=[hbm,fluxon_plan]", f"store.hbm.capacity_bytes={hbm}",
                f"store.fluxon_plan.segment_bytes={plan}", "store.fluxon_plan.backing=private",
                f"store.fluxon_plan.staging_slot_bytes={staging}"]
    raise ValueError(f"unknown layout {layout!r}: use nocache, plan, hbm, hbm+plan")


def runtime_overrides(dev, c) -> list[str]:
    return [f"runtime.geometry={c.geometry}", f"runtime.device={dev.type}", f"runtime.compute_gemm_dim={c.gemm_dim}",
            f"runtime.compute_gemms={c.gemms}", "runtime.handout=false", *c.get("extra", [])]  # the KV restore path


def section_cold_a(cfg, dev, sync, prog, out_dir: Path) -> dict:
    from cacheseek.cli import CONF_DIR
    from cacheseek.orchestrator import build_stack
    from cacheseek.reuse.exact_prefix import NamespaceForest
    from cacheseek.workloads.prefix_gate import PrefixGate

    c = cfg.cold_a
    cuda = dev.type == "cuda"
    staging = chunk_sizes(c.geometry)["chunk_kv"] if (cuda and c.staging_slots) else 0
    overrides = runtime_overrides(dev, c) + store_overrides("hbm+plan", c.geometry, int(c.hbm_chunks),
                                                           int(c.plan_chunks), staging)
    t0 = time.perf_counter()
    stack = build_stack(compose(Path(CONF_DIR), "config", overrides), run_dir=out_dir / "runs" / "cold_a")
    out: dict = {"overrides": overrides, "stack_build_s": time.perf_counter() - t0, "reps": []}
    try:
        rt = stack.runtime_factory.make([[0.0] * 4], hooks=None)  # CUDA context, cuBLAS, kernels
        rt.generate()
        sync()
        del rt
        n, p = int(c.total_chunks), int(c.prefix_chunks)
        for rep in range(int(c.reps)):
            g = PrefixGate(total_chunks=n, prefix_chunks=p, ring_check=False, action_seed=1000 + rep)
            cold = request(stack, g.P + g.X, sync, hooks=False)
            tiered = request(stack, g.P + g.X, sync)
            ok = cold["frames"] == tiered["frames"] and tiered["hit_depth"] == 0
            # the request path is generate(); the flush waits for the last chunk's background D2H
            out["reps"].append({"nocache_s": cold["generate_s"], "tiered_s": tiered["generate_s"],
                                "tiered_write_s": tiered["write_s"], "tiered_flush_s": tiered["flush_s"],
                                "ratio": tiered["generate_s"] / cold["generate_s"],
                                "ratio_with_flush": tiered["wall_s"] / cold["generate_s"], "frames_equal": ok})
            prog.note(f"cold A rep {rep}: no cache {cold['generate_s']:.3f} s, tiered {tiered['generate_s']:.3f} s "
                      f"(x{tiered['generate_s'] / cold['generate_s']:.4f}; with the final flush "
                      f"x{tiered['wall_s'] / cold['generate_s']:.4f}; write hooks {tiered['write_s']:.3f} s)")
        gate = PrefixGate(total_chunks=n, prefix_chunks=p, ring_check=False, action_seed=7)
        a = request(stack, gate.P + gate.X, sync)
        b = request(stack, gate.P + gate.X, sync)
        cq = request(stack, gate.P + gate.Y, sync)
        d = request(stack, gate.P + gate.Y, sync, manager=stack.new_manager(forest=NamespaceForest(), shared_index=False), ingest=False)
        forest_nodes = sorted((nd for ns in stack.forest.namespaces() for nd in ns.iter_nodes() if nd.has_kv),
                              key=lambda nd: -nd.depth)
        for nd in forest_nodes:
            stack.store.demote(nd.blob, 0)
        b_plan = request(stack, gate.P + gate.X, sync)  # from the Plan tier, promoted
        b_again = request(stack, gate.P + gate.X, sync)  # from HBM again
        passed = (a["hit_depth"] == 0 and b["hit_depth"] == n and cq["hit_depth"] == p and d["hit_depth"] == 0
                  and b["frames"] == a["frames"] and cq["frames"] == d["frames"]
                  and b_plan["hit_depth"] == n and b_plan["frames"] == a["frames"]
                  and b_again["hit_depth"] == n and b_again["frames"] == a["frames"])
        rows = {r["name"]: r for r in stack.store.stats.as_dict()["tiers"]}
        out["gate"] = {"passed": passed,
                       **{f"{k}_{f}": v[f] for k, v in (("A", a), ("B", b), ("C", cq), ("D", d), ("B_plan", b_plan),
                                                        ("B_hbm_again", b_again))
                          for f in ("wall_s", "restore_s", "write_s", "hit_depth")},
                       "hits": {name: r.get("hits", 0) for name, r in rows.items()},
                       "promotions": rows["hbm"].get("promotions", 0)}
        out["metrics"] = {k: v for k, v in stack.metrics.as_dict().items() if k != "timeline"}
        prog.note(f"gate {'PASS' if passed else 'FAIL'}: B restore from hbm {b['restore_s'] * 1e3:.1f} ms, from "
                  f"fluxon_plan (+promotion) {b_plan['restore_s'] * 1e3:.1f} ms, hbm again "
                  f"{b_again['restore_s'] * 1e3:.1f} ms")
    finally:
        stack.close()
    ratios = [r["ratio"] for r in out["reps"]]
    out["A_ratio_median"] = median(ratios)
    out["A_ratio_with_flush_median"] = median([r["ratio_with_flush"] for r in out["reps"]])
    out["A_ratio_min"] = min(ratios) if ratios else None
    out["frames_equal"] = all(r["frames_equal"] for r in out["reps"])
    return out


# -- mixed workload -------------------------------------------------------------------------------
def section_mixed(cfg, dev, sync, prog, out_dir: Path) -> dict:
    from cacheseek.cli import CONF_DIR
    from cacheseek.orchestrator import build_stack
    from cacheseek.workloads.stress import StressWorkload

    c = cfg.mixed
    cuda = dev.type == "cuda"
    staging = chunk_sizes(c.geometry)["chunk_kv"] if cuda else 0
    plan = StressWorkload(sessions=int(c.sessions), depth=int(c.depth), branching=int(c.branching),
                          skew=float(c.skew), images=1, threads=1, capacity_chunks=None, seed=int(c.seed))
    out: dict = {"sessions": [f"i{i}:" + ".".join(map(str, path)) for i, path in plan.plan],
                 "distinct": len(set(plan.plan)), "layouts": {}}
    reference: dict[int, list[str]] = {}
    for layout in list(c.layouts):
        overrides = runtime_overrides(dev, c) + store_overrides(layout, c.geometry, int(c.hbm_chunks),
                                                               int(c.plan_chunks), staging, int(c.slack_bytes))
        t0 = time.perf_counter()
        stack = build_stack(compose(Path(CONF_DIR), "config", overrides), run_dir=out_dir / "runs" / f"mixed_{layout}")
        build_s = time.perf_counter() - t0
        try:
            rt = stack.runtime_factory.make([[0.0] * 4], hooks=None)
            rt.generate()
            sync()
            del rt
            manager = stack.new_manager() if layout != "nocache" else None
            rows = []
            for i, (image, path) in enumerate(plan.plan):
                binding = stack.new_binding(manager) if manager is not None else None
                rt = stack.runtime_factory.make(plan.actions(path), hooks=binding, image=plan.images[image])
                sync()
                t1 = time.perf_counter()
                rt.run_chunks(1)
                sync()
                ttff = time.perf_counter() - t1
                hashes = rt.generate()
                if binding is not None:
                    stack.store.flush()
                sync()
                wall = time.perf_counter() - t1
                frames = [h.hex() for h in hashes]
                if layout == "nocache":
                    reference[i] = frames
                rows.append({"session": i, "hit_depth": binding.last_fast_forward if binding else 0,
                             "ttff_s": ttff, "wall_s": wall,
                             "frames_ok": reference.get(i) is None or frames == reference[i]})
                del rt
            m = stack.metrics.as_dict() if manager is not None else {}
            tiers = m.get("tiers") or []
            res = {
                "overrides": overrides, "stack_build_s": build_s, "rows": rows,
                "hit_rate": m.get("hit_rate", 0.0), "hits": m.get("hits", 0), "lookups": m.get("lookups", 0),
                "full_hits": m.get("full_hits", 0), "chunks_restored": sum(r["hit_depth"] for r in rows),
                "mean_ttff_s": sum(r["ttff_s"] for r in rows) / len(rows),
                "mean_wall_s": sum(r["wall_s"] for r in rows) / len(rows),
                "evictions": m.get("evictions", 0), "demotions": m.get("demotions", 0),
                "tier_hits": {t["name"]: t.get("hits", 0) for t in tiers},
                "tier_promotions": {t["name"]: t.get("promotions", 0) for t in tiers},
                "demotion_failures": sum(t.get("demotion_failures", 0) for t in tiers),
                "evictions_for_demotion": {t["name"]: t.get("evictions_for_demotion", 0) for t in tiers},
                "frames_ok": all(r["frames_ok"] for r in rows),
            }
        finally:
            stack.close()
            gc.collect()
            if cuda:
                import torch

                torch.cuda.empty_cache()
        out["layouts"][layout] = res
        prog.note(f"mixed {layout:9s}: hit rate {res['hit_rate']:.0%}, {res['chunks_restored']} chunks restored, "
                  f"mean TTFF {res['mean_ttff_s'] * 1e3:.1f} ms, mean session {res['mean_wall_s']:.2f} s, "
                  f"tier hits {res['tier_hits'] or '-'}, frames ok {res['frames_ok']}")
    base = out["layouts"].get("nocache")
    if base:
        for res in out["layouts"].values():
            res["ttff_over_nocache"] = res["mean_ttff_s"] / base["mean_ttff_s"]
    return out


# -- main -----------------------------------------------------------------------------------------
def main(argv: list[str]) -> dict:
    import torch

    from cacheseek.plan.device import resolve_device
    from cacheseek.registry import import_backends
    from cacheseek.transfer import auto_transfer_runtime

    import_backends()
    cfg = compose(HERE / "conf", "hbm_tier", argv)
    out_dir = Path(cfg.out_dir)
    dev = resolve_device(cfg.device)
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.set_device(dev)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    sections = list(cfg.sections)
    results: dict = {"config": plain(cfg), "env": env_info(), "command": " ".join(["python", *sys.argv[:1], *argv])}
    prog = Progress(len(sections) + 1, "hbm_tier")
    transfer = auto_transfer_runtime(str(dev), use_batch_api=cfg.get("use_batch_api"), copy_kernel=cfg.get("copy_kernel"))
    results["transfer"] = repr(transfer)
    try:
        if "peak" in sections:
            results["peak"] = section_peak(cfg, dev, transfer, sync)
            p = results["peak"]
            prog.step(f"D2D peak {p['d2d_peak_gib_s']:.1f} GiB/s (torch {p['torch_copy_gib_s']:.1f}, transfer runtime "
                      f"{p['runtime_batch_gib_s']:.1f}), bytes equal {p['verified']}; one chunk's "
                      f"{p.get('chunk_copies')} values: the runtime {p.get('chunk_runtime_gib_s', 0):.1f} GiB/s, "
                      f"batched {p.get('chunk_batched_gib_s', 0):.1f} GiB/s, loop {p.get('chunk_loop_gib_s', 0):.1f} GiB/s")
            write_json(out_dir / "results.json", results)
            gc.collect()
        if "full_hit" in sections:
            results["full_hit"] = section_full_hit(cfg, dev, transfer, sync, prog)
            f = results["full_hit"]
            peak = (results.get("peak") or {}).get("d2d_peak_gib_s")
            if peak:
                f["hbm_over_peak"] = f["hbm_gib_s"] / peak
            prog.step(f"full hit of {f['chunks']} chunks ({f['bytes'] / GiB:.2f} GiB): hbm {f['hbm_s'] * 1e3:.2f} ms "
                      f"({f['hbm_gib_s']:.0f} GiB/s{f', %.1f%% of the D2D peak' % (100 * f['hbm_over_peak']) if peak else ''}), "
                      f"fluxon_plan {f['plan_s'] * 1e3:.1f} ms: hbm {f['plan_over_hbm']:.1f}x faster; "
                      f"promoting read {f['promote_read_s'] * 1e3:.1f} ms, then {f['after_promote_s'] * 1e3:.2f} ms; "
                      f"verified {f['verified']}")
            write_json(out_dir / "results.json", results)
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    finally:
        results["transfer_kernel_batches"] = getattr(transfer, "kernel_batches", 0)
        results["transfer"] = repr(transfer)
        transfer.close()
    if "cold_a" in sections:
        results["cold_a"] = section_cold_a(cfg, dev, sync, prog, out_dir)
        a = results["cold_a"]
        prog.step(f"cold A with write-through: x{a['A_ratio_median']:.4f} of no cache (median of {len(a['reps'])}), "
                  f"gate {'PASS' if a.get('gate', {}).get('passed') else 'FAIL'}")
        write_json(out_dir / "results.json", results)
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    if "mixed" in sections:
        results["mixed"] = section_mixed(cfg, dev, sync, prog, out_dir)
        prog.step(f"mixed workload over {len(results['mixed']['layouts'])} layouts")
        write_json(out_dir / "results.json", results)
    results["targets"] = targets(results)
    write_json(out_dir / "results.json", results)
    md = render(results)
    (out_dir / "results.md").write_text(md + "\n")
    print(md)
    _plot(results, out_dir / "hbm_tier.png")
    prog.step(f"results in {out_dir}")
    return results


def targets(r: dict) -> dict:
    out: dict = {}
    f = r.get("full_hit") or {}
    if "hbm_over_peak" in f:
        out["full_hit_hbm_at_least_80pct_of_d2d_peak"] = {"value": f["hbm_over_peak"], "met": f["hbm_over_peak"] >= 0.8}
    if "plan_over_hbm" in f:
        out["full_hit_hbm_at_least_20x_plan"] = {"value": f["plan_over_hbm"], "met": f["plan_over_hbm"] >= 20}
    a = r.get("cold_a") or {}
    if a.get("A_ratio_median") is not None:
        out["cold_a_within_3pct_of_nocache"] = {"value": a["A_ratio_median"], "met": a["A_ratio_median"] <= 1.03}
    return out


def render(r: dict) -> str:
    env = r["env"]
    lines = [f"# HBM tier on {env.get('gpu', 'cpu')} ({env.get('time')})", ""]
    if "peak" in r:
        p = r["peak"]
        lines += [f"D2D peak: {p['d2d_peak_gib_s']:.1f} GiB/s (torch copy_ {p['torch_copy_gib_s']:.1f}, transfer "
                  f"runtime batch {p['runtime_batch_gib_s']:.1f}; one copy of {p['bytes'] / GiB:.2f} GiB). One chunk's "
                  f"{p.get('chunk_copies')} values of {p.get('chunk_copy_bytes')} B D2D: the transfer runtime as "
                  f"configured {p.get('chunk_runtime_gib_s', 0):.1f} GiB/s, cudaMemcpyBatchAsync "
                  f"{p.get('chunk_batched_gib_s', 0):.1f} GiB/s, a cudaMemcpyAsync loop {p.get('chunk_loop_gib_s', 0):.1f} GiB/s.",
                  "", f"Transfer runtime of peak and full hit: `{r.get('transfer')}`, {r.get('transfer_kernel_batches', 0)} "
                      "batches through the range-copy kernel.", ""]
    if "full_hit" in r:
        f = r["full_hit"]
        lines += ["## Full hit (tiered store read_path)", "",
                  "| served by | restore ms | GiB/s | of D2D peak | vs hbm |", "|---|---|---|---|---|"]
        peak = (r.get("peak") or {}).get("d2d_peak_gib_s")
        for name, s in (("hbm", f["hbm_s"]), ("fluxon_plan", f["plan_s"]), ("fluxon_plan + promotion", f["promote_read_s"]),
                        ("hbm after promotion", f["after_promote_s"])):
            g = gib_s(f["bytes"], s)
            lines.append(f"| {name} | {s * 1e3:.2f} | {g:.1f} | {f'{g / peak:.1%}' if peak else ''} | "
                         f"{s / f['hbm_s']:.1f}x |")
        lines += ["", f"The same KV as one bare D2D batch between two rings (no store, no latents): "
                      f"{f['bare_batch_s'] * 1e3:.2f} ms ({gib_s(f['bare_batch_bytes'], f['bare_batch_s']):.1f} GiB/s); "
                      f"the HBM restore takes {f['hbm_over_bare_batch']:.2f}x that (the store's bookkeeping).",
                  "", f"{f['chunks']} chunks of {f['geometry']}, {f['bytes'] / GiB:.2f} GiB; write-through "
                      f"{f['write_through_s_per_chunk'] * 1e3:.1f} ms a chunk; rings equal: {f['verified']}", ""]
    if "cold_a" in r:
        a = r["cold_a"]
        gate = a.get("gate", {})
        lines += ["## Cold A with write-through (hbm > fluxon_plan) vs no cache", "",
                  "Times of generate() (the request path); the final flush waits for the last chunk's "
                  "background copy to the Plan tier.", "",
                  "| rep | no cache s | tiered s | ratio | ratio with the final flush | write hooks s | flush s |",
                  "|---|---|---|---|---|---|---|"]
        for i, x in enumerate(a["reps"]):
            lines.append(f"| {i} | {x['nocache_s']:.3f} | {x['tiered_s']:.3f} | {x['ratio']:.4f} | "
                         f"{x['ratio_with_flush']:.4f} | {x['tiered_write_s']:.3f} | {x['tiered_flush_s']:.3f} |")
        if gate:
            lines += ["", f"Gate {'PASS' if gate['passed'] else 'FAIL'}; B restore from hbm "
                          f"{gate['B_restore_s'] * 1e3:.1f} ms, from fluxon_plan with promotion "
                          f"{gate['B_plan_restore_s'] * 1e3:.1f} ms, from hbm again {gate['B_hbm_again_restore_s'] * 1e3:.1f} ms; "
                          f"hits per tier {gate['hits']}", ""]
    if "mixed" in r:
        m = r["mixed"]
        lines += ["## Mixed workload", "",
                  f"{len(m['sessions'])} sessions, {m['distinct']} distinct sequences, one at a time.", "",
                  "| layout | hit rate | chunks restored | hits per tier | demotions | demotion failures | "
                  "evictions | evictions for demotion | mean TTFF ms | TTFF vs no cache | mean session s | frames ok |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, x in m["layouts"].items():
            lines.append(f"| {name} | {x['hit_rate']:.0%} | {x['chunks_restored']} | {x['tier_hits'] or ''} | "
                         f"{x['demotions']} | {x.get('demotion_failures', 0)} | {x['evictions']} | "
                         f"{x.get('evictions_for_demotion') or ''} | {x['mean_ttff_s'] * 1e3:.1f} | "
                         f"{x.get('ttff_over_nocache', float('nan')):.3f} | {x['mean_wall_s']:.2f} | {x['frames_ok']} |")
        lines.append("")
    if r.get("targets"):
        lines += ["## Targets", "", "| target | value | met |", "|---|---|---|"]
        for k, v in r["targets"].items():
            lines.append(f"| {k} | {v['value']:.4f} | {v['met']} |")
    return "\n".join(lines)


def _plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    f, p = r.get("full_hit"), r.get("peak")
    if f:
        names = ["hbm", "fluxon_plan", "plan+promote", "hbm again"]
        secs = [f["hbm_s"], f["plan_s"], f["promote_read_s"], f["after_promote_s"]]
        axes[0].bar(names, [s * 1e3 for s in secs], color=["C2", "C0", "C1", "C2"])
        axes[0].set_yscale("log")
        axes[0].set_ylabel("restore ms (log)")
        for i, s in enumerate(secs):
            axes[0].text(i, s * 1e3, f"{gib_s(f['bytes'], s):.0f} GiB/s", ha="center", va="bottom", fontsize=8)
        title = f"full hit, {f['chunks']} chunks ({f['bytes'] / GiB:.1f} GiB)"
        if p:
            title += f"; D2D peak {p['d2d_peak_gib_s']:.0f} GiB/s"
        axes[0].set_title(title, fontsize=9)
    a = r.get("cold_a")
    if a and a["reps"]:
        x = range(len(a["reps"]))
        axes[1].bar([i - 0.2 for i in x], [q["nocache_s"] for q in a["reps"]], 0.4, label="no cache")
        axes[1].bar([i + 0.2 for i in x], [q["tiered_s"] for q in a["reps"]], 0.4, label="hbm > fluxon_plan")
        axes[1].set_xticks(list(x), [f"rep {i}: x{q['ratio']:.3f}" for i, q in enumerate(a["reps"])], fontsize=8)
        axes[1].set_ylabel("cold A wall s")
        axes[1].legend(fontsize=8)
        axes[1].set_title("cold A: write-through vs no cache", fontsize=9)
    m = r.get("mixed")
    if m and m["layouts"]:
        names = list(m["layouts"])
        ttff = [m["layouts"][n]["mean_ttff_s"] * 1e3 for n in names]
        hits = [m["layouts"][n]["hit_rate"] * 100 for n in names]
        axes[2].bar(names, ttff, color="C3")
        axes[2].set_ylabel("mean time to first frame ms")
        twin = axes[2].twinx()
        twin.plot(names, hits, "ko-")
        twin.set_ylabel("hit rate %")
        twin.set_ylim(0, 100)
        axes[2].set_title(f"mixed: {len(m['sessions'])} sessions, Zipf prefixes", fontsize=9)
    fig.suptitle(f"HBM tier on {r['env'].get('gpu', 'cpu')}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)



if __name__ == "__main__":
    main(sys.argv[1:])
