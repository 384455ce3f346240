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
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from bench_transfer import rolled_case  # noqa: E402
from benchlib import compose, median, timed  # noqa: E402


def main(reads: int = 200, piece_bytes: str = "0") -> None:
    import numpy as np
    import torch

    from cacheseek.stores.plan_tier import PlanTierStore
    from cacheseek.transfer.batch import CopyBatch, Direction

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    store = PlanTierStore(segment_bytes=2 << 30, backing="private", overlap=False, device=str(dev),
                          register_piece_bytes=piece_bytes)
    rc = compose(HERE / "conf", "transfer", []).rolled  # the benchmark's 400-run case
    nodes, window, target, _ = rolled_case(store, dev, rc)
    runs, tb, layers = target.runs, target.token_bytes, target.n_layers
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    for _ in range(20):
        assert store.read_path(nodes, window, target)
    read_s = timed(lambda: store.read_path(nodes, window, target), reads, sync=sync)
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
    bare_s = timed(lambda: store.transfer.copy_batch(bare, stream=stream, device_ranges=[store.transfer.device_range(dst)]),
                   reads, sync=sync)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(reads):
        store.read_path(nodes, window, target)
    sync()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(22)
    print(f"read_path median {median(read_s) * 1e3:.3f} ms; bare batch of {n} x {size} B "
          f"median {median(bare_s) * 1e3:.3f} ms; pieces {piece_bytes}")
    print(out.getvalue())
    store.close()


if __name__ == "__main__":
    main(*(int(a) if i == 0 else a for i, a in enumerate(sys.argv[1:])))
