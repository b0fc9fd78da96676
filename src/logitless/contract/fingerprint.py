"""The process-independent fingerprint of Python values that the ranks compare
(:func:`~logitless.contract.collectives.signature`); a module of its own so that the compiled
path's constant (:mod:`._traced`) and the collectives both import it, neither the other."""

from __future__ import annotations

import zlib


def fingerprint(parts: tuple[object, ...]) -> int:
    """A 31-bit fingerprint of ``parts`` (``hash`` is salted per process), eagerly."""
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF
