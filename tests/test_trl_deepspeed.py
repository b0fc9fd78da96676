"""Both TRL trainers against stock TRL under accelerate's DeepSpeed plugin, 2 gloo ranks on
DeepSpeed's CPU accelerator: ZeRO stages 0 to 3, tied and untied heads, a LoRA policy
(ZeRO-3), and under ZeRO-3 four parameter persistence thresholds.

One launch of 2 processes runs every case (DeepSpeed is imported and its communication op
loaded once). Each rank runs, per case and stage, the stock trainer and the logitless one with
the same options and the same DeepSpeed config (``GRPOConfig(deepspeed=...)``), 2 ``train()``
steps (generation, rewards, 2 iterations of each batch, gradient accumulation 2). Under stage 3
``stage3_param_persistence_threshold`` is 0 (every parameter partitioned) for every case, and
for both trainers also DeepSpeed's default (1e5 elements: the whole tiny model persistent), the
head's element count (the head persistent, at the boundary) and one less (the head
partitioned, the smaller parameters persistent). A persistent parameter is a partition until
DeepSpeed first gathers it, in its module's forward (never run for the head) or after a step:
the head gathers it in the first step. After training the head is asserted partitioned, or,
persistent, whole. The truth of each case is stock TRL's run of the same steps in float64 (the
trainer built as the fp32 ones are, its models then cast to float64, and trained under DDP on
the same 2 ranks: ZeRO's sharding changes no arithmetic of an SGD step, and DeepSpeed's
optimizers keep float32 master weights). Every logged loss and metric and every final parameter
of the logitless run must be within 4x stock TRL's own error against that truth (max and rms,
plus a floor: tests/_tolerance.py, ``_trl.assert_run_no_worse``). The ranks see different
prompts, so gradients that were not reduced end in other weights.

The mutation of tests/test_deepspeed.py (the head's gather closed when its forward returns)
runs last in the same launch: both trainers' backward must fail (untied heads, ZeRO-3). Then a
persistent head read while still a partition (``needs_gather`` without its status check,
DeepSpeed's default threshold) must stop both trainers with the ``ValueError`` naming the fix,
not an ``IndexError`` from the head's shape. Stage 0 catches the loss returned as the engine's
forward output itself (without ``deepspeed.past_output_hooks``: half of stock TRL's update with
gradient accumulation 2).
"""

from __future__ import annotations

import pytest
import torch
from _deepspeed import (
    DEFAULT_PERSISTENCE,
    assert_partitioned,
    assert_persistent,
    ds_env,
    zero_config,
)
from _dist import spawn

pytest.importorskip("deepspeed", reason="pip install -e '.[deepspeed]' in a logitless checkout")
trl = pytest.importorskip(
    "trl", reason="TRL is not installed (pip install -e '.[trl]' in a logitless checkout)"
)
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import _trl as T  # noqa: E402  (models, data, trainers, run comparisons)

WORLD = 2
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])

# case -> (trainer, tied head, options); "lora": a LoRA adapter on the attention projections
CASES = {
    "grpo-untied-dapo": ("grpo", False, {}),
    "grpo-tied-grpo_kl": ("grpo", True, {"beta": 0.05, "loss_type": "grpo"}),
    "grpo-lora-dapo_kl": ("grpo", False, {"beta": 0.05, "learning_rate": 0.5, "lora": True}),
    "distill-untied": ("distill", False, {}),
    "distill-tied": ("distill", True, {}),
}
HEAD = T.V * 16  # the elements of the policy's (the student's) head
# (stage, case, ZeRO-3's stage3_param_persistence_threshold; None: DeepSpeed's default). ZeRO-3
# every case with every parameter partitioned; both trainers under the default threshold (the
# tied GRPO case too: the embedding's forward gathers the shared weight and keeps it), with the
# head just under the threshold (persistent) and just over it (partitioned); ZeRO-2 (whole
# weights, sharded gradients) both trainers, tied and untied; stages 1 and 0 one GRPO case each
# (stage 0: the tied KL case, whose updates are not clipped, so a gradient off by a factor
# shows in full)
RUNS = [
    (3, "grpo-untied-dapo", 0),
    (3, "grpo-tied-grpo_kl", 0),
    (3, "grpo-lora-dapo_kl", 0),
    (3, "distill-untied", 0),
    (3, "distill-tied", 0),
    (3, "grpo-untied-dapo", None),
    (3, "grpo-tied-grpo_kl", None),
    (3, "distill-untied", None),
    (3, "grpo-untied-dapo", HEAD),
    (3, "distill-untied", HEAD),
    (3, "grpo-untied-dapo", HEAD - 1),
    (3, "distill-untied", HEAD - 1),
    (2, "grpo-tied-grpo_kl", 0),
    (2, "grpo-untied-dapo", 0),
    (2, "distill-tied", 0),
    (2, "distill-untied", 0),
    (1, "grpo-untied-dapo", 0),
    (0, "grpo-tied-grpo_kl", 0),
]
MUTATED = ["distill-untied", "grpo-untied-dapo"]  # ZeRO-3, the gather closed early
# ZeRO-3 at DeepSpeed's default threshold, a persistent weight used as it is even while it is
# still a partition (needs_gather without its status check)
READ_PARTITIONED = ["distill-untied", "grpo-untied-dapo"]


