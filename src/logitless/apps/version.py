"""The installed logitless version (``logitless --version``, the bench's CSV)."""

from __future__ import annotations

import importlib.metadata


def package_version() -> str:
    """The installed logitless version: package metadata, else ``logitless.__version__``.

    The metadata is read without importing logitless (and so torch): ``--version`` is instant.
    """
    try:
        return importlib.metadata.version("logitless")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        import logitless

        return str(getattr(logitless, "__version__", "unknown"))
