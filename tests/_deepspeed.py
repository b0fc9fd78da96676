"""What the DeepSpeed tests share: the environment DeepSpeed needs on this CPU machine.

DeepSpeed runs on its CPU accelerator (``DS_ACCELERATOR=cpu``) over gloo. On first use it
JIT-builds a shared-memory communication op (about 3 minutes on the 2-core machine, both ranks
building at once); ``TORCH_EXTENSIONS_DIR`` points at a cache the tests own, so the build is
paid once per machine (``LOGITLESS_DS_CACHE`` overrides the place).
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE = Path(os.environ.get("LOGITLESS_DS_CACHE", Path.home() / ".cache" / "logitless-ds"))


def ds_env(rank: int, world: int, port: int) -> None:
    """The variables DeepSpeed and accelerate read in a rank (the gloo group already exists):
    set before deepspeed is imported."""
    CACHE.mkdir(parents=True, exist_ok=True)
    os.environ.update(
        DS_ACCELERATOR="cpu", TORCH_EXTENSIONS_DIR=str(CACHE), RANK=str(rank),
        WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip


#: DeepSpeed's default ``stage3_param_persistence_threshold`` (elements): every parameter of
#: the tests' tiny models is under it.
DEFAULT_PERSISTENCE = 100_000


def zero_config(stage: int, persistence: int | None = 0, **extra) -> dict:
    """A DeepSpeed config of ZeRO ``stage``; under stage 3 with
    ``stage3_param_persistence_threshold=persistence`` (None: DeepSpeed's default). A parameter
    of no more elements is persistent: partitioned until DeepSpeed first gathers it (in its
    module's forward or after an optimizer step), whole on every rank from then on. The default
    0 partitions every parameter; DeepSpeed's own would make all of a tiny model persistent."""
    zero: dict = {"stage": stage}
    if stage == 3 and persistence is not None:
        zero["stage3_param_persistence_threshold"] = persistence
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        **extra,
    }


def assert_partitioned(param) -> None:
    """A ZeRO-3 parameter that really is split over the ranks and not gathered here."""
    assert hasattr(param, "ds_id"), "not a ZeRO-3 parameter"
    assert param.data.numel() == 0, f"gathered: {tuple(param.data.shape)}"
    assert param.ds_tensor.numel() < param.ds_numel, "whole on this rank (persistent)"


def assert_persistent(param) -> None:
    """A persistent ZeRO-3 parameter, whole on this rank (as DeepSpeed keeps it after a step)."""
    assert hasattr(param, "ds_id"), "not a ZeRO-3 parameter"
    assert param.ds_persist, f"not persistent: {param.ds_numel} elements"
    assert param.data.numel() == param.ds_numel, f"partitioned: {tuple(param.data.shape)}"
