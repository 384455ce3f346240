#!/usr/bin/env python3
"""A Fluxon client on one (emulated) host, driven by JSON lines: what the multi-host tests, the
demo and experiments/multi_host run on each host.

    python tools/fluxon_peer.py --cluster-name C --share-mem-path P [--op-timeout S]

It attaches a `FluxonClient` to its own host's owner, prints ``{"ready": ..., "hostname": ...}``
and then answers one JSON line per request line:

    {"op": "put", "key": K, "seed": S, "size": N}  -> {"s": seconds}         (N seeded bytes)
    {"op": "get", "key": K}                        -> {"hit": bool, "digest": hex | null,
                                                       "s": seconds, "rx": bytes received meanwhile}
    {"op": "remove", "key": K}                     -> {"s": seconds}
    {"op": "tcp_serve", "size": N}                 -> {"port": P}   (sends N bytes to one client)
    {"op": "tcp_recv", "host": H, "port": P}       -> {"s": seconds, "bytes": N}
    {"op": "quit"}

A get copies the value out of the segment into a private buffer (what a restore does before the
device copy) and is timed up to there; ``digest`` (blake2b-128 of the bytes) is computed after.
``rx`` comes from this host's /proc/net/dev: a get that pulled the value from another host's owner
received about its size. A failed call answers ``{"error": "Type: text", "s": seconds}``.
`payload(seed, size)` and `digest` are what a caller checks the answers against.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import socket
import sys
import threading
import time
from typing import Any, Optional

__all__ = ["payload", "digest"]


def payload(seed: int, size: int) -> bytes:
    import numpy as np

    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def digest(data: Any) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def rx_bytes() -> int:
    with open("/proc/self/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "eth0":
                return int(rest.split()[0])
    return 0


def _serve(size: int, srv: socket.socket) -> None:
    conn, _ = srv.accept()
    with conn, srv:
        block = b"\0" * (1 << 20)
        left = size
        while left > 0:
            n = conn.send(block[:min(left, len(block))])
            left -= n


def _recv(host: str, port: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    total = 0
    with socket.create_connection((host, port), timeout=30) as s:
        buf = bytearray(1 << 20)
        while True:
            n = s.recv_into(buf)
            if not n:
                break
            total += n
    return {"s": time.perf_counter() - t0, "bytes": total}


def handle(client: Any, req: dict[str, Any]) -> Optional[dict[str, Any]]:
    op = req["op"]
    if op == "put":
        data = payload(int(req["seed"]), int(req["size"]))
        t0 = time.perf_counter()
        client.put_bytes(req["key"], data)
        return {"s": time.perf_counter() - t0}
    if op == "get":
        rx0, t0 = rx_bytes(), time.perf_counter()
        with client.read(req["key"]) as view:
            copy = None if view is None else bytearray(view.array)
        seconds, rx = time.perf_counter() - t0, rx_bytes() - rx0
        return {"hit": copy is not None, "digest": None if copy is None else digest(copy), "s": seconds, "rx": rx}
    if op == "remove":
        t0 = time.perf_counter()
        client.remove(req["key"])
        return {"s": time.perf_counter() - t0}
    if op == "tcp_serve":
        srv = socket.socket()
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("0.0.0.0", 0))
        srv.listen(1)
        threading.Thread(target=_serve, args=(int(req["size"]), srv), daemon=True).start()
        return {"port": srv.getsockname()[1]}
    if op == "tcp_recv":
        return _recv(req["host"], int(req["port"]))
    if op == "quit":
        return None
    raise ValueError(f"unknown op {op!r}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cluster-name", required=True)
    p.add_argument("--share-mem-path", required=True)
    p.add_argument("--op-timeout", type=float, default=10.0)
    args = p.parse_args()
    from cacheseek.fluxon.client import FluxonClient

    client = FluxonClient(args.cluster_name, args.share_mem_path, "peer", op_timeout_s=args.op_timeout,
                          attach_timeout_s=60.0, key_index=False)
    print(json.dumps({"ready": True, "hostname": socket.gethostname()}), flush=True)
    try:
        for line in sys.stdin:
            req = json.loads(line)
            t0 = time.perf_counter()
            try:
                out = handle(client, req)
            except Exception as exc:  # noqa: BLE001 - answered, the caller judges it
                out = {"error": f"{type(exc).__name__}: {exc}", "s": time.perf_counter() - t0}
            if out is None:
                break
            print(json.dumps(out), flush=True)
    finally:
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
