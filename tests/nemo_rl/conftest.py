"""tests/nemo_rl/: logitless as NeMo RL's fused-linear-logprobs backend, against NeMo RL's own
code (the vendored checkout in ../shared/peers/nemo-rl), in .venv-nemo-rl (.ci/nemo_rl.sh)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PEER = ROOT.parent / "shared" / "peers" / "nemo-rl"
sys.path.insert(0, str(ROOT / "tests"))  # _dist, _megatron_shim, _tolerance
sys.path.insert(0, str(Path(__file__).resolve().parent))

if not PEER.is_dir():
    pytest.skip(f"NeMo RL's source is not at {PEER} (../shared/peers)", allow_module_level=True)
sys.path.insert(0, str(PEER))
