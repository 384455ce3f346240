"""KV codecs in one run (issue 36), each against ``none`` measured in the same run:

- ``ratios``: compression ratio of every codec on one chunk's KV from each source (the synthetic
  runtime at ``geometry``; TeleFuser's real architecture with tiny random weights; ``torch.randn``),
  and the KV PSNR of the lossy codecs. Random weights give KV whose statistics differ from a trained
  model's (a trained model's exponents are usually more concentrated): the ratios are indicative;
- ``speed``: encode and decode GiB/s (of decoded bytes) on ``device`` over one chunk at
  ``geometry``, this repo's codecs and nvCOMP's (``nvcomp``, where its wheel imports);
- ``restore``: the wall of restoring one chunk per tier (``tiers``) with each codec against ``none``,
  every restored ring checked: bit-exact for none and lossless, PSNR for int8/int4.

Writes results.json (after every section), results.md and codecs.png to ``out_dir``; prints a
progress line per step and the ratios. ``device=cpu geometry=tiny`` is the CI smoke run.

    python experiments/codecs/bench_codecs.py [key=value ...]   # conf/codecs.yaml
"""

from __future__ import annotations

import math
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import benchlib  # noqa: E402
from benchlib import GiB, Progress, compose, env_info, git_state, gib_s, median, write_json  # noqa: E402

import torch  # noqa: E402

from cacheseek.codecs.base import get_codec  # noqa: E402
from cacheseek.codecs.quality import psnr_db_of  # noqa: E402


