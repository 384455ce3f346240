"""The errors of the Fluxon room, named by cause; each says when it is raised."""

from __future__ import annotations

from cacheseek.errors import CacheSeekError, StoreError

__all__ = ["FluxonImportError", "FluxonServiceError", "FluxonUnavailableError", "FluxonValueTooLargeError"]


class FluxonUnavailableError(StoreError):
    """No Fluxon owner serves the requested cluster (no or stale ``shared.json``)."""


class FluxonValueTooLargeError(StoreError):
    """A value cannot fit the owner's segment even when the segment is empty."""


class FluxonImportError(StoreError):
    """fluxon-py could not be imported through normal package resolution."""


class FluxonServiceError(CacheSeekError):
    """The local Fluxon service could not be started, or one of its processes failed."""
