"""Quality of what a lossy codec restores: PSNR against a cold run, and which codec a store uses.

A lossy codec (int8, int4) restores KV that differs from what was computed, so the frames of the
chunks computed after a restore differ from a cold run's. The gate reports, instead of
bit-exactness, the PSNR of those frames against the cold run's (per chunk and over all) and the
first chunk whose frames differ. PSNR is ``10 log10(peak^2 / MSE)`` with ``peak`` the cold
frames' range (max - min); identical frames have no PSNR (``None``, reported as identical).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from typing import Any, Optional

import torch

from cacheseek.codecs.base import codec_fingerprint
from cacheseek.errors import ConfigError
from cacheseek.registry import CODECS

__all__ = ["psnr_db", "psnr_db_of", "frame_quality", "store_codec", "require_exact"]


def psnr_db(got: torch.Tensor, ref: torch.Tensor) -> Optional[float]:
    """PSNR of ``got`` against ``ref`` (same shape) in dB; None when they are equal."""
    return psnr_db_of([got], [ref])


def psnr_db_of(got: Iterable[torch.Tensor], ref: Iterable[torch.Tensor]) -> Optional[float]:
    """PSNR over pairs of tensors taken as one signal (a chunk's K and V values, on any device,
    without concatenating them); None when every pair is equal."""
    sse, n, lo, hi = 0.0, 0, math.inf, -math.inf
    for g, r in zip(got, ref, strict=True):
        r = r.detach()
        d = g.detach().to(r.device).double() - r.double()
        sse += float((d * d).sum())
        n += d.numel()
        if r.numel():
            lo, hi = min(lo, float(r.min())), max(hi, float(r.max()))
    if sse == 0.0 or n == 0:
        return None
    peak = max(hi - lo, 1e-30)
    return 10.0 * math.log10(peak * peak / (sse / n))


def frame_quality(got: Sequence[torch.Tensor], ref: Sequence[torch.Tensor]) -> dict[str, Any]:
    """Frames of one session against a cold run's, chunk by chunk: ``psnr_db`` over every chunk
    (None: identical), ``min_psnr_db`` of the worst chunk, ``per_chunk_psnr_db`` and
    ``first_differing_chunk`` (None when none differs)."""
    if len(got) != len(ref):
        raise ValueError(f"{len(got)} chunks of frames against {len(ref)}")
    per = [psnr_db(g, r) for g, r in zip(got, ref)]
    first = next((i for i, p in enumerate(per) if p is not None), None)
    whole = psnr_db(torch.cat([g.reshape(-1).float() for g in got]),
                    torch.cat([r.reshape(-1).float() for r in ref])) if got else None
    worst = min((p for p in per if p is not None), default=None)
    return {"psnr_db": whole, "min_psnr_db": worst, "per_chunk_psnr_db": per, "first_differing_chunk": first}


def store_codec(store: Any) -> dict[str, Any]:
    """What results say of a store's codec: ``fingerprint`` (the namespace field), ``names`` (every
    codec it uses: a tiered store's levels may differ) and ``lossy`` (the lossy ones)."""
    fp = str(codec_fingerprint(store))
    names = sorted(set(re.findall(r"([A-Za-z0-9_]+)/v\d+", fp)))
    lossy = [n for n in names if n in CODECS and CODECS.get(n).lossy]
    return {"fingerprint": fp, "names": names, "lossy": lossy}


def require_exact(store: Any, workload: str) -> None:
    """`ConfigError` naming ``store.codec`` when ``store`` uses a lossy codec: ``workload`` judges
    frames bit-exactly against cold runs, and only the abcd gate reports a lossy codec's quality."""
    lossy = store_codec(store)["lossy"]
    if lossy:
        raise ConfigError("store.codec", f"{','.join(lossy)} is lossy, and workload {workload} compares frames "
                          "bit-exactly with cold runs", "use store.codec=lossless or none here; the abcd gate "
                          "(workload=abcd) reports a lossy codec's quality")
