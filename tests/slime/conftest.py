"""The slime tests run in a venv of their own (.ci/slime.sh): slime's source
(``../shared/peers/slime``) needs Python 3.12, and the switch megatron-core 0.19 or later
(``GPTModel.forward(output_processor=...)``). Elsewhere (the main suite's Python 3.11 with
megatron-core 0.16) nothing here is collected; where the peers are missing, the tests skip
with that reason. The shared helpers (tests/_dist.py, tests/_tolerance.py,
tests/_megatron_shim.py) and this folder's are put on the path."""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))


def _runs_here() -> bool:
    if sys.version_info < (3, 12):
        return False
    try:
        version = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return False
    from packaging.version import Version

    return Version(version) >= Version("0.19")


collect_ignore_glob = [] if _runs_here() else ["test_*.py"]
