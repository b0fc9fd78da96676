"""The ahead-of-time compile report of every Triton kernel for sm_80, sm_90 and sm_100.

    python benchmarks/triton_compile_report.py [--setup bf16] [--target sm_90] [--check]

Prints one markdown row per kernel, dtype setup, path (the fixed small configuration or the
autotuned ones), configuration and target: registers, spill bytes, shared memory and the
tensor-core instruction family (mma.sync / wgmma / tcgen05, or fma), then the failures on
stderr. No GPU needed; see :mod:`logitless.apps.aot` (it runs there, in a process without
``TRITON_INTERPRET``; results are cached under ``~/.cache/logitless-aot``).
"""

from __future__ import annotations

import os
import subprocess
import sys

if __name__ == "__main__":
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "logitless.apps.aot", "--report", *sys.argv[1:]]
    sys.exit(subprocess.run(cmd, env=env).returncode)
