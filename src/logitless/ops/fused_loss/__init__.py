"""See :mod:`logitless.ops`."""
