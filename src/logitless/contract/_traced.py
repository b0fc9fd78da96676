"""What only compiled code imports: marking a function constant imports ``torch._dynamo``,
which is already loaded whenever this module is (see :func:`collectives.signature`)."""

from __future__ import annotations

import torch

from logitless.contract.fingerprint import fingerprint


@torch.compiler.assume_constant_result
def constant_fingerprint(*parts: object) -> int:
    """:func:`~logitless.contract.fingerprint.fingerprint`, a constant of the traced code."""
    return fingerprint(parts)
