"""`KeyIndex`: the keys CacheSeek wrote to one Fluxon cluster, kept in the service's etcd.

fluxon-py 0.2.4 can count keys by prefix but not list them, so a client that must list keys
keeps an index at ``/cacheseek/key_index/<cluster>/<key>`` (~1 ms a key): a put adds the key
before the value is written, a remove drops it after. `list_keys` reads the index and checks it
against Fluxon's own count; on a mismatch (values evicted, a crash between the two writes, keys
written by other clients) it checks each key, drops stale entries and warns about keys it
cannot see.

Every etcd call goes through the owner's bounded-call runner (``run(op, key, fn)``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Optional

from cacheseek.errors import StoreError

__all__ = ["KeyIndex"]

Run = Callable[..., Any]


class KeyIndex:
    """The key index of one cluster over an etcd client (``put``/``delete``/``get_prefix``)."""

    def __init__(self, etcd: Any, cluster_name: str, run: Run, logger: Optional[logging.Logger] = None) -> None:
        self.etcd = etcd
        self._root = f"/cacheseek/key_index/{cluster_name}/"
        self._run = run
        self._log = logger or logging.getLogger(__name__)

    @classmethod
    def open(cls, endpoints: list[str], cluster_name: str, run: Run,
             logger: Optional[logging.Logger] = None) -> "KeyIndex":
        """The index in the etcd at ``endpoints``, through fluxon-py's own etcd client."""
        from fluxon_py.tool import import_fluxon_pyo3_local

        return cls(import_fluxon_pyo3_local().EtcdKvClient(endpoints), cluster_name, run, logger)

    def path(self, key: str) -> str:
        """The etcd key of ``key``'s entry (of a prefix: the root of its entries)."""
        return self._root + key

    def add(self, key: str) -> None:
        self._run("index put", key, lambda: self.etcd.put(self.path(key), b""))

    def remove(self, key: str) -> None:
        self._run("index remove", key, lambda: self.etcd.delete(self.path(key)))

    def list_keys(self, prefix: str, count: Callable[[str], int], exists: Callable[[str], bool]) -> list[str]:
        """Sorted indexed keys under ``prefix`` whose values exist. ``count(prefix)``: how many
        keys Fluxon holds there; ``exists(key)``: whether a value is there (asked only on a
        mismatch)."""
        entries = self._run("index list", prefix, lambda: self.etcd.get_prefix(self.path(prefix)))
        keys = sorted(k.decode("utf-8")[len(self._root):] for k, _ in entries)
        held = count(prefix)
        if held == len(keys):
            return keys
        present = [k for k in keys if exists(k)]
        for k in set(keys) - set(present):
            self.remove(k)
        if held > len(present):
            self._log.warning("fluxon list_keys(%r): %d keys in Fluxon were not written through CacheSeek's "
                              "key index and are not listed", prefix, held - len(present))
        elif len(present) < len(keys):
            self._log.info("fluxon list_keys(%r): dropped %d stale index entries (values evicted or never "
                           "written)", prefix, len(keys) - len(present))
        return present

    def drop_if_absent(self, key: str, exists: Callable[[str], bool], cause: BaseException) -> None:
        """After a failed put: drop ``key``'s entry unless an older value is still there."""
        try:
            if not exists(key):
                self.remove(key)
        except StoreError as exc:
            self._log.debug("fluxon: could not tidy the key index after %s: %s", cause, exc)
