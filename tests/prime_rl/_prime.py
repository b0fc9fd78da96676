"""prime-rl's own modules, imported from its vendored source (``../shared/peers/prime-rl``).

prime-rl (v0.8.0, Python 3.12) is not on PyPI. Its ``src`` and its config package's ``src``
(``packages/prime-rl-configs``) go on ``sys.path``: both hold parts of the ``prime_rl``
namespace package, which Python merges. Installed in the suite's venv (.ci/prime_rl.sh): what
the imported modules import (loguru, beartype, jaxtyping, prime-pydantic-config and pydantic,
transformers 5.6.2 as prime-rl pins it, wandb for ``prime_rl.utils.utils``).

Bypassed or stubbed, and why:

- ``prime_rl.trainer.models``'s ``__init__`` imports every model prime-rl ships and, through
  them, torchtitan's main branch (not on PyPI) and CUDA kernels; the package is registered here
  as a bare package of its folder, so ``prime_rl.trainer.models.layers.lm_head`` and
  ``lm_head_gemma`` import alone (they import nothing of the models).
- ``ring_flash_attn``, imported at the top of ``prime_rl.utils.cp`` (for the ring attention
  prime-rl's context parallelism substitutes), needs flash-attn, a CUDA build: a stub module
  with its one imported name, never called by the functions the tests run (``shard_for_cp``,
  ``gather_for_cp``).
- ``torch.compile`` of prime-rl's ``selective_log_softmax`` / ``compute_entropy`` is turned
  off (``torch._dynamo.config.disable``): their code runs eagerly, unchanged; compiling them
  with Inductor on this CPU took longer than the whole suite.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PEER = ROOT.parent / "shared" / "peers" / "prime-rl"
MISSING = None if (PEER / "src" / "prime_rl").is_dir() else f"no vendored prime-rl at {PEER}"


def load() -> types.SimpleNamespace:
    """prime-rl's modules the tests use (``lm_head``, ``lm_head_gemma``, the RL ``loss``, the
    trainer ``configs``, ``cp``)."""
    import importlib

    import torch

    for path in (PEER / "packages" / "prime-rl-configs" / "src", PEER / "src"):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    if "prime_rl.trainer.models" not in sys.modules:
        bare = types.ModuleType("prime_rl.trainer.models")
        bare.__path__ = [str(PEER / "src" / "prime_rl" / "trainer" / "models")]
        sys.modules["prime_rl.trainer.models"] = bare
    if "ring_flash_attn" not in sys.modules:
        stub = types.ModuleType("ring_flash_attn")
        stub.update_ring_flash_attn_params = _not_on_cpu
        sys.modules["ring_flash_attn"] = stub
    torch._dynamo.config.disable = True
    names = {
        "lm_head": "prime_rl.trainer.models.layers.lm_head",
        "gemma": "prime_rl.trainer.models.layers.lm_head_gemma",
        "loss": "prime_rl.trainer.rl.loss",
        "configs": "prime_rl.configs.trainer",
        "cp": "prime_rl.utils.cp",
    }
    return types.SimpleNamespace(**{k: importlib.import_module(v) for k, v in names.items()})


def _not_on_cpu(*args, **kwargs):
    raise RuntimeError("ring_flash_attn is stubbed in these tests (it needs CUDA)")
