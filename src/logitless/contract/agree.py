"""The one "check, then agree across ranks" rule of collective calls.

A collective call must be made by every rank of its group whatever its own inputs: a rank
whose check failed still joins the agreement (with its error), and every other rank learns from
it that some rank failed and raises too, instead of waiting in the next collective. The
agreement itself is the caller's collective (``VocabParallel.agree``,
``parallel.collectives.agree``): it raises the error on the rank that had it and a
``ValueError`` on the others.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def check_then_agree(
    check: Callable[[], T], agree: Callable[[T | None, ValueError | None], R]
) -> tuple[T, R]:
    """``(check(), agree(result, None))``; when ``check`` raises ``ValueError``, ``agree`` is
    called with ``(None, error)`` all the same (and must raise)."""
    result, error = None, None
    try:
        result = check()
    except ValueError as e:
        error = e
    agreed = agree(result, error)
    if error is not None:  # agree should have raised it; never return a failed check
        raise error
    return result, agreed
