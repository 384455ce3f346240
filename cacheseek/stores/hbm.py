"""`HbmTierStore` (store ``hbm``): hot prefixes in spare device memory, restored device to device.

The Plan tier's mechanism over a `DevicePlanClient`: the same keys (``{locator}:L{i}:k/v``,
``{hex}:lat``), the same write path (Plans started per value size, one batch of copies, one
synchronize, commit, then ``handle.ready``: publication last), the same read path (one chunk-major
get with all-or-nothing groups, the copy runs of every layer in one batch, one synchronize, the
views released) and the same accounting; only the direction differs: every copy is D2D, between
the ring's tensors and a pool of the runtime device's memory (HBM on a GPU, where a 480p chunk of
3.57 GiB moves at device-memory speed; host memory with ``device=cpu``, so CI runs the whole path).

Writes are synchronous by default (``overlap=False``): a D2D copy of a chunk takes milliseconds,
no staging slot is worth its memory. Capacity: ``capacity_bytes`` (``auto``, the default: the
workload's chunks over the eviction watermark, capped at 80% of the runtime device's free memory
after the runtime's weights, ring and activations, `sizing.runtime_device_room`), or
``capacity_fraction`` of the device's free memory when the store is built (allocated at once, at
warm-up). HBM does not corrupt
silently (ECC), so values carry no checksum here. The pool does not survive the process: a
restarted worker finds this tier empty (a tiered store then serves from the tiers below).

Used alone (``+store=hbm``) it is a bounded cache whose eviction is the manager's; as the top of a
`TieredStore` (``+store=tiered store.tiers=[hbm,fluxon_plan]``) eviction demotes to the next tier.
"""

from __future__ import annotations

from typing import Any, Optional

from cacheseek.errors import ConfigError
from cacheseek.plan.device import DevicePlanClient
from cacheseek.kv.handles import Tier
from cacheseek.registry import STORES
from cacheseek.sizes import AUTO
from cacheseek.sizing import SizeField
from cacheseek.stores.plan_tier import PlanTierStore
from cacheseek.transfer.protocol import TransferRuntime

__all__ = ["HbmTierStore"]


@STORES.register("hbm", objects=("transfer", "plan_client"))
class HbmTierStore(PlanTierStore):
    """The HBM tier (see the module docstring). ``device``: where the pool lives; None = the
    transfer runtime's kind (CUDA: the current device; host: cpu). ``transfer``: the runtime
    shared with the other tiers (the caller keeps owning it). ``plan_client``: a built device pool
    in place of the one these fields describe (the store owns it either way)."""

    storage_format = PlanTierStore.storage_format  # the same bare bytes as the Plan tier
    tier = Tier.HBM_STAGING

    @classmethod
    def size_fields(cls, config: dict) -> list:
        """``capacity_bytes`` against the runtime device's room (module docstring); none when
        ``capacity_fraction`` sizes the pool at start (the orchestrator then checks the capacity
        the store reports against one chunk)."""
        if config.get("capacity_fraction"):
            return []
        return [SizeField("capacity_bytes", "segment", alignment=int(config.get("alignment", 256)),
                          device_room=True)]

    def __init__(
        self,
        capacity_bytes: Any = AUTO,
        capacity_fraction: float = 0.0,
        device: Optional[str] = None,
        alignment: int = 256,
        commit_timeout_s: float = 30.0,
        overlap: bool = False,
        *,
        transfer: Optional[TransferRuntime] = None,
        plan_client: Optional[DevicePlanClient] = None,
    ) -> None:
        if isinstance(capacity_bytes, str) and capacity_bytes.strip().lower() == AUTO:
            if not capacity_fraction and plan_client is None:
                raise ConfigError("store.capacity_bytes", "auto is resolved when a stack is built (orchestrator)",
                                  "give bytes, or store.capacity_fraction=0.3 (of free memory)")
            capacity_bytes = 0  # the fraction sizes the pool
        if device is None:
            device = "cuda" if transfer is not None and transfer.device_kind == "cuda" else "cpu"
        client = plan_client or DevicePlanClient(capacity_bytes, capacity_fraction, device, alignment)
        try:
            super().__init__(device=str(client.device), commit_timeout_s=commit_timeout_s, overlap=overlap,
                             transfer=transfer, plan_client=client)
        except BaseException:
            client.close()
            raise
        self._owns_client = True

    @property
    def device(self) -> Any:
        return self.plan_client.device  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        u = self.usage()
        size = f"{u.used_bytes}/{u.capacity_bytes} B" if u is not None else "closed"
        return f"HbmTierStore({self.device}, {size}, transfer={self.transfer!r})"
