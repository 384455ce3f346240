"""A script of the repository (an experiment, a tool) loaded as a module, as the tests that run
one do: the experiments' shared modules (``benchlib``) import from ``experiments/``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parent.parent


def load_script(relative: str, name: str) -> ModuleType:
    """The module of ``REPO/relative`` under ``name``, with ``experiments/`` on ``sys.path``."""
    experiments = str(REPO / "experiments")
    if experiments not in sys.path:
        sys.path.insert(0, experiments)
    spec = importlib.util.spec_from_file_location(name, REPO / relative)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
