"""LogitlessGRPOTrainer against the real TRL GRPOTrainer on 2 gloo ranks (CPU), as accelerate
launches them: DDP, and FSDP2 (tied and untied heads).

Each rank runs, in turn, ``trl.GRPOTrainer`` and ``LogitlessGRPOTrainer`` with the same
options (generation with ``model.generate``, rewards, 2 iterations of the batch, gradient
accumulation 2, 2 optimizer steps): the logged losses and metrics and the final weights must be
the same (tests/_trl.py's ``assert_same_run``). The ranks see different prompts, so a run
whose gradients were not reduced ends with other weights: calling the unwrapped model instead
of running inside the wrapper's forward fails the comparison (``test_bypassing_...``).

FSDP2 on CPU: accelerate only takes its FSDP path on accelerators, so after building each
trainer the test sets the accelerator's distributed type to FSDP with an FSDP2 plugin (layers
and root sharded, ``reshard_after_forward``) and marks the trainer FSDP-enabled; the model is
then sharded by accelerate's own ``fsdp2_prepare_model`` when ``train()`` prepares it.
"""

from __future__ import annotations

import os

import pytest
import torch
from _dist import spawn

trl = pytest.importorskip(
    "trl", reason="TRL is not installed (pip install -e '.[trl]' in a logitless checkout)"
)
transformers = pytest.importorskip("transformers")

import _trl as T  # noqa: E402  (the shared TRL harness: models, data, trainers, comparisons)

WORLD = 2


def _accelerate_env(rank: int, world: int) -> None:
    """The variables accelerate reads to see a multi-process run (the group already exists)."""
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="29500",
    )  # fmt: skip


def _force_fsdp2(trainer) -> None:
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    layer = type(trainer.model.model.layers[0]).__name__
    state = trainer.accelerator.state
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=[layer],
        reshard_after_forward=True,
        state_dict_type="FULL_STATE_DICT",
    )
    trainer.is_fsdp_enabled = True


def _bypass_wrappers() -> None:
    """What logitless did before: call the unwrapped model, outside the wrapper's forward."""
    from logitless.integrations import hf, wrappers
    from logitless.integrations.hf import functions

    def bypass(model, fn, *a, **k):
        return fn(wrappers.unwrap(model).model, *a, **k)

    hf.run_in_forward = functions.run_in_forward = bypass  # the trainers' and the HF functions'


def _worker(rank: int, world: int, model_dir: str, kind: str, tmp: str, options: dict, bypass):
    _accelerate_env(rank, world)
    from logitless.integrations.trl import LogitlessGRPOTrainer

    T.TOKENIZERS[model_dir] = T.make_tokenizer()
    if bypass:
        _bypass_wrappers()
    out = {}
    for name, cls in (("stock", trl.GRPOTrainer), ("ours", LogitlessGRPOTrainer)):
        args = T.grpo_args(_path(tmp, f"{name}{rank}"), **(T.RUN | options))
        trainer = T.grpo_trainer(cls, model_dir, args)
        if kind == "fsdp2":
            _force_fsdp2(trainer)
        trainer.train()
        assert trainer.accelerator.num_processes == world
        wrapped = type(trainer.model_wrapped).__name__
        assert wrapped == ("DistributedDataParallel" if kind == "ddp" else "FSDPQwen2ForCausalLM")
        params = {
            n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in trainer.model.named_parameters()
        }
        out[name] = (trainer.state.log_history, params)
    return out


def _path(tmp: str, name: str):
    from pathlib import Path

    return Path(tmp) / name


def _run(tmp_path, kind: str, tied: bool, options: dict | None = None, bypass: bool = False):
    model_dir = T.save_model(tmp_path / "model", tied=tied)
    args = (model_dir, kind, str(tmp_path), options or {}, bypass)
    return model_dir, spawn(_worker, WORLD, *args, threads=1, timeout_s=120.0)


CASES = [
    pytest.param("ddp", False, {}, id="ddp-untied-dapo"),
    pytest.param(
        "ddp",
        True,
        {"loss_type": "grpo", "beta": 0.05, "entropy_coef": 0.01, "gradient_checkpointing": True},
        id="ddp-tied-grpo_kl_entropy_checkpointing",
    ),
    pytest.param("fsdp2", False, {}, id="fsdp2-untied-dapo"),
    pytest.param(
        "fsdp2", True, {"beta": 0.05, "gradient_checkpointing": True}, id="fsdp2-tied-dapo_kl_ckpt"
    ),
]


@pytest.mark.parametrize(("kind", "tied", "options"), CASES)
def test_train_matches_trl_on_two_ranks(kind, tied, options, tmp_path):
    model_dir, ranks = _run(tmp_path, kind, tied, options)
    for r in ranks:
        moved = T.assert_same_run(*r["stock"], *r["ours"], T.initial(model_dir))
        assert moved > 0
    for name, p in ranks[0]["ours"][1].items():  # the ranks hold one model
        torch.testing.assert_close(ranks[1]["ours"][1][name], p, rtol=0, atol=0, msg=name)


def test_bypassing_the_wrapper_is_caught(tmp_path):
    model_dir, ranks = _run(tmp_path, "ddp", False, bypass=True)
    with pytest.raises(AssertionError):
        for r in ranks:
            T.assert_same_run(*r["stock"], *r["ours"], T.initial(model_dir))


# --------------------------------------------------------------------------------------------
# the distillation trainer: stock vs logitless on 2 ranks (a wider teacher, JSD, temperature)


def _distill_worker(rank: int, world: int, student: str, teacher: str, kind: str, tmp: str):
    _accelerate_env(rank, world)
    from logitless.integrations.trl import LogitlessDistillationTrainer

    T.TOKENIZERS[student] = T.make_tokenizer()
    out = {}
    for name, cls in (("stock", trl.DistillationTrainer), ("ours", LogitlessDistillationTrainer)):
        trainer = T.distill_trainer(cls, student, teacher, _path(tmp, f"{name}{rank}"))
        if kind == "fsdp2":
            _force_fsdp2(trainer)
        trainer.train()
        params = {
            n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in trainer.model.named_parameters()
        }
        out[name] = (trainer.state.log_history, params)
    return out


@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_distillation_matches_trl_on_two_ranks(kind, tmp_path):
    student = T.save_model(tmp_path / "student")
    teacher = T.save_model(tmp_path / "teacher", width=24)
    args = (student, teacher, kind, str(tmp_path))
    ranks = spawn(_distill_worker, WORLD, *args, threads=1, timeout_s=120.0)
    for r in ranks:
        assert T.assert_same_run(*r["stock"], *r["ours"], T.initial(student)) > 0
