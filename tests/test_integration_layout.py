"""The integrations' layout (DESIGN.md, "Integrations: one seam"; docs/development.md): one
seam every trainer goes through, one module or package per trainer.

- ``integrations/seam.py`` is the one integration module that imports ``logitless.ops``;
  every trainer reaches the ops through it (its two phases: prepare, then the head).
- No import cycle among the integration modules (packages walked whole, function-level
  imports included).
- No integration reaching into another one's private names (``hf._run_backbone``,
  ``from .trl import _Layout``): what one needs of another is a public name of a module they
  both import (``hf.model``, ``hf.batch``, ``trl.common``, ``seam``).
- Fewer top-level integration modules, and fewer imports among them, than the flat layout
  had before the packages (14 files, 32 imports).

Read from the sources' syntax trees, so it runs without TRL, transformers or Megatron.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "logitless" / "integrations"
PREFIX = "logitless.integrations."


def _name(path: Path) -> str:
    """An integration module's dotted name below ``integrations`` (a package by its
    ``__init__``: ``hf``; a module in it: ``hf.model``)."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


FILES = {_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if p != PACKAGE / "__init__.py"}
MODULES = sorted(FILES)
# The flat layout before the packages (issue 48): its top-level modules and their imports,
# and the integrations it held (the trainers added since are not in that count).
FLAT_MODULES, FLAT_IMPORTS = 14, 32
FLAT_INTEGRATIONS = {"deepspeed", "hf", "megatron", "seam", "skyrl", "trl", "verl", "wrappers"}


def _tree(module: str) -> ast.Module:
    return ast.parse(FILES[module].read_text(), filename=str(FILES[module]))


def _is_package(module: str) -> bool:
    return FILES[module].name == "__init__.py"


def _absolute(module: str, node: ast.ImportFrom) -> str | None:
    """The absolute dotted name an ``ImportFrom`` imports from (below ``logitless``), or None
    for an import from outside logitless."""
    if node.level == 0:
        name = node.module or ""
        return name if name == "logitless" or name.startswith("logitless.") else None
    base = (PREFIX + module).split(".")
    if not _is_package(module):
        base.pop()  # a module's package
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _integration(name: str) -> str | None:
    """The integration module ``name`` (absolute) is, or lies in; None outside them."""
    if not name.startswith(PREFIX):
        return None
    parts = name[len(PREFIX) :].split(".")
    while parts and ".".join(parts) not in FILES:
        parts.pop()
    return ".".join(parts) or None


class _Import(NamedTuple):
    target: str  # the absolute module (or package) imported from, below logitless
    name: str  # the name taken from it ("*": the module itself)
    local: str | None  # the local name a module is bound to, else None
    line: int


def _imports(module: str, tree: ast.Module | None = None) -> Iterator[_Import]:
    """Every ``import`` / ``from ... import`` of ``module`` (its source, or ``tree`` read as
    if it were ``module``'s) from logitless, wherever the statement sits (a function-level
    import is an import); ``from . import x`` of a submodule names the submodule."""
    for node in ast.walk(_tree(module) if tree is None else tree):
        if isinstance(node, ast.ImportFrom):
            source = _absolute(module, node)
            if source is None:
                continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                if _integration(sub) == sub[len(PREFIX) :]:
                    yield _Import(sub, "*", alias.asname or alias.name, node.lineno)
                else:
                    yield _Import(source, alias.name, None, node.lineno)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("logitless"):
                    yield _Import(alias.name, "*", alias.asname, node.lineno)


def imports(module: str, tree: ast.Module | None = None) -> dict[str, set[str]]:
    """Integration module -> the names ``module`` takes from it (``*`` for the module)."""
    found: dict[str, set[str]] = {}
    for imp in _imports(module, tree):
        target = _integration(imp.target)
        if target is not None and target != module:
            found.setdefault(target, set()).add(imp.name)
    return found


def imports_ops(module: str, tree: ast.Module | None = None) -> list[str]:
    """The imports of ``module`` from ``logitless.ops`` (``ops.x.op`` at line n)."""
    return [
        f"{imp.target} (line {imp.line})"
        for imp in _imports(module, tree)
        if imp.target == "logitless.ops" or imp.target.startswith("logitless.ops.")
    ]


