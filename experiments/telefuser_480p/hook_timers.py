"""CacheSeek's own time on a full hit, without a profiler (issue 24 item 4: at most 15 ms at 480p).

`timed_hooks` wraps, for the duration of one request, the hooks TeleFuser calls on the binding
(``on_runtime_created``: keys, lookup, validation, the restore and publication;
``on_chunk_control`` and ``on_chunk_finalized``: each chunk's seam) and the wait for the restore's
copies (``PendingBatch.wait``), and sums the wall time of each with ``perf_counter``; `PARTS`
breaks the hooks down (keys, fingerprints, the trie walk, the restore with its copy wait). Only for a
request that writes nothing (a full hit): a write's copies are waited for on other threads. CacheSeek's
own time is the hooks' total less the copy wait: what a hit costs beyond moving its bytes. A
hook that calls another is counted once (only the outermost call is timed).
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Any, Iterator

__all__ = ["own_time", "timed_hooks"]

HOOKS = ("on_runtime_created", "on_chunk_control", "on_chunk_finalized")
# Parts of a hit's hooks, each summed over its calls wherever it runs ("module:Class.attr").
PARTS = {
    "action_keys": "cacheseek.reuse.exact_prefix.lazy_keys:chunk_action_key",
    "image_fingerprint": "cacheseek.reuse.exact_prefix.telefuser_lingbot:_image_fingerprint",
    "config_blob": "cacheseek.namespace:config_blob",
    "runtime_weights": "cacheseek.reuse.exact_prefix.telefuser_lingbot:LingBotWorldKVBinding._runtime_weights",
    "validate_geometry": "cacheseek.reuse.exact_prefix.telefuser_lingbot:LingBotWorldKVBinding._validate_geometry",
    "trie_lookup": "cacheseek.reuse.exact_prefix.trie:NamespaceForest.lookup",
    "restore": "cacheseek.reuse.exact_prefix.restore:Restorer.restore",
    "demote_tiers": "cacheseek.reuse.exact_prefix.capacity:Demoter.demote_tiers",
}


@contextlib.contextmanager
def timed_hooks() -> Iterator[dict[str, float]]:
    """Yields ``{name: seconds}``, filled while the block runs; the methods are restored after."""
    from cacheseek.reuse.exact_prefix.telefuser_lingbot import LingBotWorldKVBinding
    from cacheseek.transfer.pending import PendingBatch

    import importlib

    totals: dict[str, float] = {name: 0.0 for name in (*HOOKS, "copy_wait", *PARTS)}
    depth = [0]
    targets = [(LingBotWorldKVBinding, name, name) for name in HOOKS] + [(PendingBatch, "wait", "copy_wait")]
    for key, where in PARTS.items():
        module, _, path = where.partition(":")
        owner: Any = importlib.import_module(module)
        *outer, attr = path.split(".")
        for name in outer:
            owner = getattr(owner, name)
        targets.append((owner, attr, key))
    saved = [(cls, attr, vars(cls).get(attr)) for cls, attr, _ in targets]  # None: inherited

    def wrap(fn: Any, key: str) -> Any:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            hook = key in HOOKS
            outer = not hook or depth[0] == 0
            depth[0] += hook
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= hook
                if outer:
                    totals[key] += time.perf_counter() - start

        return timed

    for cls, attr, key in targets:
        setattr(cls, attr, wrap(getattr(cls, attr), key))
    try:
        yield totals
    finally:
        for cls, attr, fn in saved:
            if fn is None:
                delattr(cls, attr)
            else:
                setattr(cls, attr, fn)


def own_time(totals: dict[str, float]) -> float:
    """The hooks' wall time less the copy wait inside them."""
    return sum(totals[name] for name in HOOKS) - totals["copy_wait"]
