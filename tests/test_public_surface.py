"""Tests use the product's public surface (issue 35): a test that reads, sets or patches a private
name of a `cacheseek` object freezes that internal, so a refactor that keeps every behaviour still
breaks tests. Reads go through public read-only properties or the public API, faults through the
fakes (tests/fakes) or a public seam.

The check parses every file under tests/ and reports each private name of the product that a test
reaches: ``obj._name`` (not on ``self``, ``cls`` or ``super()``: that is the test-local class's or
the fake's own state), ``from cacheseek... import _name`` and ``setattr(obj, "_name", ...)``-style
calls (monkeypatch included). A private name is one the product defines under cacheseek/ or tools/
(a ``_name`` function, class, module-level or class-level name, a ``self._name`` attribute, or a
name it sets with ``setattr``); private names of other packages (torch, TeleFuser and the test
doubles of TeleFuser) are not the product's and are not counted. ``ALLOWED`` lists the few left,
each with its reason; an entry no longer needed fails too, so the list only shrinks."""

from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
PRODUCT = [REPO / "cacheseek", REPO / "tools"]  # the package and the tools it ships
HYDRA_KEYS = {"_target_", "_partial_", "_args_", "_recursive_", "_convert_"}  # public config keys
NAMED_BY_STRING = {"setattr", "getattr", "hasattr", "delattr"}  # also monkeypatch.setattr/delattr

_HOOK = "a transfer runtime's subclass hook (cacheseek/transfer/base.py lists them), wrapped or called to " \
        "reach one runtime's own behaviour: a test that widens a race window or submits without the cut reaches it"
# (test file, private name): why it is still reached
ALLOWED: dict[tuple[str, str], str] = {
    ("tests/layouts/test_telefuser_main_layout.py", "_get_streaming_runtime"):
        "TeleFuser main's own method (how its service streams a live session; the double mirrors it), "
        "not CacheSeek's: listed only because StreamingHooks keeps TeleFuser's original under that name",
    ("tests/plan/test_register_pieces.py", "_submit"): _HOOK,
    ("tests/plan/test_transfer_conformance.py", "_register_one"): _HOOK,
}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name not in HYDRA_KEYS


@lru_cache(maxsize=1)
def product_privates() -> frozenset[str]:
    """Every private name the product defines, anywhere under cacheseek/."""
    names: set[str] = set()
    for path in (p for root in PRODUCT for p in root.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        strings = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
                   and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str) for t in n.targets
                   if isinstance(t, ast.Name)}  # a constant naming the attribute, as in setattr(x, _ATTR, v)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and len(node.args) >= 2 and _callee(node) in ("setattr", "__setattr__"):
                arg = node.args[1]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    names.add(arg.value)
                elif isinstance(arg, ast.Name) and arg.id in strings:
                    names.add(strings[arg.id])
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                names.add(node.attr)
    return frozenset(n for n in names if _private(n))


def product_modules() -> set[str]:
    """The top-level names a test imports the product by: the package and each tool."""
    return {"cacheseek", "tools"} | {p.stem for p in (REPO / "tools").glob("*.py")}


def _callee(call: ast.Call) -> str | None:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


def _on_own_state(node: ast.Attribute) -> bool:
    """``self._x``, ``cls._x`` and ``super()._x``: the test-local class's or the fake's own state
    (a fake that subclasses a product class overrides its documented subclass hooks)."""
    v = node.value
    if isinstance(v, ast.Name):
        return v.id in ("self", "cls")
    return isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "super"


def reached(path: Path) -> list[tuple[int, str]]:
    """(line, private product name) of each reach into the product's privates in one test file."""
    privates = product_privates()
    hits = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr in privates and not _on_own_state(node):
            hits.append((node.lineno, node.attr))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in product_modules():
            hits += [(node.lineno, a.name) for a in node.names if _private(a.name)]
        elif isinstance(node, ast.Call) and len(node.args) >= 2:
            arg = node.args[1]
            if (_callee(node) in NAMED_BY_STRING and isinstance(arg, ast.Constant) and isinstance(arg.value, str)
                    and arg.value in privates):
                hits.append((node.lineno, arg.value))
    return sorted(hits)


def all_reaches() -> dict[tuple[str, str], list[int]]:
    found: dict[tuple[str, str], list[int]] = {}
    for path in sorted(TESTS.rglob("*.py")):
        rel = str(path.relative_to(REPO))
        for line, name in reached(path):
            found.setdefault((rel, name), []).append(line)
    return found


def test_no_test_reaches_a_private_name_of_the_product():
    found = all_reaches()
    new = [f"{rel}:{lines[0]}: {name} (use a public property or API; a fault goes through tests/fakes)"
           for (rel, name), lines in sorted(found.items()) if (rel, name) not in ALLOWED]
    assert new == []


def test_the_allowlist_holds_only_what_is_still_reached():
    found = all_reaches()
    assert sorted(k for k in ALLOWED if k not in found) == []


def test_the_check_sees_each_kind_of_reach(tmp_path):
    """The check can fail: each form of reach in a sample file is found, own state is not."""
    privates = product_privates()
    assert {"_quantized_blocks", "_Keys", "_SCALE", "_cacheseek_hooks"} <= privates and "_target_" not in privates
    sample = tmp_path / "test_sample.py"
    sample.write_text(
        "from cacheseek.reuse.exact_prefix.actions import _quantized_blocks\n"
        "def test_x(monkeypatch, store):\n"
        "    store._keys.thread\n"
        "    monkeypatch.setattr(store, '_SCALE', 2)\n"
        "    store._not_a_product_name\n"
        "    cfg._target_\n"
        "class Fake:\n"
        "    def f(self):\n"
        "        return self._keys\n")
    assert reached(sample) == [(1, "_quantized_blocks"), (3, "_keys"), (4, "_SCALE")]
