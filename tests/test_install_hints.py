"""Install hints say what works: logitless is not on a package index.

Installing ``logitless[trl]`` by name from an index (what error messages and docs printed)
fails for every user; from a checkout, ``pip install -e '.[trl]'`` installs the extra. Every
hint in the sources, docs, examples and benchmarks installs from the checkout, and names an
extra that pyproject.toml declares.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXT_FILES = [
    p
    for folder in ("src", "docs", "examples", "benchmarks", "tests")
    for p in (ROOT / folder).rglob("*")
    if p.suffix in (".py", ".md", ".sh", ".txt") and "egg-info" not in p.as_posix()
] + [ROOT / "README.md"]


def _hits(pattern: str) -> list[tuple[str, str]]:
    out = []
    for path in TEXT_FILES:
        for match in re.finditer(pattern, path.read_text(errors="replace")):
            out.append((path.relative_to(ROOT).as_posix(), match.group(0)))
    return out


def test_no_hint_installs_logitless_from_an_index():
    # (the pattern is split so that this file does not match itself)
    assert not _hits(r"pip install ['\"]?logit" + r"less\["), "install from a checkout instead"


def test_every_checkout_hint_names_a_declared_extra():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = set(extras["optional-dependencies"])
    hints = _hits(r"pip install -e ['\"]\.\[([a-z,]+)\]")
    assert len(hints) >= 10
    for path, hint in hints:
        names = re.search(r"\[([a-z,]+)\]", hint).group(1).split(",")
        assert set(names) <= declared, f"{path}: {hint} names an undeclared extra"
