"""A worker process of test_fluxon_records.py: sessions on a Fluxon cluster through the public API.

    python tests/fluxon/records_worker.py ROLE CLUSTER SHARE_MEM_PATH OUT.json STORE:FINGERPRINT...

For each ``STORE`` (``fluxon_plan``: the Plan tier over the ``fluxon`` client; ``fluxon``: the
per-layer tier) a stack with an empty trie and no snapshot runs the gate's P+X session: ROLE
``write`` once (cold, every chunk written), ROLE ``read`` once with the shared index (what it finds
by key in the cluster's records) and once cold on a fresh trie without it and without ingest (the
reference frames). OUT.json: per store, each session's hit depth, frame hashes and the metrics.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path


def overrides(store: str, cluster: str, shm: str, fingerprint: str) -> list[str]:
    common = [f"namespace.model_fingerprint={fingerprint}"]
    if store == "fluxon_plan":
        return common + ["+store=fluxon_plan", "store.client=fluxon", f"+store.client_options.cluster_name={cluster}",
                         f"+store.client_options.share_mem_path={shm}", "+store.client_options.op_timeout_s=20"]
    return common + ["+store=fluxon", f"store.cluster_name={cluster}", f"store.share_mem_path={shm}",
                     "store.op_timeout_s=20"]


def session(stack, actions, **kw) -> dict:
    binding, hashes, _ = stack.run_session(actions, **kw)
    return {"hit_depth": binding.last_fast_forward, "ingest_errors": binding.ingest_errors,
            "bytes_written": binding.bytes_written, "frame_hashes": [h if isinstance(h, str) else h.hex() for h in hashes]}


def run(role: str, cluster: str, shm: str, specs: list[str]) -> dict:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import cacheseek.schema  # noqa: F401  (the root schema)
    from cacheseek.cli_help import CONF_DIR
    from cacheseek.registry import import_backends
    from cacheseek.orchestrator import build_stack, instantiate
    from cacheseek.reuse.exact_prefix import NamespaceForest

    import_backends()  # every store's schema, as the CLI registers them
    out = {}
    for spec in specs:
        store, fingerprint = spec.split(":", 1)
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            cfg = compose(config_name="config", overrides=overrides(store, cluster, shm, fingerprint))
        gate = instantiate(cfg.workload)
        stack = build_stack(cfg, run_dir=Path(tempfile.mkdtemp(prefix=f"rw-{store}-")), workload=gate)
        try:
            result = {"n": gate.n, "records_shared": stack.store.records.shared}
            if role == "write":
                result["a"] = session(stack, gate.P + gate.X)
            else:
                result["b"] = session(stack, gate.P + gate.X)
                cold = stack.new_manager(forest=NamespaceForest(), shared_index=False)
                result["cold"] = session(stack, gate.P + gate.X, manager=cold, ingest=False)
            result["metrics"] = stack.metrics.as_dict()
        finally:
            stack.close()
        out[store] = result
    return out


if __name__ == "__main__":
    role, cluster, shm, path, *specs = sys.argv[1:]
    Path(path).write_text(json.dumps(run(role, cluster, shm, specs), default=str))
