"""Every ``>>>`` example in ``src/logitless`` runs and prints what it says (one test each).

Modules are found by walking the package, so a new module's examples run without being listed
here. A module that cannot be imported, or an example that cannot run, for want of an optional
dependency (transformers, triton) is skipped, naming the dependency.
"""

from __future__ import annotations

import doctest
import importlib
import io
import pkgutil

import pytest

import logitless

# ``python -m logitless`` runs the command line when imported: it holds no examples.
NOT_IMPORTED = {"logitless.__main__"}


def _missing_dependency(exc: BaseException | None) -> str | None:
    """The optional package whose absence caused ``exc`` (or its causes), if any."""
    while exc is not None:
        if isinstance(exc, ModuleNotFoundError) and exc.name:
            top = exc.name.split(".")[0]
            if top != "logitless":
                return top
        exc = exc.__cause__ or exc.__context__
    return None


def _collect() -> list:
    """One ``pytest.param`` per non-empty doctest of every module of the package, and a skipped
    one per module that needs an optional dependency which is not installed."""
    modules = [m.name for m in pkgutil.walk_packages(logitless.__path__, "logitless.")]
    params = []
    finder = doctest.DocTestFinder(exclude_empty=True)
    for name in sorted({"logitless", *modules} - NOT_IMPORTED):
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            missing = _missing_dependency(exc)
            if missing is None:
                raise
            reason = f"{name} needs {missing}, which is not installed"
            params.append(pytest.param(None, id=name, marks=pytest.mark.skip(reason=reason)))
            continue
        for test in sorted(finder.find(module, name), key=lambda t: t.name):
            if test.examples:
                params.append(pytest.param(test, id=test.name))
    return params


DOCTESTS = _collect()


class _Runner(doctest.DocTestRunner):
    """A doctest runner that also records which optional dependency an example lacked."""

    def __init__(self) -> None:
        super().__init__(verbose=False)
        self.missing: set[str] = set()

    def report_unexpected_exception(self, out, test, example, exc_info) -> None:
        missing = _missing_dependency(exc_info[1])
        if missing is not None:
            self.missing.add(missing)
        super().report_unexpected_exception(out, test, example, exc_info)


def test_examples_are_found():
    """The walk reaches the modules known to hold examples (a broken walk would pass empty)."""
    ids = {p.id for p in DOCTESTS}
    for name in ("logitless.ops.logprobs.op", "logitless.packing", "logitless.modules"):
        assert any(i == name or i.startswith(name + ".") for i in ids), f"no doctest in {name}"


@pytest.mark.parametrize("test", DOCTESTS)
def test_doctest(test: doctest.DocTest):
    out = io.StringIO()
    runner = _Runner()
    result = runner.run(test, out=out.write)
    if runner.missing:
        pytest.skip(f"{test.name} needs {', '.join(sorted(runner.missing))}, not installed")
    assert result.failed == 0, f"{test.name}:\n{out.getvalue()}"
