"""Both TRL trainers against stock TRL under accelerate's DeepSpeed plugin, 2 gloo ranks on
DeepSpeed's CPU accelerator: ZeRO stages 2 and 3, tied and untied heads.

Each rank runs, in turn, the stock trainer and the logitless one with the same options and the
same DeepSpeed config (``GRPOConfig(deepspeed=...)``; under stage 3 every parameter is
partitioned, ``stage3_param_persistence_threshold=0``, and the head is asserted partitioned
after training): the logged losses and metrics and every parameter after 2 ``train()`` steps
must be the same (tests/test_trl.py's ``assert_same_run``, the tolerance the DDP and FSDP2 runs
are held to). The ranks see different prompts, so gradients that were not reduced end in other
weights. The early-close mutation of tests/test_deepspeed.py makes both trainers' backward
fail (untied heads).
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
from test_trl_distributed import RUN  # noqa: E402  (the DDP / FSDP2 runs' options)

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


def _grpo(rank: int, model_dir: str, stage: int, tmp: str, options: dict, mutate=False):
    """Stock and logitless GRPO runs of one case in this rank; with ``mutate``, the logitless
    run alone, and the message it fails with."""
    from logitless.integrations.trl import LogitlessGRPOTrainer

    out = {}
    classes = (("stock", trl.GRPOTrainer), ("ours", LogitlessGRPOTrainer))
    for name, cls in classes[1:] if mutate else classes:
        run = RUN | {"deepspeed": _ds_config(stage)} | options
        trainer = T._trainer(cls, model_dir, T._args(_path(tmp, f"{name}{rank}"), **run))
        if mutate:
            return _failure(trainer)
        trainer.train()
        _check_engine(trainer, stage)
        out[name] = (trainer.state.log_history, _params(trainer))
    return out


def _check_engine(trainer, stage: int) -> None:
    assert type(trainer.model_wrapped).__name__ == "DeepSpeedEngine"
    assert trainer.model_wrapped.zero_optimization_stage() == stage
    if stage == 3:  # partitioned, and no full-size copy left after training
        assert_partitioned(trainer.model.lm_head.weight)


def _distill(rank: int, student: str, teacher: str, stage: int, tmp: str, mutate=False):
    """Stock and logitless distillation runs (a wider teacher, JSD, temperature) in this rank;
    with ``mutate``, the logitless run alone, and the message it fails with."""
    from logitless.integrations.trl import LogitlessDistillationTrainer

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
            return _failure(trainer)
        trainer.train()
        _check_engine(trainer, stage)
        out[name] = (trainer.state.log_history, _params(trainer))
    return out


def _failure(trainer) -> str:
    try:
        trainer.train()
    except RuntimeError as e:
        return str(e)
    return "trained"


def _worker(rank: int, world: int, stage: int, cases: dict, mutate: bool = False):
    """Every case of one ZeRO stage in one process per rank (one DeepSpeed start)."""
    ds_env(rank, world, 29541)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")  # before a ZeRO-3 model is loaded by path
    if mutate:
        from test_deepspeed import _close_early

        from logitless.integrations import deepspeed as lds

        lds.run_gathered = _close_early
    out = {}
    for case, (kind, models, options) in cases.items():
        for path in models:
            T._TOKENIZERS[path] = T.make_tokenizer()
        tmp = str(_path(models[0], f"../{case}"))
        if kind == "grpo":
            out[case] = _grpo(rank, models[0], stage, tmp, options, mutate)
        else:
            out[case] = _distill(rank, *models, stage, tmp, mutate)
    return out


def _path(tmp: str, name: str):
    from pathlib import Path

    return Path(tmp) / name


# case -> (trainer, tied head, options); each stage runs the cases STAGE_CASES names
CASES = {
    "grpo-untied-dapo": ("grpo", False, {}),
    "grpo-tied-grpo_kl": ("grpo", True, {"beta": 0.05, "loss_type": "grpo"}),
    "grpo-untied-dapo_kl": ("grpo", False, {"beta": 0.05}),
    "distill-untied": ("distill", False, {}),
    "distill-tied": ("distill", True, {}),
}
STAGE_CASES = {
    3: ["grpo-untied-dapo", "grpo-tied-grpo_kl", "distill-untied", "distill-tied"],
    2: ["grpo-untied-dapo_kl", "distill-tied"],
}


def _models(root, kind: str, tied: bool) -> tuple[str, ...]:
    if kind == "grpo":
        return (T.save_model(root / "policy", tied=tied),)
    return T.save_model(root / "student", tied=tied), T.save_model(root / "teacher", width=24)


_RUNS: dict = {}  # stage -> (cases, ranks): one spawn per stage for the module


def _stage_runs(stage: int, tmp_path_factory):
    if stage not in _RUNS:
        cases = {}
        for case in STAGE_CASES[stage]:
            kind, tied, options = CASES[case]
            models = _models(tmp_path_factory.mktemp(f"z{stage}-{case}"), kind, tied)
            cases[case] = (kind, models, options)
        _RUNS[stage] = cases, spawn(_worker, WORLD, stage, cases, threads=1, timeout_s=600.0)
    return _RUNS[stage]


@pytest.mark.parametrize(
    ("stage", "case"), [(stage, case) for stage in (3, 2) for case in STAGE_CASES[stage]]
)
def test_trainers_match_trl_under_deepspeed(stage, case, tmp_path_factory):
    cases, ranks = _stage_runs(stage, tmp_path_factory)
    initial = T._initial(cases[case][1][0])
    for r in ranks:
        assert T.assert_same_run(*r[case]["stock"], *r[case]["ours"], initial) > 0
    for name, p in ranks[0][case]["ours"][1].items():  # the ranks hold one model
        torch.testing.assert_close(ranks[1][case]["ours"][1][name], p, rtol=0, atol=0, msg=name)


def test_closing_the_gather_before_the_backward_fails(tmp_path):
    """Both trainers, untied heads: the divergence reads the weight in backward, and the fused
    loss's weight gradient can only be accumulated into the full-shape parameter."""
    cases = {
        "distill-untied": ("distill", _models(tmp_path / "d", "distill", False), {}),
        "grpo-untied-dapo": ("grpo", _models(tmp_path / "g", "grpo", False), {}),
    }
    for r in spawn(_worker, WORLD, 3, cases, True, threads=1, timeout_s=600.0):
        for message in r.values():
            assert "invalid gradient" in message or "size of tensor a (0)" in message, message
