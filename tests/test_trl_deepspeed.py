"""Both TRL trainers against stock TRL under accelerate's DeepSpeed plugin, 2 gloo ranks on
DeepSpeed's CPU accelerator: ZeRO stages 2 and 3, tied and untied heads.

Each rank runs, in turn, the stock trainer and the logitless one with the same options and the
same DeepSpeed config (``GRPOConfig(deepspeed=...)``; under stage 3 every parameter is
partitioned, ``stage3_param_persistence_threshold=0``, and the head is asserted partitioned
after training): the logged losses and metrics and every parameter after 2 ``train()`` steps
must be the same (tests/test_trl.py's ``assert_same_run``, the tolerance the DDP and FSDP2 runs
are held to). The ranks see different prompts, so gradients that were not reduced end in other
weights. The early-close mutation of tests/test_deepspeed.py makes the distillation trainer's
backward fail (its divergence reads the weight again in backward).
"""

from __future__ import annotations

import pytest
import torch
from _deepspeed import assert_partitioned, ds_env, zero_config
from _dist import spawn

pytest.importorskip("deepspeed", reason="pip install -e '.[deepspeed]' in a logitless checkout")
trl = pytest.importorskip(
    "trl", reason="TRL is not installed (pip install -e '.[trl]' in a logitless checkout)"
)
transformers = pytest.importorskip("transformers")

import test_trl as T  # noqa: E402  (the single-process harness: models, data, comparisons)
from test_trl_distributed import RUN  # noqa: E402

WORLD = 2


def _ds_config(stage: int) -> dict:
    config = zero_config(stage)
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        config[key] = "auto"  # the trainer's own values
    return config


def _params(trainer) -> dict:
    """Every parameter whole (gathered under ZeRO-3)."""
    import deepspeed

    model = trainer.model
    params = list(model.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def _grpo_worker(rank: int, world: int, model_dir: str, stage: int, tmp: str, options: dict):
    ds_env(rank, world, 29541)
    import deepspeed

    from logitless.integrations.trl import LogitlessGRPOTrainer

    deepspeed.init_distributed(dist_backend="gloo")  # before a ZeRO-3 model is loaded by path
    T._TOKENIZERS[model_dir] = T.make_tokenizer()
    out = {}
    for name, cls in (("stock", trl.GRPOTrainer), ("ours", LogitlessGRPOTrainer)):
        run = RUN | {"deepspeed": _ds_config(stage)} | options
        trainer = T._trainer(cls, model_dir, T._args(_path(tmp, f"{name}{rank}"), **run))
        trainer.train()
        assert type(trainer.model_wrapped).__name__ == "DeepSpeedEngine"
        assert trainer.model_wrapped.zero_optimization_stage() == stage
        if stage == 3:
            assert_partitioned(trainer.model.lm_head.weight)
        out[name] = (trainer.state.log_history, _params(trainer))
    return out


def _path(tmp: str, name: str):
    from pathlib import Path

    return Path(tmp) / name


CASES = [
    pytest.param(3, False, {}, id="zero3-untied-dapo"),
    pytest.param(3, True, {"beta": 0.05, "loss_type": "grpo"}, id="zero3-tied-grpo_kl"),
    pytest.param(2, False, {"beta": 0.05}, id="zero2-untied-dapo_kl"),
    pytest.param(2, True, {}, id="zero2-tied-dapo"),
]


@pytest.mark.parametrize(("stage", "tied", "options"), CASES)
def test_grpo_matches_trl_under_deepspeed(stage, tied, options, tmp_path):
    model_dir = T.save_model(tmp_path / "model", tied=tied)
    args = (model_dir, stage, str(tmp_path), options)
    ranks = spawn(_grpo_worker, WORLD, *args, threads=1, timeout_s=600.0)
    for r in ranks:
        assert T.assert_same_run(*r["stock"], *r["ours"], T._initial(model_dir)) > 0
    for name, p in ranks[0]["ours"][1].items():  # the ranks hold one model
        torch.testing.assert_close(ranks[1]["ours"][1][name], p, rtol=0, atol=0, msg=name)


# --------------------------------------------------------------------------------------------
# the distillation trainer (a wider teacher, JSD, temperature), its teacher prepared by TRL


def _distill_worker(rank, world, student, teacher, stage: int, tmp: str, mutate: bool):
    ds_env(rank, world, 29551)
    import deepspeed

    from logitless.integrations.trl import LogitlessDistillationTrainer

    if mutate:
        from test_deepspeed import _close_early

        from logitless.integrations import deepspeed as lds

        lds.run_gathered = _close_early
    deepspeed.init_distributed(dist_backend="gloo")
    T._TOKENIZERS[student] = T.make_tokenizer()
    out = {}
    classes = (("stock", trl.DistillationTrainer), ("ours", LogitlessDistillationTrainer))
    for name, cls in classes[1:] if mutate else classes:
        args = dict(
            output_dir=str(_path(tmp, f"{name}{rank}")), per_device_train_batch_size=2,
            max_completion_length=6, gradient_accumulation_steps=2, max_steps=2, bf16=False,
            use_cpu=True, report_to=[], save_strategy="no", seed=0, logging_steps=1,
            optim="sgd", learning_rate=0.2, beta=0.5, temperature=0.8,
            deepspeed=_ds_config(stage),
        )  # fmt: skip
        trainer = cls(
            model=student,
            teacher_model=teacher,
            args=trl.DistillationConfig(**args),
            train_dataset=T._dataset(),
            processing_class=T._TOKENIZERS[student],
        )
        if mutate:
            try:
                trainer.train()
            except RuntimeError as e:
                return str(e)
            return "trained"
        trainer.train()
        assert type(trainer.model_wrapped).__name__ == "DeepSpeedEngine"
        if stage == 3:
            assert_partitioned(trainer.model.lm_head.weight)
        out[name] = (trainer.state.log_history, _params(trainer))
    return out


def _distill_models(tmp_path, tied: bool):
    student = T.save_model(tmp_path / "student", tied=tied)
    return student, T.save_model(tmp_path / "teacher", width=24)


@pytest.mark.parametrize(("stage", "tied"), [(3, False), (3, True), (2, False), (2, True)])
def test_distillation_matches_trl_under_deepspeed(stage, tied, tmp_path):
    student, teacher = _distill_models(tmp_path, tied)
    args = (student, teacher, stage, str(tmp_path), False)
    ranks = spawn(_distill_worker, WORLD, *args, threads=1, timeout_s=600.0)
    for r in ranks:
        assert T.assert_same_run(*r["stock"], *r["ours"], T._initial(student)) > 0


def test_closing_the_gather_before_the_backward_fails_distillation(tmp_path):
    args = (*_distill_models(tmp_path, False), 3, str(tmp_path), True)
    for message in spawn(_distill_worker, WORLD, *args, threads=1, timeout_s=600.0):
        assert "invalid gradient" in message or "size of tensor a (0)" in message, message
