"""The verl tests run in a venv of their own (.ci/verl.sh): verl 0.9 pins transformers<5.11,
the main suite runs the newer transformers. tests/conftest.py leaves this folder out where verl
is not installed; here the shared helpers (tests/_dist.py, tests/_tolerance.py) are put on the
path."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
