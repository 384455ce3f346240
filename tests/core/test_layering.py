"""The package is layered: a module imports only from lower layers, at module level.

docs/design.md ("Layout of the code") draws the same table. A function-level import of a
CacheSeek module is how cycles get hidden, so there are none; a backend that needs an optional
third-party package (torch, fluxon-py, telefuser) still imports that lazily.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import cacheseek

PACKAGE = Path(cacheseek.__file__).parent

# Top-level module or subpackage of ``cacheseek`` -> layer. Imports go strictly downward.
LAYERS = {
    "errors": 0, "histogram": 0,
    "sizes": 1, "registry": 1, "kv": 1, "progress": 1, "schema": 1, "weights": 1, "bounded_calls": 1,
    "metric_fields": 1, "hooks": 1,
    "sizing": 2, "namespace": 2, "codecs": 2, "eviction": 2, "transfer": 2, "fluxon": 2, "layout": 2,
    "hydra_errors": 2,
    "metrics": 3, "plan": 3, "integrations": 3, "fluxon_service": 3,
    "runtime": 4, "stores": 4, "prometheus": 4,
    "metrics_server": 5,
    "reuse": 6,
    "workloads": 7, "orchestrator": 7,
    "report": 8, "cli_help": 8, "sweep": 9, "cli": 9, "__main__": 10,
}


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _imports(tree: ast.Module) -> list[tuple[ast.stmt, str, bool]]:
    """(statement, imported cacheseek module, at module level) for every import of cacheseek."""
    top_level = {id(node) for node in tree.body}
    for node in tree.body:  # imports under `if TYPE_CHECKING:` or `try:` at module level count as top level
        if isinstance(node, (ast.If, ast.Try)):
            top_level.update(id(child) for child in ast.walk(node))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "cacheseek":
            names = [f"{node.module}.{a.name}" for a in node.names] if node.module == "cacheseek" else [node.module]
            out += [(node, name, id(node) in top_level) for name in names]
        elif isinstance(node, ast.Import):
            out += [(node, a.name, id(node) in top_level) for a in node.names if a.name.startswith("cacheseek.")]
    return out


MODULES = sorted(PACKAGE.rglob("*.py"))

def _name(path: Path) -> str:
    parts = ("cacheseek",) + path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_every_room_has_a_layer():
    rooms = {_room(_name(p)) for p in MODULES} - {""}
    assert rooms <= LAYERS.keys(), f"add {sorted(rooms - LAYERS.keys())} to LAYERS and docs/design.md"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_go_down_at_module_level(path: Path):
    module = _name(path)
    room = _room(module)
    problems = []
    for node, target, top in _imports(ast.parse(path.read_text(), str(path))):
        where = f"{path.relative_to(PACKAGE)}:{node.lineno} imports {target}"
        if not top:
            problems.append(f"{where} inside a function (move it to the top; a cycle means a type "
                            "lives in the wrong room)")
        other = _room(target)
        if room and other and other != room and LAYERS[other] >= LAYERS[room]:
            problems.append(f"{where}: layer {LAYERS[other]} ({other}) is not below {LAYERS[room]} ({room})")
    assert not problems, "\n".join(problems)


def test_the_checker_sees_a_violation(tmp_path):
    source = "from cacheseek.errors import ConfigError\n\ndef f():\n    from cacheseek.reuse import x\n"
    found = [(target, top) for _, target, top in _imports(ast.parse(source))]
    assert found == [("cacheseek.errors", True), ("cacheseek.reuse", False)]
