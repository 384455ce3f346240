"""Where an HBM full hit's time goes: the 3-chunk 480p restore of bench_hbm_tier.py's full_hit
section through the tiered store (hbm > fluxon_plan), split at the kernel launch, against the same
KV as one bare batch, then cProfile of the reads.

    python experiments/hbm_tier/profile_full_hit.py [reads] [geometry] [chunks]

Prints, per path (median of ``reads``): the whole call, the host time before the copy is launched
and the time from the launch to the return (the copy and the wait for it). Not a benchmark with
targets: a tool to find the store's cost on the device.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from bench_hbm_tier import bare_ring_batch, capacity  # noqa: E402
from benchlib import median  # noqa: E402


def main(reads: int = 50, geometry: str = "lingbot_480p", chunks: int = 3) -> None:
    import torch

    from cacheseek.kv.ring import RingGeometry
    from cacheseek.reuse.exact_prefix.keys import kv_locator, latent_locator
    from cacheseek.reuse.exact_prefix.types import Skeleton, Tier, TrieNode
    from cacheseek.runtime.geometry import get_geometry
    from cacheseek.stores.base import RestoreTarget
    from cacheseek.stores.hbm import HbmTierStore
    from cacheseek.stores.plan_tier import PlanTierStore
    from cacheseek.stores.tiered import TieredStore
    from cacheseek.transfer import copy_kernel
    from cacheseek.transfer.cuda_transfer import CudaTransferRuntime

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    transfer = CudaTransferRuntime()
    g = get_geometry(geometry)
    ct = g.chunk_tokens
    shape = (1, chunks * ct, g.n_heads, g.head_dim)
    src = [tuple(torch.empty(shape, dtype=torch.bfloat16, device=dev).random_() for _ in range(2)) for _ in range(g.n_layers)]
    lats = [torch.randn(g.latent_shape, dtype=torch.bfloat16, device=dev) for _ in range(chunks)]
    hbm = HbmTierStore(capacity_bytes=capacity(geometry, chunks), transfer=transfer)
    plan = PlanTierStore(segment_bytes=capacity(geometry, chunks), backing="private", overlap=False,
                         transfer=transfer, device=str(dev))
    store = TieredStore(stores=[("hbm", hbm), ("fluxon_plan", plan)], transfer=transfer, promote=False)
    nodes, parent = [], None
    for d in range(chunks):
        key = bytes([d + 1]) * 32
        store.put_skeleton(latent_locator(key), lats[d])
        handle = store.put_async(kv_locator(key), [(k[:, d * ct:(d + 1) * ct], v[:, d * ct:(d + 1) * ct]) for k, v in src],
                                 tier=Tier.HBM_STAGING)
        store.flush()
        parent = TrieNode(key, b"a", d, parent, skeleton=Skeleton(latent_locator(key)), blob=handle)
        nodes.append(parent)
    ring = RingGeometry(chunk_size=g.chunk_size, frame_tokens=g.frame_tokens)
    dst = [tuple(torch.zeros(shape, dtype=torch.bfloat16, device=dev) for _ in range(2)) for _ in range(g.n_layers)]
    target = RestoreTarget(kv=tuple(dst), runs=ring.restore_runs(chunks), window_depths=tuple(range(chunks)),
                           token_bytes=g.n_heads * g.head_dim * 2, chunk_tokens=ct,
                           latents=tuple(torch.empty_like(t) for t in lats))
    bare = bare_ring_batch(src, dst, target)
    bare_ranges = [transfer.device_range(t) for p in src + dst for t in p]
    bare_stream = transfer.new_stream()

    launches: list[float] = []
    inner = copy_kernel.CudaRangeKernel.launch

    def launch(self, table, stream):
        launches.append(time.perf_counter())
        return inner(self, table, stream)

    copy_kernel.CudaRangeKernel.launch = launch

    def split(fn) -> tuple[float, float, float]:
        torch.cuda.synchronize()
        launches.clear()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        return t1 - t0, launches[0] - t0, t1 - launches[0]

    def restore() -> None:
        assert store.read_path(nodes, nodes, target)

    def copy_bare() -> None:
        transfer.copy_batch(bare, stream=bare_stream, device_ranges=bare_ranges)

    for name, fn in (("bare batch", copy_bare), ("hbm full hit", restore), ("bare batch", copy_bare)):
        split(fn)
        rows = [split(fn) for _ in range(reads)]
        total, before, after = (median([r[i] for r in rows]) for i in range(3))
        print(f"{name:13s} {total * 1e3:7.3f} ms: {before * 1e3:6.3f} ms before the launch, "
              f"{after * 1e3:6.3f} ms launch to return")
    stages = _time_stages(reads, restore)
    print("per restore, inclusive wall time of each stage (mean us):")
    for name, us in stages:
        print(f"  {us:8.1f}  {name}")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(reads):
        restore()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
    print(out.getvalue())
    store.close()
    hbm.close()
    plan.close()


def _time_stages(reads: int, restore) -> list[tuple[str, float]]:
    """Mean wall time per restore of each stage of the read path (functions wrapped in place,
    then put back)."""
    from cacheseek.stores.plan_tier import read
    from cacheseek.stores.tiered import TieredStore
    from cacheseek.transfer.base import TransferRuntimeBase

    spots = [(TieredStore, "read_path"), (read.Reader, "read_path"), (read, "check_path"),
             (read.Reader, "_start"), (read.GetRead, "transfer"), (read, "decode_plan_table"),
             (read.Reader, "_declared"), (read.Reader, "_window_batch"), (TransferRuntimeBase, "record_event"),
             (TransferRuntimeBase, "submit_batch"), (TransferRuntimeBase, "_validate"),
             (type(None), None), (read.Reader, "_wait"), (read.GetRead, "end")]
    from cacheseek.transfer.cuda_transfer import CudaTransferRuntime

    spots[11] = (CudaTransferRuntime, "_submit")
    totals: dict[str, float] = {}
    saved = []
    for owner, name in spots:
        fn = getattr(owner, name)
        label = f"{getattr(owner, '__name__', owner)}.{name}"
        saved.append((owner, name, owner.__dict__[name] if isinstance(owner, type) else fn))

        def timed(*a, _fn=fn, _label=label, **k):
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                totals[_label] = totals.get(_label, 0.0) + time.perf_counter() - t0

        setattr(owner, name, timed)
    try:
        for _ in range(reads):
            restore()
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
    return [(label, secs / reads * 1e6) for label, secs in totals.items()]


if __name__ == "__main__":
    args = sys.argv[1:]
    main(int(args[0]) if args else 50, *(args[1:2]), *(int(a) for a in args[2:3]))
