"""``python -m cacheseek --help`` without Hydra: the help text is printed straight from the YAML.

Hydra's ``--help`` composes the whole config and then lists every config group and every option
(``$APP_CONFIG_GROUPS``, ``$HYDRA_CONFIG_GROUPS``) even when the template uses neither; each
listing deep-copies the ConfigStore, which holds a schema per registered backend (about 115
copies: 2.9 of 3.8 s under cProfile; importing the backend modules, without torch, 0.3 s). That
made ``--help`` take 2 s on a shared 2-core machine (more when it is busy). CacheSeek's template
(``hydra.help.template`` in ``conf/config.yaml``) is plain text, so a bare ``--help`` (or ``-h``)
prints it as Hydra would, byte for byte, and imports neither Hydra, nor a backend, nor torch.
``--help`` with overrides, or a template that names a ``$`` field, goes to Hydra.
"""

from __future__ import annotations

import os
import string
import sys
from pathlib import Path
from typing import Optional

import cacheseek

__all__ = ["CONF_DIR", "plain_help", "print_help_if_asked", "version_line"]

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")
HELP_FLAGS = (["--help"], ["-h"])


def plain_help(conf_dir: str = CONF_DIR) -> Optional[str]:
    """The help template of ``config.yaml``, or None when only Hydra can render it."""
    import yaml

    try:
        with open(os.path.join(conf_dir, "config.yaml"), encoding="utf-8") as f:
            template = yaml.safe_load(f)["hydra"]["help"]["template"]
        return string.Template(template).substitute({})  # Hydra's rendering: $$ -> $
    except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError):  # a $FIELD raises KeyError
        return None


VERSION_FLAGS = (["--version"], ["-V"])


def version_line() -> str:
    """``cacheseek X.Y.Z (Hydra A.B.C, torch ...)``: CacheSeek's version first (Hydra's own
    ``--version`` printed only Hydra's); the others as installed, without importing them."""
    from importlib import metadata

    parts = []
    for dist in ("hydra-core", "torch", "telefuser", "fluxon-py"):
        try:
            parts.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            pass
    return f"cacheseek {cacheseek.__version__}" + (f" ({', '.join(parts)})" if parts else "")


def print_help_if_asked(argv: list[str]) -> bool:
    """Print the help (a bare ``--help``) or the version (``--version``) and return True;
    False: run Hydra."""
    if argv in VERSION_FLAGS:
        print(version_line(), flush=True)
        return True
    if argv not in HELP_FLAGS:
        return False
    text = plain_help()
    if text is None:
        return False
    try:
        print(text, flush=True)
    except BrokenPipeError:  # `python -m cacheseek --help | head`, as `cacheseek.cli.main` does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    return True