def _run_id(stage: int, case: str, persistence: int | None) -> str:
    if stage < 3 or persistence == 0:
        return f"zero{stage}-{case}"
    return f"zero{stage}-{case}-persist_{'default' if persistence is None else persistence}"


def _ds_config(stage: int, persistence: int | None) -> dict:
    config = zero_config(stage, persistence, gradient_clipping="auto")  # trainer's max_grad_norm
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        config[key] = "auto"  # the trainer's own values
    return config


def _trainer(cls, models, options: dict, out, stage: int | None, persistence: int | None = 0):
    """``cls`` on the case's models; ``stage`` None: no DeepSpeed (the float64 truth)."""
    options = dict(options)
    lora = peft.LoraConfig(**LORA) if options.pop("lora", False) else None
    if stage is not None:
        options["deepspeed"] = _ds_config(stage, persistence)
    if issubclass(cls, trl.DistillationTrainer):
        return T.distill_trainer(cls, *models, out, **options)
    return T.grpo_trainer(cls, models[0], T.grpo_args(out, **(T.RUN | options)), lora)


def _train(cls, models, options: dict, out, stage: int | None, persistence: int | None = 0):
    """One ``train()``: the log history and every parameter, whole; with ``stage`` None the
    stock trainer's models cast to float64 after construction (same initial values, LoRA
    adapters included), trained under DDP."""
    trainer = _trainer(cls, models, options, out, stage, persistence)
    if stage is None:
        for name in ("model", "ref_model", "teacher_model"):
            if getattr(trainer, name, None) is not None:
                getattr(trainer, name).double()
    trainer.train()
    if stage is None:
        assert type(trainer.model_wrapped).__name__ == "DistributedDataParallel"
        params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        assert all(p.dtype == torch.float64 for p in params.values())
        return trainer.state.log_history, params
    _check_engine(trainer, stage, persistence)
    return trainer.state.log_history, _gathered_params(trainer)


def _gathered_params(trainer) -> dict:
    """Every parameter whole (gathered under ZeRO-3)."""
    import deepspeed

    model = trainer.model
    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def _check_engine(trainer, stage: int, persistence: int | None) -> None:
    """The engine of ``stage``; under ZeRO-3 the head persistent (whole after the step) exactly
    when the threshold says so, else partitioned (no full-size copy left), no gather open."""
    from logitless.integrations import deepspeed as lds

    assert type(trainer.model_wrapped).__name__ == "DeepSpeedEngine"
    assert trainer.model_wrapped.zero_optimization_stage() == stage
    head = trainer.model.get_output_embeddings()
    head = getattr(head, "base_layer", head)
    if stage == 3:
        weight = head._parameters["weight"]
        threshold = DEFAULT_PERSISTENCE if persistence is None else persistence
        if weight.ds_numel <= threshold:
            assert_persistent(weight)
        else:
            assert_partitioned(weight)
        assert not lds._Hold.open_holds


def _failure(cls, models, options, out, persistence: int | None = 0) -> str:
    """What stops ``train()`` under ZeRO-3: ``"<exception type>: <message>"``."""
    try:
        _trainer(cls, models, options, out, 3, persistence).train()
    except Exception as e:  # noqa: BLE001 (the type is what the tests check)
        return f"{type(e).__name__}: {e}"
    return "trained"


def _needs_gather_by_persistence(t) -> bool:
    """The mutation: a persistent ZeRO-3 parameter taken as whole, partitioned or not."""
    from logitless.integrations import deepspeed as lds

    persistent = getattr(t, "ds_persist", False)
    return lds.is_zero3(t) and not (persistent or lds._gathered_by_caller(t))


