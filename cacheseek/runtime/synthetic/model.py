"""The seeded stand-in for the DiT: one forward pass over one chunk, reading and writing the ring.

Per forward pass over one chunk (`T = chunk_tokens` tokens of `F = C * patch**2` features,
patchified from the latent):

    h = tanh(tokens @ W_in + time(t) + action(chunk) + cond(prompt, image))
    for each layer l:
        k, v, q = per-token outer products of two projections of h, shaped [T, H, D];
                  k and q are rotated by the absolute frame index of each token (rotary phase)
        ring_write(layer l, k, v)                      # first call of the chunk advances
        o   = attention of the mean query over the ring [:local_end]     # [H, D]
        w   = phase of an exact, position-weighted checksum of the ring's previous frames
              [:local_end - T] (computed once per chunk and layer)
        h   = tanh(h + proj(o) + proj(sin(w)) [+ folded GEMM term, see below])
    x0_pred = tanh(h @ W_out + tokens / 2)

The attention makes KV and latents depend numerically on the attended window; the checksum (int64,
exact, order-independent) makes any single changed or misplaced byte of the window change the next
chunk's KV and latent by O(1), which bf16 rounding cannot hide. Each layer's K/V depend on the
earlier layers' windows through h, and the last layer's window feeds x0.

The optional compute term (for GPU benchmarks) adds real matmuls: in every forward pass and every
layer, `gemms_per_layer_step` chained `[chunk_tokens, gemm_dim] @ [gemm_dim, gemm_dim]` GEMMs in
the runtime dtype, folded into h. FLOPs per denoised chunk of this term:
`2 * chunk_tokens * gemm_dim**2 * gemms_per_layer_step * n_layers * (num_steps + 1)` (the `+ 1` is
the clean rewrite pass). E.g. lingbot_480p, gemm_dim 4096, 1 GEMM, 4 steps: 31.4 TFLOP per chunk.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from cacheseek.runtime.geometry import Geometry
from cacheseek.runtime.synthetic.control import MAX_ACTION_DIM
from cacheseek.runtime.synthetic.hashing import M64, lp, splitmix64, unit_floats
from cacheseek.runtime.synthetic.ring import ring_write
from cacheseek.runtime.synthetic.weights import make_weights, weights_fingerprint

__all__ = ["SyntheticModel", "outer", "rope"]

_CHECKSUM_BLOCK_TOKENS = 2048


class SyntheticModel:
    """The model of one session on its device: weights (`make_weights`), the prompt and image
    conditioning `[F]`, the action embeddings `[total_chunks, F]`, rotary frequencies `[D/2]`
    and the checksum's slot `[kv_size]` and dim `[2D]` weights. ``fingerprint`` is
    `weights_fingerprint`. ``gemm``: the checked compute settings or None."""

    def __init__(self, geometry: Geometry, *, actions: Sequence[Sequence[float]], prompt: str, image: Any,
                 kv_size: int, device: Any, dtype: torch.dtype, gemm: dict | None) -> None:
        self.geometry = g = geometry
        self.device, self.dtype, self.gemm = device, dtype, gemm
        weights = make_weights(g, gemm)
        self.fingerprint = weights_fingerprint(weights, gemm)
        self.w = {name: w.to(device) for name, w in weights.items()}
        if "compute.w" in self.w:
            self.w["compute.w"] = self.w["compute.w"].to(dtype)

        feats = g.latent_channels * g.patch * g.patch
        parts = (prompt.encode(), str(image.mode).encode(), repr(tuple(image.size)).encode())
        cond = unit_floats(lp(b"synthetic-cond", *parts, image.tobytes()), feats)
        self.cond = 0.5 * torch.tensor(cond, dtype=torch.float32, device=device)
        padded = torch.zeros((len(actions), MAX_ACTION_DIM), dtype=torch.float32)
        for i, a in enumerate(actions):
            padded[i, : len(a)] = torch.tensor(a, dtype=torch.float32)
        self.action_emb = torch.tanh(padded.to(device) @ self.w["embed.action"])
        half = torch.arange(0, g.head_dim, 2, dtype=torch.float32, device=device)
        self.inv_freq = 1.0 / (10000.0 ** (half / g.head_dim))
        slots = torch.arange(kv_size, dtype=torch.int64, device=device)
        self.slot_weights = 1 + (slots * 2654435761) % 4093
        dims = torch.arange(2 * g.head_dim, dtype=torch.int64, device=device)
        self.dim_weights = 1 + (dims * 40503) % 251

    def forward(self, x: torch.Tensor, chunk: int, sigma: float, window: dict, caches: Sequence[dict], *,
                sink_tokens: int) -> torch.Tensor:
        """One pass over chunk `chunk` at noise level `sigma`: writes every layer's K/V into
        `caches` (the rings, see `ring_write`), returns x0_pred (float32, latent_shape).
        `window` caches the per-layer window phase of the chunk."""
        g, w = self.geometry, self.w
        tokens = self.patchify(x.float())
        temb = torch.sin(sigma * w["embed.time_freq"] + w["embed.time_phase"])
        h = torch.tanh(tokens @ w["embed.in"] + temb + self.action_emb[chunk] + self.cond)
        cos, sin = self.rotary(chunk)
        start = chunk * g.chunk_tokens
        for layer, cache in enumerate(caches):
            p = f"L{layer}."
            k = rope(outer(h, w[p + "kh"], w[p + "kd"], w[p + "kb"]), cos, sin)
            v = outer(h, w[p + "vh"], w[p + "vd"], w[p + "vb"])
            q = rope(outer(h, w[p + "qh"], w[p + "qd"], None), cos, sin)
            k, v = k[None].to(self.dtype), v[None].to(self.dtype)
            ring_write(cache, k, v, start_token=start, sink_tokens=sink_tokens)
            end = cache["local_end_index"]
            if layer not in window:
                window[layer] = self._window_term(layer, cache, end - g.chunk_tokens)
            o = self._attend(cache, end, q.mean(dim=0))
            o_term = torch.einsum("hd,hf,df->f", o, w[p + "oh"], w[p + "od"])
            h = torch.tanh(h + o_term + window[layer] + self._gemm_term(h))
        out = torch.tanh(h @ w["head.out"] + 0.5 * tokens)
        return self.unpatchify(out)

    def decode(self, latent: torch.Tensor) -> torch.Tensor:
        """Frames of one chunk: `[chunk_size, 3, latent_h, latent_w]` float32, a fixed channel
        projection of the latent (cheap, deterministic, changes with any latent element)."""
        return torch.einsum("cthw,cr->trhw", latent[0].float(), self.w["decode.proj"]).contiguous()

    def _attend(self, cache: dict, end: int, qbar: torch.Tensor) -> torch.Tensor:
        """Softmax attention of one query per head (`[H, D]`) over ring `[:end]`; -> `[H, D]`."""
        keys = cache["k"][0, :end].transpose(0, 1)
        values = cache["v"][0, :end].transpose(0, 1)
        scores = torch.bmm(keys, qbar.to(self.dtype)[:, :, None])[:, :, 0].float()
        scores = scores / math.sqrt(self.geometry.head_dim)
        probs = (scores - scores.amax(dim=-1, keepdim=True)).exp()
        probs = probs / probs.sum(dim=-1, keepdim=True)
        return torch.bmm(probs.to(self.dtype)[:, None, :], values)[:, 0].float()

    def _window_term(self, layer: int, cache: dict, m: int) -> torch.Tensor:
        """`[F]` term from an exact checksum of ring `[:m]` (the previous frames in the window).

        Per head, K and V bytes are read as int16 and summed with weights that depend on the slot
        and the position in the head, in int64 (exact, no overflow, order-independent), then mixed
        into a phase in [0, 2pi): one changed or misplaced element gives an unrelated phase.
        """
        g = self.geometry
        sums = []
        for name in ("k", "v"):
            raw = cache[name][0, :m].view(torch.int16)
            acc = torch.zeros(raw.shape[1:], dtype=torch.int64, device=self.device)
            for s in range(0, m, _CHECKSUM_BLOCK_TOKENS):
                blk = raw[s : s + _CHECKSUM_BLOCK_TOKENS].to(torch.int64)
                acc += (blk * self.slot_weights[s : s + blk.shape[0], None, None]).sum(dim=0)
            dim_w = self.dim_weights[: raw.shape[-1]]
            sums.append((acc * dim_w).sum(dim=-1).tolist())
        phases = []
        for head, (ck, cv) in enumerate(zip(*sums)):
            z = splitmix64(ck & M64)
            z = splitmix64(z ^ (cv & M64) ^ ((layer * g.n_heads + head) << 40))
            phases.append(z / 2.0**64 * 2.0 * math.pi)
        phase = torch.tensor(phases, dtype=torch.float32, device=self.device)
        return 0.5 * torch.sin(phase @ self.w[f"L{layer}.mix"])

    def _gemm_term(self, h: torch.Tensor) -> torch.Tensor | float:
        """The optional real compute: chained `[T, G] @ [G, G]` GEMMs, folded into h as `[T, 1]`."""
        if self.gemm is None:
            return 0.0
        y = (h @ self.w["compute.expand"]).to(self.dtype)
        for _ in range(self.gemm["gemms_per_layer_step"]):
            y = torch.tanh(y @ self.w["compute.w"])
        return 0.01 * y.float().mean(dim=1, keepdim=True)

    # -- token layout -------------------------------------------------------------------------

    def patchify(self, x: torch.Tensor) -> torch.Tensor:
        """`[1, C, c, Hl, Wl]` -> `[c * (Hl/p) * (Wl/p), C * p * p]`, frame-major token order."""
        g, p = self.geometry, self.geometry.patch
        t = x[0].reshape(g.latent_channels, g.chunk_size, g.latent_h // p, p, g.latent_w // p, p)
        return t.permute(1, 2, 4, 0, 3, 5).reshape(g.chunk_tokens, -1)

    def unpatchify(self, tokens: torch.Tensor) -> torch.Tensor:
        """The inverse of `patchify`: `[T, F]` -> `latent_shape`."""
        g, p = self.geometry, self.geometry.patch
        t = tokens.reshape(g.chunk_size, g.latent_h // p, g.latent_w // p, g.latent_channels, p, p)
        return t.permute(3, 0, 1, 4, 2, 5).reshape(g.latent_shape)

    def rotary(self, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin `[T, 1, D/2]` of each token's absolute frame index."""
        g = self.geometry
        tokens = torch.arange(g.chunk_tokens, device=self.device)
        frames = chunk * g.chunk_size + tokens // g.frame_tokens
        angle = frames.float()[:, None] * self.inv_freq[None, :]
        return torch.cos(angle)[:, None, :], torch.sin(angle)[:, None, :]


def outer(h: torch.Tensor, wh: torch.Tensor, wd: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`[T, F]` -> `[T, H, D]`: tanh of the per-token outer product of two projections of h."""
    t = (h @ wh)[:, :, None] * (h @ wd)[:, None, :]
    return torch.tanh(t if bias is None else t + bias)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs `(x[..., 2j], x[..., 2j+1])` of `[T, H, D]` by the per-token angles."""
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
