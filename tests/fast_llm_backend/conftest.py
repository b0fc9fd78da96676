"""The Fast-LLM tests run in a venv of their own (.ci/fast_llm.sh): Fast-LLM needs Python 3.12
(PEP 695 generics) and is not on PyPI; its source is the vendored peer
``../shared/peers/fast-llm`` (put on ``sys.path`` here), with the two packages its head and
losses import (PyYAML, requests). Without Python 3.12 and those packages (the main suite's
Python 3.11), nothing here is collected; without the peer, the tests skip saying so. The shared
helpers (tests/_tolerance.py) are put on the path.

On a CPU Fast-LLM runs its torch code (Triton's interpreter, which tests/conftest.py turns on
for logitless's kernels, is turned off here). Fast-LLM decorates its loss functions with
``torch.compile``; on this CPU the first call of each would compile for minutes per shape and
dtype. The tests run them eagerly
(``torch._dynamo`` disabled, here and in the spawned ranks): the same Python code, without the
fusion.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
PEER = TESTS.parents[0] / ".." / "shared" / "peers" / "fast-llm"

# Python 3.12 and what Fast-LLM's modules import; the main suite (3.11) collects nothing here
# and changes nothing below.
_USABLE = (
    sys.version_info >= (3, 12)
    and importlib.util.find_spec("yaml") is not None
    and importlib.util.find_spec("requests") is not None
)
collect_ignore = [] if _USABLE else ["test_fast_llm.py", "test_fast_llm_distributed.py"]

if _USABLE:
    os.environ["TORCHDYNAMO_DISABLE"] = "1"  # inherited by the spawned ranks
    # tests/conftest.py runs Triton's interpreter on CPU for logitless's kernels; Fast-LLM would
    # then run its own Triton kernels in it too (its interpreter workaround fails on Triton
    # 3.7). On a CPU Fast-LLM uses its torch code, as it does outside these tests.
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, str(TESTS))
    if PEER.is_dir():
        sys.path.insert(0, str(PEER.resolve()))

    import torch._dynamo

    torch._dynamo.config.disable = True
