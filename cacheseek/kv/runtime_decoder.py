"""`RuntimeDecoder`: a runtime's causal decoder as the binding sees it (`reuse.exact_prefix.decoder_states`).

What its decoder's state is after a chunk (``spec``: the entries' shapes and dtypes, to size a
read and check what it got), a reference to it now (``capture``: the packer copies it), and
setting it (``load``). The base class is a decoder without state: nothing stored, nothing loaded,
a divergence replays. The TeleFuser integration (the Wan VAE's feature cache) and the synthetic
runtime (its previous frame) subclass it. Kept below both (they sit below the binding).
"""

from __future__ import annotations

from typing import Any, Optional

from cacheseek.kv.decoder_state import DecoderStateSpec

__all__ = ["RuntimeDecoder"]


class RuntimeDecoder:
    """A runtime's causal decoder as the binding sees it. The base: a decoder without state
    (``spec`` None: nothing is stored, nothing loaded; a divergence replays as before)."""

    device: Any = "cpu"
    # the runtime calls `NextChunk.late_state.catch_up` right before the decoder's first use at a
    # divergence (after the chunk's denoising), so a stored state is read while the chunk computes
    loads_late: bool = False

    def spec(self, after_chunk: int) -> Optional[DecoderStateSpec]:
        """What the state holds after chunk ``after_chunk`` (its entries' shapes and dtypes), or
        None when it keeps none worth storing."""
        return None

    def capture(self) -> Optional[list]:
        """The state now (after the chunk just decoded): tensors, None, marker strings; None when
        there is none."""
        return None

    def load(self, entries: list) -> None:
        """Set the state to ``entries`` (as `capture` returned it, on ``device``)."""
