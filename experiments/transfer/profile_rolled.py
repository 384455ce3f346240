"""Where a rolled-ring restore's time goes: cProfile of `PlanTierStore.read_path` on the 400-run
case of bench_transfer.py (section 3), against the same copies as one bare batch.

    python experiments/transfer/profile_rolled.py [reads] [register_piece_bytes]

Prints the median read and bare-batch times and the profile's top functions by own time. The
store's time beyond the bare batch is what it adds: keys, Plan gets, descriptors, validation,
events and waits. Not a benchmark with targets: a tool to find that overhead on the device.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))


def main(reads: int = 200, piece_bytes: str = "0") -> None:
    import numpy as np
    import torch

    from cacheseek.kv.ring import RingGeometry
    from cacheseek.reuse.exact_prefix.types import Skeleton, Tier, TrieNode
    from cacheseek.stores.base import RestoreTarget
    from cacheseek.stores.plan_tier import PlanTierStore
    from cacheseek.transfer.batch import CopyBatch, Direction

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    store = PlanTierStore(segment_bytes=2 << 30, backing="private", overlap=False, device=str(dev),
                          register_piece_bytes=piece_bytes)
    rg = RingGeometry(chunk_size=3, frame_tokens=16, local_attn_size=13, sink_size=1)
    layers, heads, dim, depth = 40, 40, 128, 8
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
    runs = rg.restore_runs(depth)
    tb = heads * dim * 2
    ring = tuple(tuple(torch.zeros(1, rg.local_attn_size * rg.frame_tokens, heads, dim, device=dev, dtype=torch.bfloat16)
                       for _ in range(2)) for _ in range(layers))
    target = RestoreTarget(kv=ring, runs=runs, window_depths=tuple(rg.window_depths(depth)), token_bytes=tb,
                           chunk_tokens=ct, latents=tuple(torch.empty_like(lats[0]) for _ in range(depth)))
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def timed(fn) -> list[float]:
        out = []
        for _ in range(reads):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            out.append(time.perf_counter() - t0)
        return out

    for _ in range(20):
        assert store.read_path(nodes, window, target)
    read_s = timed(lambda: store.read_path(nodes, window, target))
    # the same copies as one bare batch from the source chunks (device to device is not the same
    # engine; so the bare batch reads the values where the store keeps them: the registered segment)
    seg = store.plan_client.wait_local_segments_ready()[0]
    n = len(runs) * 2 * layers
    size = int(np.mean([r.n_tokens for r in runs])) * tb // 16 * 16
    offs = np.arange(n, dtype=np.int64) * size
    dst = torch.empty(n * size, dtype=torch.uint8, device=dev)
    base = seg.ptr + (seg.length - n * size) // 4096 * 4096
    bare = CopyBatch.of(int(dst.data_ptr()) + offs, base + offs, size, Direction.H2D)
    stream = store.transfer.new_stream()
    bare_s = timed(lambda: store.transfer.copy_batch(bare, stream=stream, device_ranges=[store.transfer.device_range(dst)]))
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(reads):
        store.read_path(nodes, window, target)
    sync()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(22)
    print(f"read_path median {statistics.median(read_s) * 1e3:.3f} ms; bare batch of {n} x {size} B "
          f"median {statistics.median(bare_s) * 1e3:.3f} ms; pieces {piece_bytes}")
    print(out.getvalue())
    store.close()


if __name__ == "__main__":
    main(*(int(a) if i == 0 else a for i, a in enumerate(sys.argv[1:])))
