"""``import logitless`` stays light: the compiler stack (``torch._dynamo``, 1.5 s to import on
2 cores) loads only when something is compiled."""

from __future__ import annotations

import subprocess
import sys


def test_import_does_not_load_the_compiler():
    code = (
        "import sys, logitless, logitless.integrations.hf, logitless.parallel;"
        "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
