"""The hooked TeleFuser (the commit that calls the binding itself): attach only marks the model.

TeleFuser calls ``on_runtime_created`` inside its own ``create_runtime``; wrapping that call in
`cacheseek.weights.of_model` lets the binding fingerprint the DiT that built the runtime, as the
released and main shims do around their own calls.
"""

from __future__ import annotations

from typing import Any

from cacheseek import weights

__all__ = ["HookedHooks"]


class HookedHooks:
    """The one seam of a hooked pipeline instance; made by `cacheseek.integrations.telefuser.attach`."""

    def __init__(self, pipeline: Any) -> None:
        self.pipeline = pipeline
        self._create_runtime = pipeline.create_runtime
        self.installed = False

    def install(self) -> None:
        self.pipeline.create_runtime = self.create_runtime
        self.installed = True

    def remove(self) -> None:
        """Give the pipeline its own create_runtime back (idempotent)."""
        if self.installed and "create_runtime" in vars(self.pipeline):
            del self.pipeline.create_runtime
        self.installed = False

    def create_runtime(self, *args: Any, **kwargs: Any) -> Any:
        with weights.of_model(self.pipeline.dit):
            return self._create_runtime(*args, **kwargs)