def _worker(rank: int, world: int, cases: dict, runs: list, mutated: list, read_partitioned):
    """Every run in one process per rank: the float64 truths (DDP) first, before any
    DeepSpeed config is set in the process, then each (stage, case, persistence), then the
    mutations."""
    from pathlib import Path

    ds_env(rank, world, 29541)
    import deepspeed

    from logitless.integrations import deepspeed as lds
    from logitless.integrations.trl import (
        LogitlessDistillationTrainer,
        LogitlessGRPOTrainer,
    )

    deepspeed.init_distributed(dist_backend="gloo")  # before a ZeRO-3 model is loaded by path
    classes = {
        "grpo": (trl.GRPOTrainer, LogitlessGRPOTrainer),
        "distill": (trl.DistillationTrainer, LogitlessDistillationTrainer),
    }
    for _, models, _ in cases.values():
        for path in models:
            T.TOKENIZERS[path] = T.make_tokenizer()

    def out(case, name):
        return Path(cases[case][1][0]).parent / f"{name}{rank}"

    result: dict = {"truth": {}, "runs": {}, "mutated": {}, "read partitioned": {}}
    for case in sorted({case for _, case, _ in runs}):
        kind, models, options = cases[case]
        result["truth"][case] = _train(classes[kind][0], models, options, out(case, "f64"), None)
    for stage, case, persistence in runs:
        kind, models, options = cases[case]
        result["runs"][stage, case, persistence] = {
            name: _train(cls, models, options, out(case, f"z{stage}{persistence}{name}"), stage,
                         persistence)
            for name, cls in zip(("stock", "ours"), classes[kind], strict=True)
        }  # fmt: skip
    if mutated:
        from test_deepspeed import _close_early

        real, lds.run_gathered = lds.run_gathered, _close_early
        try:
            for case in mutated:
                kind, models, options = cases[case]
                msg = _failure(classes[kind][1], models, options, out(case, "mutated"))
                result["mutated"][case] = msg
        finally:
            lds.run_gathered = real
    real, lds.needs_gather = lds.needs_gather, _needs_gather_by_persistence
    try:
        for case in read_partitioned:
            kind, models, options = cases[case]
            msg = _failure(classes[kind][1], models, options, out(case, "persisted"), None)
            result["read partitioned"][case] = msg
    finally:
        lds.needs_gather = real
    return result


def _models(root, kind: str, tied: bool) -> tuple[str, ...]:
    if kind == "grpo":
        return (T.save_model(root / "policy", tied=tied),)
    return T.save_model(root / "student", tied=tied), T.save_model(root / "teacher", width=24)


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    """Every case in one spawn: (cases with their model paths, each rank's results)."""
    cases = {}
    for case, (kind, tied, options) in CASES.items():
        cases[case] = (kind, _models(tmp_path_factory.mktemp(case), kind, tied), options)
    ranks = spawn(
        _worker, WORLD, cases, RUNS, MUTATED, READ_PARTITIONED, threads=1, timeout_s=600.0
    )
    return cases, ranks


@pytest.mark.parametrize(("stage", "case", "persistence"), RUNS, ids=[_run_id(*r) for r in RUNS])
def test_trainers_match_trl_under_deepspeed(stage, case, persistence, launch):
    cases, ranks = launch
    models = cases[case][1]
    for r in ranks:
        runs, truth = r["runs"][stage, case, persistence], r["truth"][case]
        lora = CASES[case][2].get("lora")
        initial = T.lora_base(models[0], truth[1]) if lora else T.initial(models[0])
        moved = T.assert_run_no_worse(runs["ours"], runs["stock"], truth, initial, case)
        if lora:  # the adapters, and nothing else
            assert moved == len([n for n in truth[1] if "lora_" in n]) > 0
        else:
            assert moved > 0
    run = stage, case, persistence
    for name, p in ranks[0]["runs"][run]["ours"][1].items():  # the ranks hold one model
        torch.testing.assert_close(ranks[1]["runs"][run]["ours"][1][name], p, rtol=0, atol=0)


def test_closing_the_gather_before_the_backward_fails(launch):
    """Both trainers, untied heads, ZeRO-3: the divergence reads the weight in backward, and
    the fused loss's weight gradient can only be accumulated into the full-shape parameter."""
    for r in launch[1]:
        assert set(r["mutated"]) == set(MUTATED)
        for message in r["mutated"].values():
            assert "invalid gradient" in message or "size of tensor a (0)" in message, message


def test_a_persistent_head_read_while_partitioned_is_refused_naming_the_fix(launch):
    """The ValueError the docs promise (not an IndexError from the head's ``[0]`` shape), when
    a persistent head weight reaches the head before its first gather."""
    for r in launch[1]:
        assert set(r["read partitioned"]) == set(READ_PARTITIONED)
        for message in r["read partitioned"].values():
            assert message.startswith("ValueError: "), message
            assert "is a DeepSpeed ZeRO-3 parameter that is not gathered" in message, message