# -- KV sources -----------------------------------------------------------------------------------
def _stack_kv(overrides: list[str]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One chunk's (K, V) per layer, from a runtime's ring after its first chunk."""
    import cacheseek.schema  # noqa: F401  (the root schema)
    from cacheseek.cli_help import CONF_DIR
    from cacheseek.orchestrator import build_stack
    from cacheseek.registry import import_backends

    import_backends()
    cfg = compose(Path(CONF_DIR), "config", overrides)
    stack = build_stack(cfg, run_dir=Path("/tmp/cs-codecs-run"))
    try:
        rt = stack.runtime_factory.make([[0.1, -0.2, 0.3, 0.0]] * 2, hooks=None)
        rt.generate(stop_after=1)
        tokens = stack.runtime_factory.geometry.chunk_tokens
        return [(k[:, :tokens].clone(), v[:, :tokens].clone()) for k, v in stack.layout.layers(rt)]
    finally:
        stack.close()


def kv_source(name: str, geometry: str, device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if name == "synthetic":
        return _stack_kv([f"runtime.geometry={geometry}", f"runtime.device={device}", "workload.total_chunks=2",
                          "workload.prefix_chunks=1"])
    if name == "telefuser_tiny":
        return [(k.to(device), v.to(device)) for k, v in _stack_kv(["runtime=telefuser", "workload.total_chunks=2",
                                                                     "workload.prefix_chunks=1"])]
    if name == "randn":
        from cacheseek.runtime.geometry import get_geometry

        g = get_geometry(geometry)
        gen = torch.Generator(device=device).manual_seed(0)
        shape = (1, g.chunk_tokens, g.n_heads, g.head_dim)
        return [tuple(torch.randn(shape, generator=gen, device=device).to(torch.bfloat16) for _ in range(2))
                for _ in range(g.n_layers)]
    raise ValueError(f"unknown source {name!r}")


def nbytes(kv) -> int:
    return sum(t.numel() * t.element_size() for pair in kv for t in pair)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def sync(device: str) -> Callable[[], None]:
    return torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)


def timed(fn: Callable[[], Any], reps: int, device: str) -> list[float]:
    return benchlib.timed(fn, reps, sync=sync(device))


# -- sections -------------------------------------------------------------------------------------
def section_ratios(cfg, kv_main, progress) -> dict:
    out = {}
    for source in cfg.sources:
        try:
            kv = kv_main if source == "synthetic" else kv_source(source, cfg.geometry, cfg.device)
        except Exception as exc:  # noqa: BLE001 - a source that cannot run here (no telefuser): said so
            out[source] = {"error": f"{type(exc).__name__}: {exc}"}
            progress.step(f"ratios {source}: skipped ({exc})")
            continue
        row: dict[str, Any] = {"raw_bytes": nbytes(kv), "shape": list(kv[0][0].shape), "dtype": str(kv[0][0].dtype)}
        for name in cfg.codecs:
            codec = get_codec(name)
            enc = [(codec.encode(k, "k"), codec.encode(v, "v")) for k, v in kv]
            row[name] = {"ratio": nbytes(kv) / nbytes(enc)}
            if codec.lossy:
                got = (codec.decode(r, e) for pair in enc for r, e in zip("kv", pair))
                row[name]["kv_psnr_db"] = psnr_db_of(got, (t for pair in kv for t in pair))
            del enc
        if nbytes(kv) <= 1 << 30:  # one value, no per-value header (a 480p chunk's values need none: 0.001%)
            pooled = torch.cat([t.reshape(-1) for pair in kv for t in pair])
            row["lossless_pooled_ratio"] = pooled.numel() * 2 / get_codec("lossless").encode(pooled, "k").numel()
            del pooled
        else:
            row["lossless_pooled_ratio"] = row["lossless"]["ratio"]
        p = sum(torch.bincount(((t.reshape(-1).view(torch.int16) >> 7) & 0xFF).to(torch.int32), minlength=256)
                for pair in kv for t in pair).double()
        p = p[p > 0] / p.sum()
        row["exponent_entropy_bits"] = float(-(p * p.log2()).sum())
        row["exponent_coding_bound_ratio"] = 16 / (8 + row["exponent_entropy_bits"])  # sign+mantissa raw
        out[source] = row
        progress.step(f"ratios {source}: " + ", ".join(f"{n} {row[n]['ratio']:.3f}x" for n in cfg.codecs)
                      + f"; lossless pooled {row['lossless_pooled_ratio']:.3f}x (exponent entropy "
                      f"{row['exponent_entropy_bits']:.2f} bits: an ideal exponent coder's "
                      f"{row['exponent_coding_bound_ratio']:.3f}x)")
        del kv
    return out


def section_speed(cfg, kv, progress) -> dict:
    raw = nbytes(kv)
    out = {}
    for name in cfg.codecs:
        codec = get_codec(name)
        enc = [(codec.encode(k, "k"), codec.encode(v, "v")) for k, v in kv]
        te = timed(lambda: [(codec.encode(k, "k"), codec.encode(v, "v")) for k, v in kv], cfg.reps, cfg.device)
        td = timed(lambda: [(codec.decode("k", a), codec.decode("v", b)) for a, b in enc], cfg.reps, cfg.device)
        exact = all(same_bits(codec.decode("k", a), k) and same_bits(codec.decode("v", b), v)
                    for (a, b), (k, v) in zip(enc, kv)) if not codec.lossy else None
        out[name] = {"ratio": raw / nbytes(enc), "encode_gib_s": gib_s(raw, median(te)),
                     "decode_gib_s": gib_s(raw, median(td)), "bit_exact": exact}
        progress.step(f"speed {name}: {out[name]['ratio']:.3f}x, encode {out[name]['encode_gib_s']:.1f} GiB/s, "
                      f"decode {out[name]['decode_gib_s']:.1f} GiB/s" + (f", bit-exact {exact}" if exact is not None else ""))
        del enc
    if cfg.device.startswith("cuda"):
        out["nvcomp"] = nvcomp_speed(cfg, kv, progress)
    return out


def nvcomp_speed(cfg, kv, progress) -> dict:
    try:
        from nvidia import nvcomp
    except Exception as exc:  # noqa: BLE001
        progress.step(f"nvcomp: not importable ({exc})")
        return {"error": f"{type(exc).__name__}: {exc}"}
    raw = nbytes(kv)
    flat = [t.reshape(-1).view(torch.uint8) for pair in kv for t in pair]
    out: dict[str, Any] = {"version": getattr(nvcomp, "__version__", "?")}
    for algo in cfg.nvcomp:
        try:
            codec = nvcomp.Codec(algorithm=algo)
            arrays = [nvcomp.as_array(t) for t in flat]
            enc = [codec.encode(a) for a in arrays]  # one call per value, as a tier would
            sizes = [_nv_size(e) for e in enc]
            te = timed(lambda: [codec.encode(a) for a in arrays], cfg.reps, cfg.device)
            td = timed(lambda: [codec.decode(e) for e in enc], cfg.reps, cfg.device)
            exact = all(torch.equal(_nv_tensor(codec.decode(e)).reshape(-1).view(torch.uint8), t)
                        for e, t in zip(enc, flat))
            out[algo] = {"ratio": raw / sum(sizes), "encode_gib_s": gib_s(raw, median(te)),
                         "decode_gib_s": gib_s(raw, median(td)), "bit_exact": exact}
            progress.step(f"nvcomp {algo}: {out[algo]['ratio']:.3f}x, encode {out[algo]['encode_gib_s']:.1f} GiB/s, "
                          f"decode {out[algo]['decode_gib_s']:.1f} GiB/s, bit-exact {exact}")
        except Exception as exc:  # noqa: BLE001 - one algorithm failing leaves the others
            out[algo] = {"error": f"{type(exc).__name__}: {exc}"}
            progress.step(f"nvcomp {algo}: failed ({exc})")
    return out


def _nv_size(a: Any) -> int:
    """Bytes of an nvCOMP array: its elements times their size (``buffer_size`` is its capacity)."""
    item = int(getattr(a, "item_size", getattr(a, "itemsize", 1)))
    for attr in ("nbytes", "size"):
        v = getattr(a, attr, None)
        if isinstance(v, int):
            return v if attr == "nbytes" else v * item
    return int(math.prod(a.shape)) * item


def _nv_tensor(a: Any) -> torch.Tensor:
    try:
        return torch.from_dlpack(a)
    except Exception:  # noqa: BLE001 - an nvcomp build whose Array has only to_dlpack()
        return torch.utils.dlpack.from_dlpack(a.to_dlpack())


def _store(tier: str, codec: str, cfg) -> Any:
    from cacheseek.stores.localdisk import LocalDiskTierStore
    from cacheseek.stores.memory import InMemoryTierStore

    if tier == "memory":
        return InMemoryTierStore(capacity_bytes=None, codec=codec, codec_device=cfg.device)
    root = Path(cfg.root) / codec
    shutil.rmtree(root, ignore_errors=True)
    root.parent.mkdir(parents=True, exist_ok=True)  # a store makes its root, never the folders above it
    return LocalDiskTierStore(root, codec=codec, codec_device=cfg.device, fsync=False, capacity_bytes=None)


def _drop_cache(store) -> None:
    """Drop every value file of ``store``'s root from the page cache (written back first)."""
    for path in store.root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _check(codec_name: str, ring, kv) -> dict:
    if get_codec(codec_name).lossy:
        return {"bit_exact": False, "kv_psnr_db": psnr_db_of((t for p in ring for t in p), (t for p in kv for t in p))}
    return {"bit_exact": all(same_bits(a, k) and same_bits(b, v) for (a, b), (k, v) in zip(ring, kv))}


def restore_store_tier(cfg, tier: str, codec: str, kv, ring, progress) -> dict:
    """Restore one chunk from a generic tier: the tier's get_layers, then each value copied into
    the ring (on ``device``), as the generic restore path seeds it."""
    from cacheseek.kv.handles import Tier

    store = _store("memory" if tier == "memory" else "localdisk", codec, cfg)
    try:
        cpu = [(k.cpu(), v.cpu()) for k, v in kv]
        h = store.put_async("c0:kv", cpu, tier=Tier.CPU)
        stored = store.usage().used_bytes
        del cpu

        walls = []
        for _ in range(cfg.reps):  # the cold tier drops the cache outside the timing
            if tier == "localdisk_cold":
                _drop_cache(store)
            walls += timed(lambda: _restore_only(store, h, ring), 1, cfg.device)
        return {"wall_s": median(walls), "walls_s": walls, "stored_bytes": stored, **_check(codec, ring, kv)}
    finally:
        store.close()
        if tier != "memory":
            shutil.rmtree(Path(cfg.root) / codec, ignore_errors=True)


def _restore_only(store, h, ring) -> None:
    got = store.get_layers([(h, i) for i in range(len(ring))])
    for (dk, dv), (k, v) in zip(ring, got):
        dk.copy_(k)
        dv.copy_(v)


def restore_model_tier(cfg, tier: str, codec_name: str, kv, ring) -> dict:
    """The Plan tier's path (pinned host -> device) or the HBM tier's (device -> device) modelled
    per value: raw bytes copied, or the encoded bytes copied and decoded on the device."""
    codec = get_codec(codec_name)
    dev = torch.device(cfg.device)
    pin = dev.type == "cuda" and tier == "plan_model"

    def place(t: torch.Tensor) -> torch.Tensor:
        if tier == "hbm_model":
            return t.to(dev)
        c = t.cpu()
        return c.pin_memory() if pin else c

    if codec.identity:
        src = [(place(k), place(v)) for k, v in kv]
        stored = nbytes(src)

        def restore() -> None:
            for (dk, dv), (k, v) in zip(ring, src):
                dk.copy_(k, non_blocking=True)
                dv.copy_(v, non_blocking=True)
    else:
        src = [(place(codec.encode(k, "k")), place(codec.encode(v, "v"))) for k, v in kv]
        stored = nbytes(src)

        def restore() -> None:
            for (dk, dv), (k, v) in zip(ring, src):
                dk.copy_(codec.decode("k", k.to(dev, non_blocking=True), dev))
                dv.copy_(codec.decode("v", v.to(dev, non_blocking=True), dev))

    walls = timed(restore, cfg.reps, cfg.device)
    return {"wall_s": median(walls), "walls_s": walls, "stored_bytes": stored, **_check(codec_name, ring, kv)}


def section_restore(cfg, kv, progress) -> dict:
    ring = [(torch.empty_like(k), torch.empty_like(v)) for k, v in kv]
    raw = nbytes(kv)
    out: dict[str, Any] = {"chunk_bytes": raw}
    for tier in cfg.tiers:
        row = {}
        for codec in ["none"] + list(cfg.codecs):
            if tier in ("plan_model", "hbm_model"):
                r = restore_model_tier(cfg, tier, codec, kv, ring)
            else:
                r = restore_store_tier(cfg, tier, codec, kv, ring, progress)
            r["gib_s"] = gib_s(raw, r["wall_s"])
            if codec != "none":
                r["speedup_vs_none"] = row["none"]["wall_s"] / r["wall_s"]
                r["ratio"] = row["none"]["stored_bytes"] / r["stored_bytes"]
            row[codec] = r
            extra = (f", {r['speedup_vs_none']:.2f}x none's speed at {r['ratio']:.3f}x" if codec != "none" else "")
            check = (f"PSNR {r['kv_psnr_db']:.1f} dB" if "kv_psnr_db" in r else f"bit-exact {r['bit_exact']}")
            progress.step(f"restore {tier} {codec}: {r['wall_s'] * 1e3:.1f} ms ({r['gib_s']:.2f} GiB/s){extra}, {check}")
        out[tier] = row
    return out


# -- output ---------------------------------------------------------------------------------------
def table(results: dict) -> str:
    lines = ["| tier | " + " | ".join(["none"] + [f"{c}" for c in results["config"]["codecs"]]) + " |",
             "|---" * (2 + len(results["config"]["codecs"])) + "|"]
    for tier, row in results.get("restore", {}).items():
        if tier == "chunk_bytes":
            continue
        cells = [f"{row['none']['wall_s'] * 1e3:.1f} ms"]
        for c in results["config"]["codecs"]:
            r = row[c]
            q = "exact" if r["bit_exact"] else f"{r.get('kv_psnr_db') or 0:.0f} dB"
            cells.append(f"{r['wall_s'] * 1e3:.1f} ms ({r['speedup_vs_none']:.2f}x, {r['ratio']:.2f}:1, {q})")
        lines.append(f"| {tier} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001
        return
    restore = {k: v for k, v in results.get("restore", {}).items() if k != "chunk_bytes"}
    if not restore:
        return
    codecs = ["none"] + list(results["config"]["codecs"])
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(codecs)
    for i, c in enumerate(codecs):
        ax.bar([j + i * width for j in range(len(restore))], [row[c]["wall_s"] * 1e3 for row in restore.values()],
               width, label=c + (" (lossy)" if get_codec(c).lossy else ""))
    ax.set_xticks([j + width * (len(codecs) - 1) / 2 for j in range(len(restore))], list(restore))
    ax.set_ylabel("restore wall of one chunk (ms)")
    ax.set_yscale("log")
    ax.set_title(f"KV codecs: one {results['config']['geometry']} chunk "
                 f"({results['restore']['chunk_bytes'] / GiB:.2f} GiB) on {results['env'].get('gpu', 'cpu')}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str]) -> dict:
    cfg = compose(HERE / "conf", "codecs", argv)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    from omegaconf import OmegaConf

    results: dict[str, Any] = {"config": OmegaConf.to_container(cfg), "env": {**env_info(), **git_state()},
                               "kv_note": "KV of random weights: its statistics differ from a trained model's"}
    nv = len(cfg.nvcomp) if str(cfg.device).startswith("cuda") else 0
    progress = Progress(len(cfg.sources) + len(cfg.codecs) + nv + len(cfg.tiers) * (1 + len(cfg.codecs)), "codecs")
    kv = kv_source("synthetic", cfg.geometry, cfg.device)
    progress.note(f"one {cfg.geometry} chunk: {len(kv)} layers x (K, V) of {list(kv[0][0].shape)} "
                  f"{kv[0][0].dtype}, {nbytes(kv) / GiB:.3f} GiB on {cfg.device}")
    for name, fn in (("ratios", section_ratios), ("speed", section_speed), ("restore", section_restore)):
        results[name] = fn(cfg, kv, progress)
        write_json(out / "results.json", results)
    results["targets"] = targets(results["restore"])
    write_json(out / "results.json", results)
    lines = [table(results), ""] + [f"- {k}: {v}" for k, v in results["targets"].items()]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    plot(results, out / "codecs.png")
    print("\n".join(lines))
    shutil.rmtree(cfg.root, ignore_errors=True)
    return results


def targets(restore: dict) -> dict:
    """Issue 36's targets, each True, False or None (the tier was not measured): lossless restore
    of a chunk from disk at most 1/1.2 of none's wall at a ratio >= 1.25; the Plan tier's path not
    slower with lossless on (else the codec stays off there)."""
    def met(tier: str, speedup: float, ratio: float = 0.0) -> Any:
        r = restore.get(tier, {}).get("lossless")
        return None if r is None else bool(r["speedup_vs_none"] >= speedup and r["ratio"] >= ratio)

    return {"lossless_localdisk_1.2x_at_ratio_1.25": met("localdisk", 1.2, 1.25),
            "lossless_localdisk_cold_1.2x_at_ratio_1.25": met("localdisk_cold", 1.2, 1.25),
            "lossless_plan_model_not_slower": met("plan_model", 1.0),
            "lossless_memory_not_slower": met("memory", 1.0)}


if __name__ == "__main__":
    main(sys.argv[1:])
