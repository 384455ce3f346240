"""The Plan tier (store ``fluxon_plan``): KV and latents moved straight between the runtime's
tensors and a Plan store's registered host segments, in batches, with no CPU staging.

One module per role; each states the lifecycle of what it hands out:

    store.py       `PlanTierStore`, the facade: the store interfaces, each call to one role
    segment_registration.py  warm-up and registration: segments ready, registered, streams
                   (`TransferLink`)
    write.py       the write path: plans per size, D2H batches, overlapped snapshots (`Writer`)
    plans.py       put plans of one write: start, commit and check, abort or remove (`PutPlans`)
    completion.py  the completion thread of overlapped writes: pieces, commit, ready (`Completion`)
    read.py        the read path: path checks, H2D batches, get plans released (`Reader`)
    capacity.py    staging slots and in-flight bytes; segment usage and removals
    batches.py     numpy-built copy batches: staging layout, pieces, directions
    client.py      building the Plan client; its optional calls, probed by attribute
    stats.py       `Counters` and the `PlanTierStats` snapshot
    failures.py    every failure a `StoreError`; submitted batches waited for on failure paths

``hbm`` (`cacheseek.stores.hbm`) is this store over a device-memory pool.
"""

from cacheseek.stores.plan_tier import batches
from cacheseek.stores.plan_tier.stats import PlanTierStats
from cacheseek.stores.plan_tier.store import PlanTierStore

__all__ = ["PlanTierStats", "PlanTierStore"]

_split = batches.split  # the name it had when the Plan tier was one module
