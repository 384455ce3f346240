"""The Plan tier (store ``fluxon_plan``): KV and latents moved straight between the runtime's
tensors and a Plan store's registered host segments, in batches, with no CPU staging.

One module per idea; each states the lifecycle of what it hands out:

    store.py       `PlanTierStore`, the store interfaces over the parts below
    warmup.py      its warm-up, in the foreground or on a thread, and the session starts it
                   yields to (`Warmup`, `WarmupOptions`)
    segments.py    the client (built from its registry name; its optional calls and records)
                   and its segments registered with the transfer runtime (`TransferLink`), and
                   what the paths copy with (`Attached`, `ValueMemory`)
    write.py       the write path: put plans per size, D2H batches, overlapped snapshots
                   (`Writer`, `PutPlans`), and the completion thread of overlapped writes:
                   pieces, commit, ready (`Completion`)
    read.py        the read path: the path checked against the target and its copy runs, H2D
                   batches, get plans released (`Reader`)
    capacity.py    staging slots (their layout, the pieces out of them) and in-flight bytes;
                   segment usage and removals
    stats.py       `Counters`, the `PlanTierStats` snapshot, failures as `StoreError`s and the one
                   place a write's end is set on its blob

``hbm`` (`cacheseek.stores.hbm`) is this store over a device-memory pool.
"""

from cacheseek.stores.plan_tier.stats import PlanTierStats
from cacheseek.stores.plan_tier.store import PlanTierStore

__all__ = ["PlanTierStats", "PlanTierStore"]

