"""Loading fluxon-py: found by normal package resolution, imported lazily, recorded once.

`load_fluxon` imports ``fluxon_py`` and its native extension through the package's own loader
(RTLD_LOCAL, bundled libraries) and logs, once per process, what was loaded: the package version
and folder, each ``fluxon_pyo3`` extension with its SHA256, and how many native libraries came
bundled with it (`fluxon_runtime_info` returns the same record). A failed import is
`FluxonImportError` naming the interpreter, what each module name resolved to, and the fix.
`fluxon_py_problem` answers whether fluxon-py is installed without importing it.

fluxon-py's loader points ``LD_LIBRARY_PATH`` at its bundled ``fluxon_pyo3.libs`` for the whole
process; the dynamic loader of this process read that variable at start, so the change only
reaches child processes, where the bundled libraries (an old libmount, libselinux) break system
tools such as ``mount``. `load_fluxon` gives the variable back as it was once the extension is
loaded (fluxon's own entry points, which the service starts, set it again themselves).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import logging
import os
import sys
import threading
from typing import Any, Optional

from cacheseek.fluxon.errors import FluxonImportError

__all__ = ["load_fluxon", "fluxon_runtime_info", "fluxon_py_problem"]

log = logging.getLogger(__name__)

_runtime_info: Optional[dict[str, Any]] = None
_runtime_lock = threading.Lock()


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@contextlib.contextmanager
def _environment_kept(name: str):
    """The environment variable ``name`` as it was before the block, after it."""
    before = os.environ.get(name)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def fluxon_py_problem() -> Optional[str]:
    """None when ``fluxon_py`` resolves (without importing it); otherwise why not."""
    try:
        spec = importlib.util.find_spec("fluxon_py")
    except (ImportError, ValueError) as exc:
        return f"looking up fluxon_py failed: {exc}"
    if spec is None:
        return ("fluxon-py is not installed: pip install -e '.[fluxon]' from the repository root, "
                "or bash tools/install_fluxon_deps.sh (fluxon-py and an etcd server)")
    return None


def load_fluxon() -> Any:
    """Import fluxon_py (normal resolution, lazily) and log what was loaded, once per process."""
    global _runtime_info
    try:
        fluxon_py = importlib.import_module("fluxon_py")
        from fluxon_py.tool import import_fluxon_pyo3_local

        with _environment_kept("LD_LIBRARY_PATH"):
            pyo3 = import_fluxon_pyo3_local()  # the package's own loader (RTLD_LOCAL, bundled libs)
    except Exception as exc:  # noqa: BLE001 - ImportError, or the loader's RuntimeError
        tried = []
        for name in ("fluxon_py", "fluxon_pyo3"):
            try:
                spec = importlib.util.find_spec(name)
                tried.append(f"{name} -> {spec.origin if spec else 'not found'}")
            except (ImportError, ValueError) as e:
                tried.append(f"{name} -> {e}")
        raise FluxonImportError(
            f"cannot import fluxon-py with {sys.executable} (normal package resolution: "
            f"{'; '.join(tried)}): {type(exc).__name__}: {exc}. Install it: pip install -e '.[fluxon]' "
            "from the repository root, or bash tools/install_fluxon_deps.sh (fluxon-py and etcd)") from exc
    with _runtime_lock:
        if _runtime_info is None:
            _runtime_info = _describe(fluxon_py, pyo3)
            log.info("fluxon_py %s from %s", _runtime_info["fluxon_py_version"], _runtime_info["fluxon_py_path"])
            for path, digest in _runtime_info["extensions"].items():
                log.info("fluxon_pyo3 extension loaded: %s sha256=%s", path, digest)
            bundled = _runtime_info["bundled_libraries"]
            if bundled:
                log.info("fluxon_pyo3 loaded %d bundled native libraries from %s", len(bundled),
                         os.path.dirname(bundled[0]))
    return fluxon_py


def _describe(fluxon_py: Any, pyo3: Any) -> dict[str, Any]:
    """The Python extension modules of fluxon_pyo3 (normally one .so) as loaded here, plus the
    native libraries bundled beside them (fluxon_pyo3.libs/)."""
    exts: dict[str, Optional[str]] = {}
    bundled: set[str] = set()
    for mod in list(sys.modules.values()):
        path = getattr(mod, "__file__", None) or ""
        if "fluxon_pyo3" in path and path.endswith(".so"):
            exts.setdefault(os.path.realpath(path), None)
    with contextlib.suppress(OSError):
        for line in open("/proc/self/maps"):
            parts = line.split(None, 5)
            path = parts[5].strip() if len(parts) == 6 else ""
            if "fluxon_pyo3" not in path:
                continue
            if "fluxon_pyo3.libs" in path:
                bundled.add(path)
            elif ".so" in os.path.basename(path):
                exts.setdefault(path, None)
    for path in exts:
        try:
            exts[path] = _sha256(path)
        except OSError as exc:
            exts[path] = f"unreadable: {exc}"
    return {
        "fluxon_py_version": getattr(fluxon_py, "__version__", "unknown"),
        "fluxon_py_path": os.path.dirname(os.path.realpath(fluxon_py.__file__)),
        "fluxon_pyo3_path": os.path.realpath(getattr(pyo3, "__file__", "") or ""),
        "extensions": exts,
        "bundled_libraries": sorted(bundled),
    }


def fluxon_runtime_info() -> dict[str, Any]:
    """fluxon_py version and path, and the path and SHA256 of each loaded fluxon_pyo3 library."""
    load_fluxon()
    info = _runtime_info
    if info is None:  # load_fluxon records it before it returns
        raise RuntimeError("fluxon-py loaded but its runtime record is missing")
    return dict(info)
