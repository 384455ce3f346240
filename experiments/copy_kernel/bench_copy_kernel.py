"""Which engine moves a batch of copies fastest: copy engines or the range-copy kernel.

    python experiments/copy_kernel/bench_copy_kernel.py [key=value ...]     # conf/copy_kernel.yaml

Per case (direction, copy size, count; conf), the same descriptors through the transfer runtime
three ways, each the median of ``reps`` after one warm-up, submission to synchronize:
``batch`` (cudaMemcpyBatchAsync), ``loop`` (one cudaMemcpyAsync per copy) and ``kernel`` (the
range-copy kernel, one launch per 1024 copies). The baseline of each direction is measured in
the same run: one copy of ``peak_bytes`` (torch ``copy_`` on a side stream, and the kernel with
one range; the larger is the peak). Host memory is a registered (pinned) numpy buffer, as the
Plan tier's segment is; every case's destination is checked byte for byte after the kernel run.
Writes ``results.json``, ``results.md`` and ``copy_kernel.png`` to ``out_dir``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchlib import Progress, compose, env_info, gib_s, median, write_json  # noqa: E402


def main(argv: list[str]) -> dict:
    import numpy as np
    import torch

    from cacheseek.transfer.batch import CopyBatch, Direction
    from cacheseek.transfer.memory import HostMapping, MemoryRange

    cfg = compose(HERE / "conf", "copy_kernel", argv)
    out_dir = Path(cfg.out_dir)
    cuda = cfg.device == "cuda"
    reps = int(cfg.reps)
    cases = [(str(d), int(b), int(c)) for d, b, c in cfg.cases]
    prog = Progress(len(cases) + 2 + (len(cfg.sweep) + len(cfg.hybrid_cases) if cuda else 0), "copy_kernel")
    results: dict = {"config": {k: cfg[k] for k in ("reps", "peak_bytes", "total_bytes")}, "cases": [list(c) for c in cases],
                     "env": env_info(), "command": "python experiments/copy_kernel/bench_copy_kernel.py " + " ".join(argv),
                     "peak": {}, "rows": []}
    runtimes, sync, dev = _runtimes(cuda)
    kernel_rt = runtimes["kernel"]
    results["kernel"] = repr(kernel_rt.range_kernel)
    prog.step(f"runtimes ready: {results['kernel']}")

    need = max(int(cfg.peak_bytes), max((b * (c or int(cfg.total_bytes) // b) for _, b, c in cases)))
    host_np = np.empty(need, dtype=np.uint8)
    host_np[:: 4096] = 7  # touch every page before registering
    host = HostMapping(int(host_np.ctypes.data), need, 0)
    for rt in runtimes.values():
        rt.register([host])
    src_dev = torch.empty(need, dtype=torch.uint8, device=dev)
    dst_dev = torch.empty(need, dtype=torch.uint8, device=dev)
    ranges = [MemoryRange(int(src_dev.data_ptr()), need), MemoryRange(int(dst_dev.data_ptr()), need)]
    gen = torch.Generator(device=dev).manual_seed(0)
    src_dev.random_(0, 256, generator=gen)
    host_np[:] = src_dev.cpu().numpy() if cuda else src_dev.numpy()

    def run(rt, batch) -> list[float]:
        out = []
        for _ in range(reps + 1):
            sync()
            t0 = time.perf_counter()
            rt.copy_batch(batch, stream=rt_stream, device_ranges=ranges)
            out.append(time.perf_counter() - t0)
        return out[1:]

    rt_stream = runtimes["batch"].new_stream() if cuda else None
    # -- same-run peaks: one copy each way ------------------------------------------------------
    n = int(cfg.peak_bytes)
    for direction, src in (("d2d", int(src_dev.data_ptr())), ("h2d", host.ptr)):
        one = CopyBatch.of([int(dst_dev.data_ptr())], [src], [n], Direction(direction))
        torch_src = src_dev[:n] if direction == "d2d" else torch.from_numpy(host_np[:n])
        side = torch.cuda.Stream() if cuda else None

        def torch_copy() -> None:
            if side is None:
                dst_dev[:n].copy_(torch_src)
                return
            with torch.cuda.stream(side):
                dst_dev[:n].copy_(torch_src, non_blocking=True)

        secs = []
        for _ in range(reps + 1):
            sync()
            t0 = time.perf_counter()
            torch_copy()
            sync()
            secs.append(time.perf_counter() - t0)
        one_copy = {"torch copy_": gib_s(n, median(secs[1:])), "batch": gib_s(n, median(run(runtimes["batch"], one)))}
        if kernel_rt.range_kernel is not None and kernel_rt.kernel_min_copies <= 1:
            one_copy["kernel"] = gib_s(n, median(run(kernel_rt, one)))
        results["peak"][direction] = {"one_copy_gib_s": one_copy, "peak_gib_s": max(one_copy.values())}
    prog.step("peaks: " + ", ".join(f"{d} {p['peak_gib_s']:.1f} GiB/s" for d, p in results["peak"].items()))

    # -- cases --------------------------------------------------------------------------------
    for direction, size, count in cases:
        count = count or max(1, int(cfg.total_bytes) // size)
        nbytes = size * count
        offsets = np.arange(count, dtype=np.int64) * size
        src_base = int(src_dev.data_ptr()) if direction == "d2d" else host.ptr
        batch = CopyBatch.of(int(dst_dev.data_ptr()) + offsets, src_base + offsets[::-1].copy(), np.full(count, size), Direction(direction))
        peak = results["peak"][direction]["peak_gib_s"]
        row = {"direction": direction, "copy_bytes": size, "copies": count, "bytes": nbytes, "peak_gib_s": peak}
        for engine in ("batch", "loop", "kernel"):
            rt = runtimes[engine]
            dst_dev[:nbytes].zero_()
            secs = run(rt, batch)
            rate = gib_s(nbytes, median(secs))
            row[engine] = {"seconds_median": median(secs), "seconds_all": secs, "gib_s": rate, "fraction_of_peak": rate / peak}
        row["kernel_ok"] = _check(dst_dev, src_dev, host_np, direction, size, count, cuda)
        row["kernel_vs_batch"] = row["batch"]["seconds_median"] / row["kernel"]["seconds_median"]
        results["rows"].append(row)
        write_json(out_dir / "results.json", results)
        prog.step(f"{direction} {count} x {size / 1024:.0f} KiB: batch {row['batch']['fraction_of_peak'] * 100:.1f}%, "
                  f"loop {row['loop']['fraction_of_peak'] * 100:.1f}%, kernel {row['kernel']['fraction_of_peak'] * 100:.1f}% "
                  f"of peak ({row['kernel_vs_batch']:.2f}x batch), bytes {'ok' if row['kernel_ok'] else 'WRONG'}")
    if cuda:
        results["sweep"] = _sweep(cfg, run, dst_dev, src_dev, results, prog)
        results["hybrid"] = _hybrid(cfg, runtimes, dst_dev, host, ranges, results, prog, sync, reps)
    for rt in runtimes.values():
        rt.unregister([host])
        rt.close()
    write_json(out_dir / "results.json", results)
    (out_dir / "results.md").write_text(_table(results))
    _plot(results, out_dir / "copy_kernel.png")
    print(_table(results))
    return results


def _sweep(cfg, run, dst_dev, src_dev, results: dict, prog) -> list[dict]:
    """Each kernel shape of ``cfg.sweep`` on the d2d ``sweep_cases``: GiB/s and % of the d2d peak."""
    import numpy as np

    from cacheseek.transfer.batch import CopyBatch, Direction
    from cacheseek.transfer.copy_kernel import CudaRangeKernel, KernelShape
    from cacheseek.transfer.cuda_transfer import CudaTransferRuntime
    from cacheseek.transfer.cuda_bindings import import_cudart

    peak = results["peak"]["d2d"]["peak_gib_s"]
    out = []
    for threads, per_sm, unroll, hint in cfg.sweep:
        shape = KernelShape(int(threads), int(per_sm), int(unroll), str(hint))
        rt = CudaTransferRuntime(copy_kernel=True, kernel_min_copies=1,
                                 range_kernel=CudaRangeKernel(import_cudart(), 0, shape))
        row = {"shape": [shape.threads, shape.blocks_per_sm, shape.unroll, shape.hint], "cases": []}
        for _, size, count in cfg.sweep_cases:
            size, count = int(size), int(count)
            off = np.arange(count, dtype=np.int64) * size
            batch = CopyBatch.of(int(dst_dev.data_ptr()) + off, int(src_dev.data_ptr()) + off, np.full(count, size), Direction.D2D)
            secs = run(rt, batch)
            rate = gib_s(size * count, median(secs))
            row["cases"].append({"copies": count, "copy_bytes": size, "gib_s": rate, "fraction_of_peak": rate / peak})
        rt.close()
        out.append(row)
        prog.step(f"kernel {shape}: " + ", ".join(f"{c['copies']}x{c['copy_bytes'] >> 10} KiB {c['fraction_of_peak'] * 100:.1f}%" for c in row["cases"]))
    return out


def _hybrid(cfg, runtimes, dst_dev, host, ranges, results: dict, prog, sync, reps: int) -> list[dict]:
    """H2D batches split: the first copies to the copy engines on one stream, the rest to the
    kernel on another, submitted together; timed to both done."""
    import numpy as np

    from cacheseek.transfer.batch import CopyBatch, Direction

    peak = results["peak"]["h2d"]["peak_gib_s"]
    ce, kr = runtimes["batch"], runtimes["kernel"]
    s1, s2 = ce.new_stream(), kr.new_stream()
    out = []
    for _, size, count in cfg.hybrid_cases:
        size, count = int(size), int(count)
        off = np.arange(count, dtype=np.int64) * size
        dsts, srcs = int(dst_dev.data_ptr()) + off, host.ptr + off
        for frac in cfg.hybrid_fractions:
            k = int(round(count * float(frac)))
            secs = []
            for _ in range(reps + 1):
                sync()
                t0 = time.perf_counter()
                pend = []
                if k < count:
                    pend.append(ce.submit_batch(CopyBatch.of(dsts[k:], srcs[k:], np.full(count - k, size), Direction.H2D), stream=s1, device_ranges=ranges))
                if k:
                    pend.append(kr.submit_batch(CopyBatch.of(dsts[:k], srcs[:k], np.full(k, size), Direction.H2D), stream=s2, device_ranges=ranges))
                for p in pend:
                    p.wait()
                secs.append(time.perf_counter() - t0)
            rate = gib_s(size * count, median(secs[1:]))
            out.append({"copies": count, "copy_bytes": size, "kernel_fraction": float(frac), "gib_s": rate, "fraction_of_peak": rate / peak})
        prog.step(f"hybrid h2d {count}x{size >> 10} KiB: " + ", ".join(f"kernel {r['kernel_fraction']:.2f} -> {r['fraction_of_peak'] * 100:.1f}%" for r in out[-len(cfg.hybrid_fractions):]))
    ce.destroy_stream(s1)
    kr.destroy_stream(s2)
    return out


def _runtimes(cuda: bool):
    """The three engines: ``batch``, ``loop``, ``kernel`` (forced for every batch)."""
    import torch

    from cacheseek.transfer.cuda_transfer import CudaTransferRuntime

    if cuda:
        def make(**kw):
            return CudaTransferRuntime(**kw)

        def sync() -> None:
            torch.cuda.synchronize()

        dev = torch.device("cuda", 0)
    else:
        sys.path.insert(0, str(HERE.parents[1] / "tests"))  # the CPU dry run uses the tests' fakes
        from fakes.cudart import FakeCudart
        from fakes.range_kernel import FakeRangeKernel

        fake = FakeCudart()
        fake.unknown_is_device = True

        def make(**kw):
            if kw.get("copy_kernel"):
                kw["range_kernel"] = FakeRangeKernel(fake)
            return CudaTransferRuntime(cudart=fake, current_stream=lambda: 7, tensor_device_type="cpu", **kw)

        def sync() -> None:
            fake.cudaDeviceSynchronize()

        dev = torch.device("cpu")
    return ({"batch": make(copy_kernel=False), "loop": make(copy_kernel=False, use_batch_api=False),
             "kernel": make(copy_kernel=True, kernel_min_copies=1, kernel_h2d_max_mean_bytes=1 << 62)}, sync, dev)


def _check(dst_dev, src_dev, host_np, direction: str, size: int, count: int, cuda: bool) -> bool:
    """Copy ``i`` read source block ``count - 1 - i``: compare a sample of blocks (first, middle, last)."""
    import numpy as np
    import torch

    ok = True
    for i in sorted({0, count // 2, count - 1}):
        j = count - 1 - i
        got = dst_dev[i * size : (i + 1) * size]
        want = src_dev[j * size : (j + 1) * size] if direction == "d2d" else torch.from_numpy(np.ascontiguousarray(host_np[j * size : (j + 1) * size])).to(got.device)
        ok &= bool(torch.equal(got, want))
    return ok


def _table(results: dict) -> str:
    env = results["env"]
    lines = [
        f"# Copy engines against the range-copy kernel ({env.get('gpu', 'no GPU')}, {env['time']})", "",
        f"- command: `{results['command'].strip()}`",
        f"- versions: Python {env['python']}, torch {env.get('torch')}, cuda-bindings {env.get('cuda_bindings')}, "
        f"driver {env.get('cuda_driver')}; kernel: {results['kernel']}",
        "- peaks (one copy, same run): " + ", ".join(
            f"{d} {p['peak_gib_s']:.1f} GiB/s ({', '.join(f'{k} {v:.1f}' for k, v in p['one_copy_gib_s'].items())})"
            for d, p in results["peak"].items()), "",
        "| direction | copies x size | batch GiB/s (% peak) | loop GiB/s (% peak) | kernel GiB/s (% peak) | kernel vs batch | bytes ok |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results.get("rows", []):
        cells = [f"{r[e]['gib_s']:.1f} ({r[e]['fraction_of_peak'] * 100:.1f}%)" for e in ("batch", "loop", "kernel")]
        lines.append(f"| {r['direction']} | {r['copies']} x {r['copy_bytes'] / 1024:.0f} KiB | " + " | ".join(cells)
                     + f" | {r['kernel_vs_batch']:.2f}x | {r['kernel_ok']} |")
    if results.get("sweep"):
        lines += ["", "Kernel shapes (threads, blocks per SM, unroll, hint), % of the d2d peak:", "",
                  "| shape | " + " | ".join(f"{c['copies']} x {c['copy_bytes'] >> 10} KiB" for c in results["sweep"][0]["cases"]) + " |",
                  "|---|" + "---|" * len(results["sweep"][0]["cases"])]
        for r in results["sweep"]:
            lines.append(f"| {r['shape']} | " + " | ".join(f"{c['fraction_of_peak'] * 100:.1f}%" for c in r["cases"]) + " |")
    if results.get("hybrid"):
        lines += ["", "H2D split between copy engines and kernel (two streams at once), % of the h2d peak:", "",
                  "| copies x size | kernel share of copies | GiB/s | % of peak |", "|---|---|---|---|"]
        for r in results["hybrid"]:
            lines.append(f"| {r['copies']} x {r['copy_bytes'] >> 10} KiB | {r['kernel_fraction']:.2f} | {r['gib_s']:.1f} | {r['fraction_of_peak'] * 100:.1f}% |")
    return "\n".join(lines) + "\n"


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, direction in zip(axes, ("d2d", "h2d")):
        rows = [r for r in results["rows"] if r["direction"] == direction]
        if not rows:
            ax.set_visible(False)
            continue
        labels = [f"{r['copies']}x\n{r['copy_bytes'] / 1024:.0f} KiB" for r in rows]
        x = range(len(rows))
        for k, engine in enumerate(("batch", "loop", "kernel")):
            ax.bar([i + (k - 1) * 0.27 for i in x], [r[engine]["fraction_of_peak"] * 100 for r in rows], 0.27, label=engine)
        ax.axhline(100, color="k", lw=0.8)
        ax.set_xticks(list(x), labels, fontsize=8)
        ax.set_ylabel("% of the same-run one-copy peak")
        ax.set_title(f"{direction.upper()} (peak {results['peak'][direction]['peak_gib_s']:.0f} GiB/s)")
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main(sys.argv[1:])