def private_uses(module: str, tree: ast.Module | None = None) -> list[str]:
    """``sibling._name`` attribute reads and ``from .sibling import _name`` of another
    integration module."""
    tree = _tree(module) if tree is None else tree
    aliases: dict[str, str] = {}  # a local name bound to an integration module -> its name
    uses = []
    for imp in _imports(module, tree):
        target = _integration(imp.target)
        if target is None or target == module:
            continue
        if imp.local is not None:
            aliases[imp.local] = target
        elif imp.name.startswith("_") and not imp.name.startswith("__"):
            uses.append(f"from {target} import {imp.name} (line {imp.line})")
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            uses.append(f"{aliases[node.value.id]}.{node.attr} (line {node.lineno})")
    return uses


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (module -> the modules it imports), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def _top(module: str) -> str:
    return module.split(".")[0]


def test_the_layout_is_read():
    """The reader sees what is there: the packages walked whole, and the imports the layout
    is made of."""
    assert {"seam", "hf", "hf.model", "hf.forward", "trl", "trl.grpo", "trl.common"} <= set(MODULES)
    assert {"megatron", "megatron.model", "megatron.layout", "megatron.gradients"} <= set(MODULES)
    assert {"hf.model", "trl.common", "seam"} <= set(imports("trl.grpo"))
    assert "trl.common" in imports("trl.distillation")
    assert imports_ops("seam")


def test_only_the_seam_imports_the_ops():
    """Every trainer reaches the ops through the seam's two phases."""
    importers = {m: imports_ops(m) for m in MODULES if imports_ops(m)}
    assert set(importers) == {"seam"}, importers


def test_no_import_cycle_among_the_integrations():
    graph = {m: set(imports(m)) for m in MODULES}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_fewer_top_level_modules_and_imports_than_the_flat_layout():
    """One module or package per trainer: the integrations the flat layout held are fewer
    entries at the top of ``integrations/``, with fewer imports between them, than its 14
    files and their 32 imports (a trainer added since brings its own module or package and
    its imports of the seam)."""
    old = [m for m in MODULES if _top(m) in FLAT_INTEGRATIONS]
    tops = {_top(m) for m in old}
    between = {(m, t) for m in old for t in imports(m) if _top(t) != _top(m)}
    assert tops == FLAT_INTEGRATIONS, sorted(tops)
    assert len(tops) < FLAT_MODULES, sorted(tops)
    assert len(between) < FLAT_IMPORTS, sorted(between)


def test_trl_distillation_does_not_import_the_grpo_trainer():
    """What both TRL trainers need lives in trl.common; the package imports both one way."""
    assert "trl.grpo" not in imports("trl.distillation")


@pytest.mark.parametrize("module", MODULES)
def test_no_private_name_of_another_integration(module):
    """``hf._run_backbone``, ``hf._with_head``, ``from .trl import _Layout``: each was one
    integration reaching into another; what is shared is a public name of its own module."""
    assert private_uses(module) == []


def test_trl_common_imports_neither_trl_nor_transformers():
    """Both trainers import it; it must not need what only one of them needs."""
    tops = set()
    for node in ast.walk(_tree("trl.common")):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            tops.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            tops |= {alias.name.split(".")[0] for alias in node.names}
    assert not tops & {"trl", "transformers", "accelerate"}, tops


def test_the_checks_reject_the_old_layout():
    """Each check fails on the shapes it forbids (the code as it was before issues 31 and 48)."""
    graph = {"trl": {"trl_distillation", "hf"}, "trl_distillation": {"trl", "hf"}, "hf": set()}
    assert _cycle(graph) == ["trl", "trl_distillation", "trl"]
    old = ast.parse(
        "from .. import hf\n"
        "from ...ops.logprobs.op import linear_logprobs\n"
        "def f(lm):\n"
        "    from ..trl.grpo import _Layout, completion_batch\n"
        "    return hf._run_backbone(lm), hf.check_model(lm)\n"
    )
    # read as if it were trl/distillation.py
    assert private_uses("trl.distillation", old) == [
        "from trl.grpo import _Layout (line 4)",
        "hf._run_backbone (line 5)",
    ]
    assert imports("trl.distillation", old) == {
        "hf": {"*"},
        "trl.grpo": {"_Layout", "completion_batch"},
    }
    assert imports_ops("trl.distillation", old) == ["logitless.ops.logprobs.op (line 2)"]
