"""The layout of all of ``src/logitless`` (DESIGN.md, "Layers"; docs/development.md, "The
layout"): no file import cycle, no import upward through the layers, no function over
:data:`MAX_FUNCTION_LINES` lines of code (its docstring not counted: a public entry point
documents every argument there, which is not a concern to split off).

Read from the sources' syntax trees (every ``import`` / ``from ... import`` statement, at module
level or inside a function), so it runs without any optional package. An import names a module
of the package (``from .x import y`` where ``y`` is a module of ``x``: that module; else ``x``);
the parent packages Python imports on the way are not counted, nor ``importlib`` calls on
strings (the one there, ``apps.aot``, imports the kernel families, a layer below it).

The layers, bottom first; a module may import its own layer and the layers below it:

0. ``transform``, ``types``: the logit transform and the result types;
1. ``contract/`` and ``sampling`` (its public re-export): the checked-call types, the checks,
   the collectives protocol, backend resolution;
2. ``packing``, ``parallel/``, ``advantages``: token layout and parallel groups;
3. ``losses/``, ``accumulation``: per-token loss terms (they never import the ops);
4. ``backends/``: the kernels (the torch tiles; every Triton kernel family, the tile code they
   share, their tables and launcher);
5. ``ops/``: the ops on the checked call (the fused loss is where a head and a loss meet);
6. the public surface: ``logitless/__init__``, ``reference``, ``modules``;
7. ``integrations/`` (their own rules: tests/test_integration_layout.py);
8. ``apps/`` (the CLI, bench, demo, the ahead-of-time compile check) and ``__main__``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from test_integration_layout import _cycle

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "logitless"
MAX_FUNCTION_LINES = 80
# Functions allowed over MAX_FUNCTION_LINES, by "path:name": none today. (integrations/
# megatron.py is being split by another change; it has no function over the limit now.)
LONG_FUNCTION_EXCEPTIONS: set[str] = set()

LAYERS: dict[str, int] = {
    "transform": 0,
    "types": 0,
    "contract": 1,
    "sampling": 1,
    "packing": 2,
    "parallel": 2,
    "advantages": 2,
    "losses": 3,
    "accumulation": 3,
    "backends": 4,
    "ops": 5,
    "": 6,  # logitless/__init__.py
    "reference": 6,
    "modules": 6,
    "integrations": 7,
    "apps": 8,
    "__main__": 8,
}


def _modules(package: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name (``logitless.ops.rows``; a package by its ``__init__``) -> file."""
    found = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _known(name: str, modules) -> str | None:
    """``name`` or its longest prefix that is a module, or None."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str, tree: ast.Module, modules) -> dict[str, int]:
    """The package's modules that ``module`` imports -> the line of the first such import."""
    is_package = modules[module].name == "__init__.py"
    here = module.split(".") if is_package else module.split(".")[:-1]
    found: dict[str, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = here[: len(here) - node.level + 1] if node.level else []
            source = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                target = sub if sub in modules else _known(source, modules)
                if target is not None and target != module:
                    found.setdefault(target, node.lineno)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                target = _known(alias.name, modules)
                if target is not None and target != module:
                    found.setdefault(target, node.lineno)
    return found


def graph(package: Path = PACKAGE) -> dict[str, dict[str, int]]:
    modules = _modules(package)
    return {
        m: imports(m, ast.parse(p.read_text(), filename=str(p)), modules)
        for m, p in modules.items()
    }


def layer(module: str) -> int:
    """The layer of a module (``KeyError``: a new top-level module or folder not placed yet)."""
    return LAYERS[module.split(".")[1] if "." in module else ""]


def upward(edges: dict[str, dict[str, int]]) -> list[str]:
    """Every import of a module of a higher layer."""
    return [
        f"{m}:{line} imports {t} (layer {layer(m)} -> {layer(t)})"
        for m, targets in sorted(edges.items())
        for t, line in sorted(targets.items())
        if layer(t) > layer(m)
    ]


def _docstring_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    first = node.body[0]
    is_doc = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
    return (
        first.end_lineno - first.lineno + 1 if is_doc and isinstance(first.value.value, str) else 0
    )


def long_functions(root: Path = PACKAGE, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``path:name (N lines)`` of every function (methods and nested ones too) longer than
    ``limit`` lines, from its first decorator to its last line, its docstring left out."""
    out = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                lines = node.end_lineno - first + 1 - _docstring_lines(node)
                name = f"{path.relative_to(root).as_posix()}:{node.name}"
                if lines > limit and name not in LONG_FUNCTION_EXCEPTIONS:
                    out.append(f"{name} ({lines} lines)")
    return out


EDGES = graph()


def test_the_layout_is_read():
    """The reader sees the modules and the imports the checks are about, function-level ones
    and ``from . import x`` included."""
    assert {"logitless.contract.head", "logitless.backends.triton_launch"} <= set(EDGES)
    assert "logitless.contract.collectives" in EDGES["logitless.contract.vocab"]
    assert "logitless.backends.triton_divergence" in EDGES["logitless.backends"]  # in a def
    assert "logitless.ops.logprobs.compiled" in EDGES["logitless.ops.logprobs.op"]  # in a def
    assert "logitless.contract.fingerprint" in EDGES["logitless.contract._traced"]


def test_every_module_has_a_layer():
    missing = sorted(m for m in EDGES if not _placed(m))
    assert missing == [], f"place these in LAYERS (and in docs/development.md): {missing}"


def _placed(module: str) -> bool:
    try:
        layer(module)
    except KeyError:
        return False
    return True


def test_no_import_cycle_in_src():
    cycle = _cycle({m: set(t) for m, t in EDGES.items()})
    assert cycle is None, " -> ".join(cycle or [])


def test_no_upward_import_in_src():
    assert upward(EDGES) == []


def test_no_function_over_the_limit():
    assert long_functions() == []


@pytest.mark.parametrize(
    "module, source, expected",
    [
        # the cycle issue 39 found: contract/_traced.py <-> contract/collectives.py (which
        # imports _traced inside signature())
        ("_traced", "from logitless.contract.collectives import fingerprint\n", "cycle"),
        # the upward import it found: a kernel module (then backends/aot.py) reaching into
        # ops/divergence
        ("launch", "def f():\n    from ..ops.divergence import function\n", "upward"),
    ],
)
def test_the_checks_reject_the_old_layout(tmp_path, module, source, expected):
    """Each check fails on the shapes it forbids: the code as it was before issue 39, written
    into a copy of the package's layout."""
    copy = tmp_path / "logitless"
    for name in ("contract/_traced.py", "contract/collectives.py", "backends/triton_launch.py"):
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        (copy / name).write_text((PACKAGE / name).read_text())
    (copy / "ops" / "divergence").mkdir(parents=True)
    (copy / "ops" / "divergence" / "function.py").write_text("")
    target = {"_traced": "contract/_traced.py", "launch": "backends/triton_launch.py"}[module]
    (copy / target).write_text((copy / target).read_text() + "\n" + source)
    edges = graph(copy)
    cycle = _cycle({m: set(t) for m, t in edges.items()})
    if expected == "cycle":
        assert cycle == [
            "logitless.contract._traced",
            "logitless.contract.collectives",
            "logitless.contract._traced",
        ]
    else:
        assert cycle is None
        assert upward(edges) == [
            f"logitless.backends.triton_launch:"
            f"{len((PACKAGE / target).read_text().splitlines()) + 3} "
            "imports logitless.ops.divergence.function (layer 4 -> 5)"
        ]


def test_the_length_check_rejects_a_long_function(tmp_path):
    """81 lines of code fail, whatever their kind; a long docstring over short code does not."""
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES - 1))
    doc = '    """' + "\n" * (2 * MAX_FUNCTION_LINES) + '    """\n'
    (tmp_path / "m.py").write_text(
        f"@staticmethod\ndef long():\n{body}\n"
        f"def documented():\n{doc}{body}\n"
        f"class C:\n    def method(self):\n{body.replace('    ', '        ')}        pass\n"
    )
    assert long_functions(tmp_path) == [
        f"m.py:long ({MAX_FUNCTION_LINES + 1} lines)",
        f"m.py:method ({MAX_FUNCTION_LINES + 1} lines)",
    ]
    assert long_functions(tmp_path, MAX_FUNCTION_LINES + 1) == []
