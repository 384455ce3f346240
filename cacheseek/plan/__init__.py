"""Plan clients: the Plan API of docs/design.md section 2 (direct copies into a store's host segments).

Registered in `cacheseek.registry.PLAN_CLIENTS`: ``embedded`` (`EmbeddedPlanClient`, an in-process
store over one pre-faulted segment), ``fluxon_native`` (`FluxonNativePlanClient`, wrappers
over a Fluxon client with the Plan API), ``fluxon_public`` (`FluxonPublicPlanClient`, the Plan
calls emulated over the public fluxon-py 0.2.4 client), ``device`` (`DevicePlanClient`, the embedded
store with its values in a device-memory pool: the HBM tier) and ``fluxon`` (`open_fluxon_plan_client`:
the native one when the installed fluxon-py has the Plan API, else the emulation:
`cacheseek.plan.fluxon_select`). Handle lifecycles are documented in `cacheseek.plan.base`; the
FXPLANV1 table format in `cacheseek.plan.table`. Importing this package needs no torch (`device` imports it).

The in-process clients (embedded, device, fluxon_public) share their mechanism: the verbs and
handle bookkeeping (`inprocess`), host mappings (`segment`), plan-table arenas (`table_arena`)
and the first-fit allocator (`allocator`); the public client's staging lives in `fluxon_staging`,
its per-value Fluxon calls in `fluxon_calls` and `pipeline`.
"""

from __future__ import annotations

from cacheseek.plan.base import (GetPlan, GetPlanState, PlanClient, PlanClientInfo, PlanUsage, PutCommitResult,
                                 PutPlan, PutPlanState, SegmentMapping, SegmentTimers)
from cacheseek.plan.embedded import EmbeddedPlanClient
from cacheseek.plan.fluxon_native import FluxonNativePlanClient
from cacheseek.plan.fluxon_public import FluxonPublicPlanClient
from cacheseek.plan.fluxon_select import open_fluxon_plan_client
from cacheseek.plan.table import PLAN_MAGIC, decode_plan_table, encode_plan_table

__all__ = ["GetPlan", "GetPlanState", "PlanClient", "PlanClientInfo", "PlanUsage", "PutCommitResult", "PutPlan",
           "PutPlanState", "SegmentMapping", "SegmentTimers", "EmbeddedPlanClient", "FluxonNativePlanClient",
           "FluxonPublicPlanClient", "open_fluxon_plan_client", "PLAN_MAGIC", "decode_plan_table",
           "encode_plan_table"]
