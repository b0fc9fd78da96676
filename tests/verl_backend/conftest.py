"""The verl tests run in a venv of their own (.ci/verl.sh): verl 0.9 pins transformers<5.11,
the main suite runs the newer transformers. tests/conftest.py leaves this folder out where verl
is not installed; here the shared helpers (tests/_dist.py, tests/_tolerance.py) are put on the
path, and the ``ulysses`` fixture starts the one multi-process launch of the Ulysses tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@pytest.fixture(scope="session")
def ulysses():
    """What each rank of one 2-rank gloo launch returned (``_engine.ulysses_worker``): the
    Ulysses runs of test_verl_engine.py (key ``"text"``) and test_verl_vlm.py (``"vlm"``)."""
    from _dist import spawn
    from _engine import ulysses_worker

    return spawn(ulysses_worker, 2)
