"""The SkyRL tests run in a venv of their own (.ci/skyrl.sh): ``skyrl`` 0.4 needs Python 3.12
and megatron-core 0.19. Without skyrl installed (the main suite's Python 3.11), nothing here is
collected; with it, the shared helpers (tests/_dist.py, tests/_tolerance.py,
tests/_megatron_shim.py) are put on the path."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

collect_ignore = [] if importlib.util.find_spec("skyrl") else ["test_skyrl.py"]
