"""Where a background warm-up meets the first request: one run of bench_warmup.py's modes with
the warm-up's stages and the request's steps stamped on one clock.

    python experiments/warmup/timeline.py [mode] [key=value ...]     # conf/warmup.yaml; mode: background

Prints, in ms from the start of the stack's build (the benchmark's start): the store's construction, the warm-up thread's
stages (transfer runtime built, segment mapped, each segment piece faulted and registered, its
waits for sessions starting), the session's token, the runtime's creation and the binding's hook.
Not a benchmark with targets: a tool to see what the first request waits for.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from bench_warmup import one_run  # noqa: E402
from benchlib import compose  # noqa: E402


def main(argv: list[str]) -> None:
    import torch

    from cacheseek import orchestrator
    from cacheseek.orchestrator import Stack
    from cacheseek.reuse.exact_prefix.telefuser_lingbot import LingBotWorldKVBinding
    from cacheseek.stores.plan_tier import segments as link, store
    from cacheseek.stores.startup import SessionStarts
    from cacheseek.transfer import base, cuda_transfer, registrations

    mode = argv[0] if argv and "=" not in argv[0] else "background"
    cfg = compose(HERE / "conf", "warmup", [a for a in argv if "=" in a])
    cuda = cfg.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    one_run(cfg, "nocache", Path(cfg.out_dir) / "timeline" / "warm", sync)  # context and kernels

    stamps: list[tuple[float, str, str]] = []
    saved = []

    def stamp(owner, name: str, label: str, *, end: bool = True, limit: int = 10**9) -> None:
        fn = getattr(owner, name)
        saved.append((owner, name, owner.__dict__[name]))
        count = [0]

        def wrapped(*a, **k):
            count[0] += 1
            loud = count[0] <= limit
            if loud:
                stamps.append((time.perf_counter(), threading.current_thread().name, f"{label} begins"))
            try:
                return fn(*a, **k)
            finally:
                if loud and end:
                    stamps.append((time.perf_counter(), threading.current_thread().name, f"{label} ends"))

        setattr(owner, name, wrapped)

    stamp(link.TransferLink, "warm_up", "warm-up")
    stamp(link.TransferLink, "_build_transfer", "transfer runtime built")
    stamp(base.TransferRuntimeBase, "register_in_pieces", "registration in pieces")
    stamp(cuda_transfer.CudaTransferRuntime, "_register_one", "cudaHostRegister of a piece", limit=12)
    stamp(SessionStarts, "wait_clear", "yield to a session start", limit=3)
    stamp(store.PlanTierStore, "session_starting", "session token taken")
    stamp(Stack, "new_binding", "binding made")
    stamp(registrations, "_register_pieces", "pieces computed and registered", limit=2)
    stamp(orchestrator, "build_stack", "stack build", limit=1)
    stamp(LingBotWorldKVBinding, "on_runtime_created", "the binding's hook", limit=1)
    try:
        r = one_run(cfg, mode, Path(cfg.out_dir) / "timeline" / mode, sync)
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
    t0 = min(t for t, _, what in stamps if what == "stack build begins")
    for t, thread, what in sorted(stamps):
        print(f"{(t - t0) * 1e3:9.2f} ms  {thread:24s} {what}")
    print({k: v for k, v in r.items() if isinstance(v, (int, float))})


if __name__ == "__main__":
    main(sys.argv[1:])
