"""The integrations' layout (DESIGN.md, "Integrations: one seam"; docs/development.md): no
import cycle among ``src/logitless/integrations/*.py`` (function-level imports included), and
no integration reaching into another one's private names (``hf._run_backbone``,
``from .trl import _Layout``): what one needs of another is a public name of a module they
both import (``hf_model``, ``hf_batch``, ``hf_seam``, ``trl_common``, ``seam``).

Read from the sources' syntax trees, so it runs without TRL, transformers or Megatron.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "logitless" / "integrations"
MODULES = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")


def _tree(module: str) -> ast.Module:
    return ast.parse((PACKAGE / f"{module}.py").read_text(), filename=f"{module}.py")


def _sibling(node: ast.ImportFrom, name: str | None = None) -> str | None:
    """The sibling module an import names (``from .x import ...``, ``from . import x``,
    ``from logitless.integrations.x import ...``), or None."""
    if node.level == 1:
        return node.module.split(".")[0] if node.module else name
    prefix = "logitless.integrations."
    if node.level == 0 and node.module and node.module.startswith(prefix):
        return node.module[len(prefix) :].split(".")[0]
    if node.level == 0 and node.module == "logitless.integrations":
        return name
    return None


class _SiblingImport(NamedTuple):
    sibling: str  # the integration module imported from
    name: str  # the name taken from it, "*" for the module itself
    local: str | None  # the local name the module itself is bound to, else None
    line: int


def _sibling_imports(tree: ast.Module) -> Iterator[_SiblingImport]:
    """Every import of a sibling module or of a name from one, wherever the import statement
    sits (a function-level import is an import)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                sibling = _sibling(node, alias.name)
                if sibling is None or sibling not in MODULES:
                    continue
                if not node.module or node.module == "logitless.integrations":  # the module
                    yield _SiblingImport(sibling, "*", alias.asname or alias.name, node.lineno)
                else:
                    yield _SiblingImport(sibling, alias.name, None, node.lineno)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[:2] == ["logitless", "integrations"] and len(parts) > 2:
                    yield _SiblingImport(parts[2], "*", alias.asname, node.lineno)


def imports(tree: ast.Module) -> dict[str, set[str]]:
    """Sibling module -> the names a module takes from it (``*`` for the module itself)."""
    found: dict[str, set[str]] = {}
    for imp in _sibling_imports(tree):
        found.setdefault(imp.sibling, set()).add(imp.name)
    return found


def private_uses(tree: ast.Module) -> list[str]:
    """``sibling._name`` attribute reads and ``from .sibling import _name`` in a module."""
    aliases: dict[str, str] = {}  # the local name of an imported sibling module -> its name
    uses = []
    for imp in _sibling_imports(tree):
        if imp.local is not None:
            aliases[imp.local] = imp.sibling
        elif imp.name.startswith("_"):
            uses.append(f"from {imp.sibling} import {imp.name} (line {imp.line})")
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


def test_the_layout_is_read():
    """The reader sees what is there: the modules, and the imports the layout is made of."""
    assert {"hf", "hf_batch", "hf_model", "hf_seam", "seam", "trl", "trl_common"} <= set(MODULES)
    assert "trl_distillation" in imports(_tree("trl"))  # trl re-exports the distillation trainer
    assert {"hf_model", "trl_common"} <= set(imports(_tree("trl")))
    assert "trl_common" in imports(_tree("trl_distillation"))


def test_no_import_cycle_among_the_integrations():
    graph = {m: set(imports(_tree(m))) - {m} for m in MODULES}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_trl_distillation_does_not_import_trl():
    """What both TRL trainers need lives in trl_common; trl imports trl_distillation one way."""
    assert "trl" not in imports(_tree("trl_distillation"))


@pytest.mark.parametrize("module", MODULES)
def test_no_private_name_of_another_integration(module):
    """``hf._run_backbone``, ``hf._with_head``, ``from .trl import _Layout``: each was one
    integration reaching into another; what is shared is a public name of its own module."""
    assert private_uses(_tree(module)) == []


def test_trl_common_imports_neither_trl_nor_transformers():
    """Both trainers import it; it must not need what only one of them needs."""
    tops = set()
    for node in ast.walk(_tree("trl_common")):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            tops.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            tops |= {alias.name.split(".")[0] for alias in node.names}
    assert not tops & {"trl", "transformers", "accelerate"}, tops


def test_the_checks_reject_the_old_layout():
    """Each check fails on the shapes it forbids (the code as it was before issue 31)."""
    graph = {"trl": {"trl_distillation", "hf"}, "trl_distillation": {"trl", "hf"}, "hf": set()}
    assert _cycle(graph) == ["trl", "trl_distillation", "trl"]
    old = ast.parse(
        "from . import hf\n"
        "def f(lm):\n"
        "    from .trl import _Layout, completion_batch\n"
        "    return hf._run_backbone(lm), hf.check_model(lm)\n"
    )
    assert private_uses(old) == ["from trl import _Layout (line 3)", "hf._run_backbone (line 4)"]
    assert imports(old) == {"hf": {"*"}, "trl": {"_Layout", "completion_batch"}}
