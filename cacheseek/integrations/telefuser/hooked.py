"""The hooked TeleFuser (the commit that calls the binding itself): attach marks the model and
reports each chunk's control.

TeleFuser calls ``on_runtime_created`` inside its own ``create_runtime``; wrapping that call in
`cacheseek.weights.of_model` lets the binding fingerprint the DiT that built the runtime, as the
released and main shims do around their own calls. TeleFuser passes the binding no control, so
``generate_next_chunk`` reports the one each chunk runs with (`chunk_controls.NextChunkSeam`).
"""

from __future__ import annotations

from typing import Any

from cacheseek import weights
from cacheseek.hooks import as_hooks
from cacheseek.integrations.telefuser.chunk_controls import NextChunkSeam, OverrideSeam
from cacheseek.integrations.telefuser.encodes import KeptEncodes

__all__ = ["HookedHooks"]


class HookedHooks:
    """The seams of a hooked pipeline instance; made by `cacheseek.integrations.telefuser.attach`."""

    def __init__(self, pipeline: Any) -> None:
        self.pipeline = pipeline
        self._create_runtime = pipeline.create_runtime
        self._generate_next_chunk = pipeline.generate_next_chunk
        self._build_control_override = pipeline.build_control_override
        self.encodes = KeptEncodes(pipeline)
        self.installed = False

    @property
    def own_generate_next_chunk(self) -> Any:
        """The pipeline's own ``generate_next_chunk``, without the per-chunk seam (`remove` puts it back)."""
        return self._generate_next_chunk

    def install(self) -> None:
        self.pipeline.create_runtime = self.create_runtime
        self.pipeline.generate_next_chunk = NextChunkSeam(self._generate_next_chunk, self.pipeline)
        self.pipeline.build_control_override = OverrideSeam(self._build_control_override)
        self.encodes.install()
        self.installed = True

    def remove(self) -> None:
        """Give the pipeline its own create_runtime and generate_next_chunk back (idempotent)."""
        if self.installed:
            for name in ("create_runtime", "generate_next_chunk", "build_control_override"):
                if name in vars(self.pipeline):
                    delattr(self.pipeline, name)
            self.encodes.remove()
        self.installed = False

    def create_runtime(self, session_config: Any, *args: Any, **kwargs: Any) -> Any:
        binding = getattr(session_config, "world_kv_binding", None)
        if binding is not None:
            as_hooks(binding).accept_handout()  # generate_next_chunk hands out served chunks' frames (`handout`)
        with weights.of_model(self.pipeline.dit), self.encodes.for_session(binding):
            return self._create_runtime(session_config, *args, **kwargs)
