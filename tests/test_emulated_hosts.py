"""tools/emulated_hosts.py: hosts as namespaces on one machine (needs root; no Fluxon). Each host
has its own hostname, address, /tmp and /dev/shm; they reach each other over the bridge; nothing
of this namespace changes, and nothing is left after close, even when the body fails."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="emulated hosts need root (namespaces)")

SERVE = ("import socket; s = socket.socket(); s.bind(('0.0.0.0', 7788)); s.listen(); print('up', flush=True); "
         "c, peer = s.accept(); c.sendall(socket.gethostname().encode() + b' ' + peer[0].encode()); c.close()")


def _links() -> list[str]:
    return sorted(line.split(":", 1)[0].strip() for line in open("/proc/self/net/dev") if ":" in line)


def test_hosts_are_separate_machines_on_one_link_and_vanish_after(tmp_path):
    import subprocess

    from emulated_hosts import EmulatedHosts

    before = _links()
    (tmp_path / "note").write_text("shared")
    with EmulatedHosts(["ha", "hb"], shared_dir=tmp_path) as hosts:
        assert hosts.run("ha", ["hostname"]).stdout.strip() == "ha"
        assert hosts.run("hb", ["hostname"]).stdout.strip() == "hb"
        assert hosts.run("hb", ["cat", "/tmp/shared/note"]).stdout == "shared"
        hosts.run("ha", ["sh", "-c", "echo a > /tmp/only-a; echo a > /dev/shm/only-a"])
        assert hosts.run("hb", ["ls", "/tmp/only-a", "/dev/shm/only-a"]).returncode != 0
        assert not Path("/tmp/only-a").exists() and not Path("/dev/shm/only-a").exists()
        links = hosts.run("ha", ["cat", "/proc/net/dev"]).stdout
        assert "eth0:" in links and "csbr0" not in links
        server = hosts.popen("hb", [sys.executable, "-c", SERVE], stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout.readline().strip() == "up"
            rx0 = hosts.link_bytes("ha")[0]
            got = hosts.run("ha", [sys.executable, "-c", "import socket; s = socket.create_connection"
                                   f"(('{hosts.address('hb')}', 7788), timeout=10); print(s.recv(100).decode())"])
            assert got.stdout.split() == ["hb", hosts.address("ha")], got.stderr
            assert hosts.link_bytes("ha")[0] > rx0
        finally:
            server.kill()
            server.wait(10)
        holders = [hosts.holder_pid(name) for name in hosts.names] + [hosts.holder_pid()]
        assert None not in holders
        assert _links() == before  # nothing here changed
    assert not any(Path(f"/proc/{pid}").exists() for pid in holders)
    assert _links() == before


def test_a_failing_body_still_tears_everything_down():
    from emulated_hosts import EmulatedHosts

    with pytest.raises(RuntimeError, match="body failed"):
        with EmulatedHosts(["hx"]) as hosts:
            pid = hosts.holder_pid("hx")
            hosts.popen("hx", ["sleep", "600"])
            raise RuntimeError("body failed")
    assert not Path(f"/proc/{pid}").exists()
    with pytest.raises(ValueError, match="hostname"):
        EmulatedHosts(["bad name"])


def test_clean_env_drops_only_the_fluxon_libs_entry():
    from emulated_hosts import clean_env

    env = {"LD_LIBRARY_PATH": "/opt/x/lib:/v/site-packages/fluxon_pyo3.libs", "A": "1"}
    assert clean_env(env) == {"LD_LIBRARY_PATH": "/opt/x/lib", "A": "1"}
    assert clean_env({"LD_LIBRARY_PATH": "/v/fluxon_pyo3.libs"}) == {}
