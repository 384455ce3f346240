"""Attaching a client to a running Fluxon service: `attach_native` finds the owner
(``shared.json``: `FluxonUnavailableError` without one, before fluxon-py is touched), makes the
native client (bounded by ``attach_timeout_s``), waits ``settle_s`` (an RPC sent within ~1 s of
attaching can be lost and stall 30 s), probes (the first RPC is part of attaching: bounded by
``attach_timeout_s`` too), then opens the cluster's chunk records and, with ``key_index``, the key
index in the service's own etcd. What it found is an `Attachment`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Optional

import attrs

from cacheseek.fluxon.endpoint import FluxonEndpoint
from cacheseek.fluxon.key_index import KeyIndex
from cacheseek.fluxon.loader import load_fluxon
from cacheseek.fluxon.native_output import native_output_to_log
from cacheseek.fluxon.native_store import native_config, new_native_store
from cacheseek.fluxon.owner import owner_info
from cacheseek.fluxon.records import EtcdRecords
from cacheseek.fluxon.results import unwrap

__all__ = ["PROBE_KEY", "Attachment", "attach_native"]

log = logging.getLogger("cacheseek.fluxon.client")

PROBE_KEY = "__cacheseek_probe__"


@attrs.frozen
class Attachment:
    """What attaching found: the owner's ``segment_bytes`` and ``owner_id``, the service's
    ``etcd_endpoints``, the cluster's chunk ``records`` and its key ``index`` (None without)."""

    segment_bytes: int
    owner_id: str
    etcd_endpoints: tuple[str, ...]
    records: EtcdRecords
    index: Optional[KeyIndex]


def attach_native(endpoint: FluxonEndpoint, instance_key: str, run: Callable[..., Any], *, key_index: bool,
                  adopt: Callable[[Any], None]) -> Attachment:
    """Attach as ``instance_key`` (see the module docstring); every call through ``run`` (the
    client's bounded calls). ``adopt(store)`` hands the native client over as soon as it exists:
    from then on the caller closes it, on a later failure too."""
    fx = load_fluxon()  # first: without fluxon-py, starting a service would not help either
    shared = owner_info(endpoint.segment_dir, endpoint.cluster_name, endpoint.share_mem_path)
    segment_bytes = int(shared.get("segment_len") or 0)
    where = (instance_key, endpoint.cluster_name, endpoint.share_mem_path)
    config = native_config(fx, endpoint.native_spec(instance_key))
    with native_output_to_log(log):
        store = run("attach", None, lambda: new_native_store(fx, config, *where), endpoint.attach_timeout_s)
    adopt(store)
    with native_output_to_log(log):
        time.sleep(endpoint.settle_s)
        run("exists", PROBE_KEY,
            lambda: unwrap("exists", PROBE_KEY, store.is_exist(PROBE_KEY), segment_bytes=segment_bytes),
            endpoint.attach_timeout_s)
    endpoints = run("attach", None, lambda: [str(e) for e in store.get_etcd_config()])
    records = EtcdRecords(endpoints, endpoint.cluster_name, op_timeout_s=endpoint.op_timeout_s)
    try:
        index = KeyIndex.open(endpoints, endpoint.cluster_name, run, log) if key_index else None
    except BaseException:
        records.close()
        raise
    return Attachment(segment_bytes, str(shared.get("owner_id", "?")), tuple(endpoints), records, index)
