#!/usr/bin/env bash
# Run a command inside a private network namespace of its own (needs root).
#
# The namespace holds only loopback (up) and a veth pair fx0/fx1 whose two ends both stay inside
# it, with the private address 10.77.0.1/24 on fx0, assigned inside the namespace. The Fluxon
# master and owner insist on a non-loopback address to advertise: they get fx0's, and no packet
# can leave the namespace. The host's interfaces and addresses are never changed; the namespace
# and its veth pair vanish when the command exits. The exit status is the command's.
#
# The command also gets a PID namespace and a mount namespace of its own, so nothing it starts
# outlives it, even when it crashes: when it exits, the kernel ends every process left in the
# namespace (an etcd, a Fluxon master or owner), and /dev/shm and /tmp/fluxon_ipc are private
# tmpfs mounts that vanish with it (segments, IPC files). Mounts made inside stay inside.
#
# Usage: tools/netns-run.sh CMD [ARGS...]
#   e.g. tools/netns-run.sh python -m pytest -q -m fluxon tests/fluxon
#        tools/netns-run.sh bash        # a shell in a private namespace
set -euo pipefail

usage="usage: tools/netns-run.sh CMD [ARGS...]  (runs CMD in a private network namespace; needs root)"
die() { echo "netns-run: $*" >&2; exit 2; }

case "${1:-}" in
  "") echo "$usage" >&2; exit 2 ;;
  -h|--help) echo "$usage"; exit 0 ;;
esac

[ "$(id -u)" = 0 ] || die "needs root to create a network namespace (fix: sudo tools/netns-run.sh $*)"
for tool in unshare:util-linux ip:iproute2; do
  command -v "${tool%%:*}" >/dev/null 2>&1 || die "'${tool%%:*}' not found on PATH (fix: apt-get install ${tool#*:}, or bash tools/install_fluxon_deps.sh)"
done

# The setup runs inside the new namespace, before CMD; any failure there stops before CMD runs.
# unshare's own failure (e.g. a container without CAP_SYS_ADMIN) is reported as such.
status=0
made_ipc=0
[ -e /tmp/fluxon_ipc ] || { mkdir -p /tmp/fluxon_ipc && made_ipc=1; }
unshare --net --pid --fork --mount-proc -- bash -c '
  set -e
  fail() { echo "netns-run: cannot set up the namespace: $1 failed" >&2; exit 125; }
  mount -t tmpfs -o mode=1777 netns-shm /dev/shm || fail "mount -t tmpfs /dev/shm"
  mount -t tmpfs -o mode=1777 netns-ipc /tmp/fluxon_ipc || fail "mount -t tmpfs /tmp/fluxon_ipc"
  ip link set lo up || fail "ip link set lo up"
  ip link add fx0 type veth peer name fx1 || fail "ip link add fx0 type veth peer name fx1 (the kernel needs veth)"
  ip link set fx1 up || fail "ip link set fx1 up"
  ip addr add 10.77.0.1/24 dev fx0 || fail "ip addr add 10.77.0.1/24 dev fx0"
  ip link set fx0 up || fail "ip link set fx0 up"
  command -v "$1" >/dev/null 2>&1 || { echo "netns-run: command not found: $1" >&2; exit 127; }
  rc=0; "$@" || rc=$?; exit "$rc"' netns-run "$@" || status=$?  # bash stays PID 1: it reaps orphans, its exit ends the rest
[ "$made_ipc" = 0 ] || rmdir /tmp/fluxon_ipc 2>/dev/null || true
if [ "$status" = 1 ] && ! unshare --net -- true 2>/dev/null; then
  die "unshare --net failed: this process may not create network namespaces (fix: run as root with CAP_SYS_ADMIN, e.g. a privileged container)"
fi
exit "$status"
