"""fluxon-py's native KV client (the "store"): made, closed, or left to process exit.

These run inside the owner's bounded calls (`cacheseek.fluxon.calls`): ``new_store`` blocks
while the service is slow to answer, ``close`` takes about a second. A store with calls still
stuck in it cannot be closed; `abandon_native_store` takes it off fluxon-py's exit-time cleanup
(which would only hang the same way) and leaves it to process exit.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable

from cacheseek.errors import ConfigError, StoreError, StoreTimeoutError
from cacheseek.fluxon.native_output import native_output_to_log
from cacheseek.fluxon.results import error_text

__all__ = ["native_config", "new_native_store", "close_native_store", "abandon_native_store", "shut_native_store"]

log = logging.getLogger("cacheseek.fluxon.client")


def native_config(fx: Any, spec: dict[str, Any]) -> Any:
    """fluxon-py's client config of ``spec`` (`FluxonEndpoint.native_spec`); a rejected one is a
    `ConfigError`."""
    try:
        return fx.FluxonKvClientConfig(spec)
    except (ValueError, TypeError) as exc:
        raise ConfigError("store", f"fluxon rejected the client config: {exc}") from None


def new_native_store(fx: Any, config: Any, instance_key: str, cluster_name: str, share_mem_path: str) -> Any:
    """Attach a native client to the owner (``fx.new_store``); its error is a `StoreError`."""
    res = fx.new_store(config)
    if res.is_ok():
        return res.unwrap()
    raise StoreError(
        f"fluxon new_store failed for cluster {cluster_name!r} at {share_mem_path} "
        f"(instance {instance_key}): {error_text(res.unwrap_error())}")


def close_native_store(store: Any) -> None:
    """Close a native client; its error is a `StoreError`."""
    res = store.close()
    if res.is_ok():
        res.unwrap()
    else:
        raise StoreError(f"fluxon close failed: {error_text(res.unwrap_error())}")


def abandon_native_store(store: Any) -> None:
    """Leave a store with stuck calls to process exit (off fluxon-py's atexit close)."""
    with contextlib.suppress(Exception):  # fluxon's atexit close would only fail the same way
        from fluxon_py.kvclient.backend_fallback_close import unregister_store_from_cleanup

        unregister_store_from_cleanup(store)


def shut_native_store(store: Any, drained: tuple[int, int], run: Callable[..., Any], *, who: str) -> None:
    """A closing client's native store, once its calls in flight were waited for (``drained``:
    `BoundedCalls.drain`'s ``(stuck, inflight)``): closed (bounded, by ``run``), or, with calls
    still stuck in it, left to process exit (`abandon_native_store`)."""
    stuck, inflight = drained
    if stuck or inflight:
        log.warning("fluxon client %s: %d calls are still stuck in Fluxon; the native client cannot "
                    "be closed while they run and is left to process exit", who, stuck + inflight)
        abandon_native_store(store)
        return
    try:
        with native_output_to_log(log):
            run("close", None, lambda: close_native_store(store))
    except StoreTimeoutError as exc:
        log.warning("fluxon client %s: %s", who, exc)
    log.debug("fluxon client %s closed", who)
