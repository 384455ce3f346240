"""A synthetic autoregressive world-model runtime: the correctness test bed for KV restore.

`SyntheticWorldRuntime` has the cache semantics of the TeleFuser LingBot-World runtime
(docs/design.md section 1) and the attributes `LingBotWorldKVBinding` reads and writes
(docs/api.md), with a small seeded "model" in place of the DiT. Its outputs depend on the KV ring
bit for bit, so a restore that is wrong by one byte, or lands in the wrong slot, changes every
later frame hash. One module per role:

- `session`: the image and session-config types the binding hashes;
- `ring`: `ring_write`, the shift-left ring with a pinned sink, and `RingCursorError`;
- `control`: `control_tensor`, one chunk's camera-control tensor;
- `weights`, `hashing`: the seeded weights, their fingerprint, exact byte helpers;
- `model`: `SyntheticModel`, one forward pass over a chunk (the model math is described there);
- `runtime`: `SyntheticWorldRuntime`, the session's sampling and chunk loop;
- `checks`: the argument checks shared by the runtime and the factory;
- here: `SyntheticRuntimeFactory`, registered as runtime ``synthetic`` (its signature is its
  Hydra schema; defined in the package itself, so the recorded ``_target_`` stays
  ``cacheseek.runtime.synthetic.SyntheticRuntimeFactory``).

The package imports torch only inside functions: `import cacheseek.runtime` works without torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cacheseek.errors import ConfigError
from cacheseek.kv import decoder_state, frames
from cacheseek.registry import RUNTIMES
from cacheseek.runtime.geometry import get_geometry, validate_window
from cacheseek.runtime.snapshot import snapshot_diff
from cacheseek.runtime.synthetic.checks import DTYPES, check_device, check_dtype, check_int, check_prompt
from cacheseek.runtime.synthetic.control import CONTROL_CHANNELS, MAX_ACTION_DIM, control_tensor
from cacheseek.runtime.synthetic.ring import RingCursorError, ring_write
from cacheseek.runtime.synthetic.runtime import SyntheticWorldRuntime
from cacheseek.runtime.synthetic.session import (CONTROL_MODE, MAX_SEQUENCE_LENGTH, SAMPLE_SHIFT, VAE_STRIDE,
                                                 SessionConfig, SyntheticImage, default_image)

__all__ = ["CONTROL_CHANNELS", "CONTROL_MODE", "DTYPES", "MAX_ACTION_DIM", "MAX_SEQUENCE_LENGTH", "SAMPLE_SHIFT",
           "VAE_STRIDE", "RingCursorError", "SessionConfig", "SyntheticImage", "SyntheticRuntimeFactory",
           "SyntheticWorldRuntime", "control_tensor", "default_image", "ring_write", "snapshot_diff"]


@RUNTIMES.register("synthetic")
class SyntheticRuntimeFactory:
    """Validated settings of a synthetic runtime; `make()` builds one session's runtime.
    ``compute_gemm_dim`` 0 means no extra compute; ``compute_gemms`` chained GEMMs per layer and
    forward pass (see `compute`). ``handout``: sessions hand out a restored chunk's stored frames
    and restore KV only where they compute (`HandOut`), as TeleFuser's release and hooked commit
    do (conf/runtime/synthetic.yaml turns it on); false, the constructor's default, keeps the
    eager creation-time restore that TeleFuser main runs and that the unit tests pin."""

    # Its sessions hold the ring as bshd tensors: naming it lets the orchestrator refuse another
    # layout (``layout=telefuser_main``) when the stack is built, not in the first session's hook.
    layout_name = "bshd"

    def __init__(self, *, geometry: str = "tiny", local_attn_size: int = -1, sink_size: int = 0, num_steps: int = 4,
                 device: str = "cpu", dtype: str = "bfloat16", seed: int = 1234,
                 prompt: str = "a red car driving along a coast road", compute_gemm_dim: int = 0,
                 compute_gemms: int = 1, handout: bool = False) -> None:
        self._geometry = get_geometry(geometry)
        validate_window(self._geometry, local_attn_size, sink_size)
        check_int("runtime.num_steps", num_steps, 1)
        check_int("runtime.seed", seed, 0)
        check_int("runtime.compute_gemm_dim", compute_gemm_dim, 0)
        check_int("runtime.compute_gemms", compute_gemms, 1)
        check_dtype(dtype)
        check_prompt(prompt)
        self._device = str(check_device(device, self._geometry))
        self._local_attn_size, self._sink_size, self._dtype = local_attn_size, sink_size, dtype
        self.num_steps, self.seed, self.prompt = num_steps, seed, prompt
        self.compute_gemm_dim, self.compute_gemms = compute_gemm_dim, compute_gemms
        if not isinstance(handout, bool):
            raise ConfigError("runtime.handout", f"must be true or false, got {handout!r}")
        self.handout = handout

    # the settings the orchestrator and workloads read
    geometry = property(lambda self: self._geometry)
    local_attn_size = property(lambda self: self._local_attn_size)
    sink_size = property(lambda self: self._sink_size)
    device = property(lambda self: self._device)
    dtype = property(lambda self: self._dtype)

    def beside_chunk_bytes(self, decoder_state_every: int) -> dict[str, int]:
        """What a store holds beside each chunk's KV (`sizing.need_for`) when sessions hand out
        frames: the chunk's frames (float32 ``[c, 3, h, w]``) and, with ``decoder_state_every >
        0``, the decoder's state (the last frame, ``[3, h, w]``); nothing without ``handout``."""
        if not self.handout:
            return {}
        g, float32 = self._geometry, frames.DTYPES[2]
        out = {"frames": frames.packed_nbytes(frames.FramesSpec((g.chunk_size, 3, g.latent_h, g.latent_w), float32))}
        if decoder_state_every > 0:
            spec = decoder_state.DecoderStateSpec([((3, g.latent_h, g.latent_w), float32)])
            out["decoder state"] = decoder_state.packed_nbytes(spec)
        return out

    def describe(self) -> dict[str, Any]:
        """What a report names: the runtime, its geometry and device."""
        return {"runtime": "synthetic", "geometry": self._geometry.name, "device": self._device}

    def make(self, actions: Sequence[Sequence[float]], hooks: Any = None, total_chunks: int | None = None, *,
             image: Any = None, streamed: bool = False, lookahead: int = 0) -> SyntheticWorldRuntime:
        """A fresh runtime for one session with these settings; ``streamed``: a live session
        whose controls arrive one chunk at a time (none planned), ``lookahead`` chunks ahead."""
        compute = ({"gemm_dim": self.compute_gemm_dim, "gemms_per_layer_step": self.compute_gemms}
                   if self.compute_gemm_dim else None)
        return SyntheticWorldRuntime(
            self._geometry, streamed=streamed, lookahead=lookahead, handout=self.handout, actions=actions,
            prompt=self.prompt, image=image, seed=self.seed, num_steps=self.num_steps,
            local_attn_size=self._local_attn_size, sink_size=self._sink_size, total_chunks=total_chunks,
            device=self._device, dtype=self._dtype, hooks=hooks, compute=compute)
