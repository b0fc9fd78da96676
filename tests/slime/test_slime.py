"""slime's policy loss with logitless (``logitless.integrations.slime``), against slime's own
code on gloo ranks (tests/slime/_slime.py says what runs and what is stubbed).

Every loss case builds, from slime's parsed arguments through slime's own model provider, two
models with the same weights: ours (``--custom-model-provider-path
logitless.integrations.slime.model_provider``, then ``--loss-type custom_loss
--custom-loss-function-path logitless.integrations.slime.policy_loss``) and slime's (its
default provider and ``--loss-type policy_loss``: its logits, ``get_log_probs_and_entropy`` and
``policy_loss_function``), plus a float64 copy of slime's running the same
``policy_loss_function`` on float64 log-probs (the truth). The same micro-batch goes through
slime's ``get_batch`` and ``loss_function`` on each; the loss (summed over the
context-parallel ranks), slime's metrics and every parameter's gradient of ours must be within
the tolerance derived from slime's own error against the truth (tests/_tolerance.py).
"""

from __future__ import annotations

import contextlib
import re
import traceback

import _slime as sl
import pytest
import torch
from _dist import spawn
from _tolerance import FLOOR, assert_no_worse_than_reference

if not sl.SLIME.is_dir():
    pytest.skip(
        f"slime's source is not at {sl.SLIME} (../shared/peers/slime): the slime tests run "
        "against it",
        allow_module_level=True,
    )

ICEPOP = "slime.backends.megatron_utils.loss.icepop_function"
CONFIGS: dict[str, tuple[list[str], dict]] = {
    "ppo_dual_clip_kl_entropy": (
        ["--eps-clip", "0.2", "--eps-clip-high", "0.28", "--eps-clip-c", "3", "--use-kl-loss",
         "--kl-loss-coef", "0.1", "--kl-loss-type", "k3", "--entropy-coef", "0.01"],
        {},
    ),
    "gspo_opsm": (
        ["--advantage-estimator", "gspo", "--eps-clip", "0.02", "--eps-clip-high", "0.03",
         "--use-opsm", "--opsm-delta", "0.01", "--use-rollout-logprobs"],
        {},
    ),
    "cispo_tis_unbiased_k2": (
        ["--advantage-estimator", "cispo", "--eps-clip", "1.0", "--eps-clip-high", "0.3",
         "--use-tis", "--tis-clip", "1.5", "--tis-clip-low", "0.5", "--use-kl-loss",
         "--kl-loss-coef", "0.05", "--kl-loss-type", "k2", "--use-unbiased-kl"],
        {},
    ),
    "icepop_low_var_kl_per_token_temperature": (
        ["--use-tis", "--custom-tis-function-path", ICEPOP, "--tis-clip", "1.6",
         "--tis-clip-low", "0.6", "--use-kl-loss", "--kl-loss-type", "low_var_kl",
         "--kl-loss-coef", "0.1", "--rollout-temperature", "0.8"],
        {"calculate_per_token_loss": True},
    ),
    "k1_unbiased_negative_entropy_mismatch_metrics": (
        ["--use-kl-loss", "--kl-loss-type", "k1", "--kl-loss-coef", "0.2", "--use-unbiased-kl",
         "--entropy-coef", "-0.02", "--get-mismatch-metrics", "--custom-tis-function-path",
         "slime.backends.megatron_utils.loss.vanilla_tis_function"],
        {},
    ),
}  # fmt: skip
ALL = list(CONFIGS)
CROSS_RANK = ["gspo_opsm", "icepop_low_var_kl_per_token_temperature", "ppo_dual_clip_kl_entropy"]


# --- one step of each path ----------------------------------------------------------------


def _cp_sum(t: torch.Tensor) -> torch.Tensor:
    """``t`` summed over the context-parallel group (slime sums its per-rank metrics and
    losses over it)."""
    from megatron.core import parallel_state as ps

    t = t.detach().double().clone()
    if ps.get_context_parallel_world_size() > 1:
        torch.distributed.all_reduce(t, group=ps.get_context_parallel_group())
    return t


def _grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def _step(model, args, data, truth: bool = False) -> dict:
    """slime's train forward_step on micro-batch 0 and ``backward()`` of the loss its
    ``loss_function`` returns: the loss and metrics (summed over context parallelism) and
    every parameter's gradient."""
    with sl.in_float64() if truth else contextlib.nullcontext():
        output, loss_func = sl.forward_step(args, 1, len(sl.TOTALS))(sl.iterator(data), model)
        loss, _, log = loss_func(output)
        loss.backward()
    metrics = dict(zip(log["keys"], _cp_sum(log["values"][1:]).unbind(), strict=True))
    return {"loss": _cp_sum(loss), "metrics": metrics, "grads": _grads(model)}


def _compare(ours: dict, ref: dict, exact: dict, what: str, floor: float) -> None:
    """The loss, every gradient and slime's metrics present in both, against the reference's
    error; ``floor``: the fp32 summation bound of a sum over the micro-batch's tokens (each of
    them is one)."""
    assert set(ours["grads"]) == set(ref["grads"]) == set(exact["grads"])
    assert_no_worse_than_reference(ours["loss"], ref["loss"], exact["loss"], f"{what}: loss",
                                   floor=floor)  # fmt: skip
    for name, g in ref["grads"].items():
        assert_no_worse_than_reference(ours["grads"][name], g, exact["grads"][name],
                                       f"{what}: grad {name}", floor=floor)  # fmt: skip
    common = set(ours["metrics"]) & set(ref["metrics"])
    assert {"loss", "pg_loss", "entropy_loss", "pg_clipfrac", "ppo_kl"} <= common, common
    for key in sorted(common):
        assert_no_worse_than_reference(ours["metrics"][key], ref["metrics"][key],
                                       exact["metrics"][key], f"{what}: metric {key}",
                                       floor=floor)  # fmt: skip


def _floor(data: dict) -> float:
    """A sum over the tokens (a parameter's gradient, the loss, a metric): the fp32 summation
    bound, tokens x eps."""
    return sum(data["total_lengths"]) * FLOOR


def _models(tp: int, cp: int, sp: bool, allgather: bool, dtype=torch.float32):
    """Ours, slime's and the float64 truth, built by slime's provider from one seed; the data
    with the model's own old log-probs (slime's forward_only pass on our model, which returns
    the logits there: bitwise slime's)."""
    from _megatron_shim import init_parallel

    init_parallel(tp, cp)
    flags = ["--allgather-cp"] if allgather else []
    shape = dict(tp=tp, cp=cp, sp=sp, dtype=dtype)
    ours = sl.build(sl.slime_args([*flags, *sl.OURS], **shape))
    slime = sl.build(sl.slime_args(flags, **shape))
    truth = sl.float64_copy(slime, sl.slime_args(flags, **shape))
    data = sl.with_log_probs(ours, sl.slime_args(flags, **shape), sl.rollout())
    own = sl.with_log_probs(slime, sl.slime_args(flags, **shape), sl.rollout())
    for a, b in zip(data["model_log_probs"], own["model_log_probs"], strict=True):
        assert torch.equal(a, b), "without gradients our model must return slime's logits"
    return ours, slime, truth, data, flags, shape


def _loss_case(rank: int, tp: int, cp: int, sp: bool, allgather: bool, names: list[str]) -> None:
    """Each config of ``names`` on micro-batch 0: ours vs slime's path vs float64."""
    ours, slime, truth, data, flags, shape = _models(tp, cp, sp, allgather)
    for name in names:
        cli, megatron = CONFIGS[name]
        ours_args = sl.slime_args([*cli, *flags, *sl.OURS], **shape, **megatron)
        slime_args = sl.slime_args([*cli, *flags], **shape, **megatron)
        got = _step(ours, ours_args, data)
        ref = _step(slime, slime_args, data)
        exact = _step(truth, slime_args, data, truth=True)
        _compare(got, ref, exact, f"rank {rank} {name}", _floor(data))


# --- Megatron's DDP, the distributed optimizer, the pipeline --------------------------------

ADAM = dict(lr=0.05, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-2)


def _ddp(model, **config):
    """``model`` in megatron-core's DDP (fp32 ``main_grad``, ``overlap_grad_reduce``), as
    Megatron-LM's ``get_model`` wraps it for slime, in ``Float16Module`` when it is 16-bit;
    with the schedule's settings Megatron-LM's training loop gives its config."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.transformer.module import Float16Module

    fp32 = model.config.params_dtype != torch.float64
    options = dict(grad_reduce_in_fp32=fp32, overlap_grad_reduce=True, **config)
    inner = Float16Module(model.config, model) if model.config.bf16 else model
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(**options), inner)
    model.config.no_sync_func = ddp.no_sync
    model.config.grad_sync_func = ddp.start_grad_sync
    model.config.finalize_model_grads_func = finalize_model_grads
    return ddp


def _main_grads(model) -> dict[str, torch.Tensor]:
    """Every parameter's ``main_grad`` (after the gradient sync), by the GPTModel's names."""
    return {n: p.main_grad.detach().clone() for n, p in model.named_parameters()}


def _schedule(ddp, args, data, per_token: bool = False) -> dict:
    """One optimizer step's forward and backward of slime's ``train_one_step``: Megatron's
    ``get_forward_backward_func()`` over both micro-batches with slime's forward_step; the
    loss, slime's metrics (summed over the micro-batches, then the context-parallel group) and
    every parameter's ``main_grad`` as ``finalize_model_grads`` left them, then zeroed."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model = ddp.module.module if ddp.module.__class__.__name__ == "Float16Module" else ddp.module
    model.config.calculate_per_token_loss = per_token
    ddp.zero_grad_buffer()
    step = sl.forward_step(args, len(sl.MICRO_BATCHES), len(sl.TOTALS))
    logs = get_forward_backward_func()(
        forward_step_func=step, data_iterator=sl.iterator(data), model=[ddp],
        num_microbatches=len(sl.MICRO_BATCHES), seq_length=max(sl.TOTALS), micro_batch_size=1,
        forward_only=False,
    )  # fmt: skip
    grads = _main_grads(model)
    ddp.zero_grad_buffer()
    if not logs:  # a stage without the loss
        return {"grads": grads}
    values = _cp_sum(sum(log["values"] for log in logs)[1:])
    return {"metrics": dict(zip(logs[0]["keys"], values.unbind(), strict=True)), "grads": grads}


def _compare_grads(ours: dict, ref: dict, exact: dict, what: str, floor: float) -> None:
    assert set(ours["grads"]) == set(ref["grads"]) == set(exact["grads"])
    for name, g in ref["grads"].items():
        assert_no_worse_than_reference(ours["grads"][name], g, exact["grads"][name],
                                       f"{what}: main_grad {name}", floor=floor)  # fmt: skip
    for key in sorted(set(ours.get("metrics", {})) & set(ref.get("metrics", {}))):
        assert_no_worse_than_reference(ours["metrics"][key], ref["metrics"][key],
                                       exact["metrics"][key], f"{what}: metric {key}",
                                       floor=floor)  # fmt: skip


def _bf16_case(rank: int, names: list[str]) -> None:
    """bf16 (TP=2, sequence parallelism) as Megatron-LM trains it: ``Float16Module`` in DDP
    (fp32 ``main_grad``, ``grad_reduce_in_fp32``, ``overlap_grad_reduce``), both micro-batches
    through Megatron's schedule; every ``main_grad`` and slime's metrics vs slime's bf16 logits
    path through the same DDP and float64 (a float64 copy of the bf16 weights)."""
    from _megatron_shim import init_parallel

    init_parallel(2, 1)
    shape = dict(tp=2, sp=True, dtype=torch.bfloat16)
    ours_model = sl.build(sl.slime_args(list(sl.OURS), **shape))
    slime_model = sl.build(sl.slime_args([], **shape))
    truth_model = sl.float64_copy(slime_model, sl.slime_args([], **shape))
    ours, slime, truth = (_ddp(m) for m in (ours_model, slime_model, truth_model))
    data = sl.with_log_probs(ours, sl.slime_args([], **shape), sl.rollout())
    floor = sum(sl.TOTALS) * torch.finfo(torch.bfloat16).eps
    for name in names:
        cli, megatron = CONFIGS[name]
        per_token = megatron.get("calculate_per_token_loss", False)
        got = _schedule(ours, sl.slime_args([*cli, *sl.OURS], **shape, **megatron), data, per_token)
        assert ours_model.output_layer.weight.grad is None, "the head's gradient: in main_grad"
        own = sl.slime_args(cli, **shape, **megatron)
        ref = _schedule(slime, own, data, per_token)
        with sl.in_float64():
            exact = _schedule(truth, own, data, per_token)
        _compare_grads(got, ref, exact, f"rank {rank} bf16 {name}", floor)


def _pipeline_case(rank: int, names: list[str]) -> None:
    """PP=2 through Megatron's 1F1B schedule (both micro-batches, DDP, finalize_model_grads):
    the switch on both stages (the first has no output layer: the provider leaves it as it is)
    gives every parameter of both stages slime's main_grad and float64's."""
    from _megatron_shim import init_parallel
    from megatron.core import parallel_state as ps

    init_parallel(1, pp=2)
    ours_model = sl.build(sl.slime_args(list(sl.OURS), pp=2))
    slime_model = sl.build(sl.slime_args([], pp=2))
    truth_model = sl.float64_copy(slime_model, sl.slime_args([], pp=2))
    assert ("forward" in vars(ours_model)) == ps.is_pipeline_last_stage()
    ours, slime, truth = (_ddp(m) for m in (ours_model, slime_model, truth_model))
    data = sl.with_log_probs(ours, sl.slime_args([], pp=2), sl.rollout())
    for name in names:
        cli, megatron = CONFIGS[name]
        per_token = megatron.get("calculate_per_token_loss", False)
        got = _schedule(ours, sl.slime_args([*cli, *sl.OURS], pp=2, **megatron), data, per_token)
        ref = _schedule(slime, sl.slime_args(cli, pp=2, **megatron), data, per_token)
        with sl.in_float64():
            exact = _schedule(truth, sl.slime_args(cli, pp=2, **megatron), data, per_token)
        what = f"rank {rank} stage {ps.get_pipeline_model_parallel_rank()} {name}"
        _compare_grads(got, ref, exact, what, 2 * sum(sl.TOTALS) * FLOOR)


def _optimizer_case(rank: int, name: str) -> None:
    """megatron-core's DistributedOptimizer (Adam) under DDP with ``use_distributed_optimizer``,
    ``overlap_grad_reduce`` and ``overlap_param_gather`` (DP=2, each rank its own rollout), two
    optimizer steps of slime's ``train_one_step`` (both micro-batches): after each step the
    parameters equal slime's path's and float64's (torch's Adam on a float64 copy, the step's
    gradient over both data-parallel ranks' micro-batches). Step 2's forward reads parameters
    the optimizer's shards all-gather, awaited by each module's forward pre-hook: a head that
    bypassed ``output_layer``'s would score stale weights."""
    from _megatron_shim import init_parallel
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    init_parallel(1, gloo_groups=True)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    cli, megatron = CONFIGS[name]
    runs = {}
    for path, flags in (("ours", sl.OURS), ("slime", ())):
        model = sl.build(sl.slime_args(list(flags)))
        ddp = _ddp(model, use_distributed_optimizer=True, overlap_param_gather=True,
                   bucket_size=4000)  # fmt: skip
        opt = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", weight_decay=0.0, clip_grad=0.0,
                            use_distributed_optimizer=True, **ADAM), [ddp],
        )  # fmt: skip
        runs[path] = (model, ddp, opt, sl.slime_args([*cli, *flags], **megatron))
    assert len(runs["ours"][1].bucket_groups) > 1, "several buckets: a gather per bucket"
    truth = sl.float64_copy(runs["slime"][0], sl.slime_args([]))
    initial = {n: p.detach().clone() for n, p in truth.named_parameters()}
    adam = torch.optim.Adam(truth.parameters(), lr=ADAM["lr"], eps=ADAM["adam_eps"],
                            betas=(ADAM["adam_beta1"], ADAM["adam_beta2"]))  # fmt: skip
    every = [sl.with_log_probs(runs["ours"][1], sl.slime_args([]), sl.rollout(seed=10 + r))
             for r in range(dp)]  # fmt: skip
    truth_args = sl.slime_args(cli, **megatron)
    for step in range(2):
        seen = {}
        for path, (model, ddp, opt, args) in runs.items():
            opt.zero_grad()
            _run_train_step(ddp, args, every[dp_rank], dp)
            seen[path] = {n: p.detach().clone() for n, p in model.named_parameters()}
            assert opt.step()[0], f"{path}: the optimizer step was skipped"
        with sl.in_float64():  # the step's gradient: every rank's micro-batches, DDP's mean
            for data in every:
                _truth_step(truth, truth_args, data, dp)
        if step == 1:  # the parameters of step 2's forward, as the pre-hooks gathered them
            _compare_parameters(seen, truth, initial, f"rank {rank} after step 1")
        adam.step()
        adam.zero_grad()
    for path, (model, ddp, _, _) in runs.items():
        ddp.start_param_sync(force_sync=True)
        seen[path] = {n: p.detach().clone() for n, p in model.named_parameters()}
    _compare_parameters(seen, truth, initial, f"rank {rank} after step 2")


def _run_train_step(ddp, args, data, dp: int) -> None:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ddp.zero_grad_buffer()
    get_forward_backward_func()(
        forward_step_func=sl.forward_step(args, len(sl.MICRO_BATCHES), dp * len(sl.TOTALS)),
        data_iterator=sl.iterator(data), model=[ddp], num_microbatches=len(sl.MICRO_BATCHES),
        seq_length=max(sl.TOTALS), micro_batch_size=1, forward_only=False,
    )  # fmt: skip


def _truth_step(model, args, data, dp: int) -> None:
    """The float64 gradient of one data-parallel rank's micro-batches, as Megatron's schedule
    divides each loss (by the micro-batch count) and DDP averages (over ``dp``)."""
    n = len(sl.MICRO_BATCHES)
    step, it = sl.forward_step(args, n, dp * len(sl.TOTALS)), sl.iterator(data)
    for _ in range(n):
        output, loss_func = step(it, model)
        (loss_func(output)[0] / (n * dp)).backward()


def _compare_parameters(seen: dict, truth, initial: dict, what: str) -> None:
    """Each parameter's change since the start: ours vs slime's path vs float64."""
    for n, exact in truth.named_parameters():
        exact = exact.detach()
        ours, ref = seen["ours"][n].double(), seen["slime"][n].double()
        assert_no_worse_than_reference(ours - initial[n], ref - initial[n], exact - initial[n],
                                       f"{what}: {n}", floor=1e-6)  # fmt: skip


# --- bad input ----------------------------------------------------------------------------

VANILLA = "slime.backends.megatron_utils.loss.vanilla_tis_function"
# slime's command lines that logitless refuses, and the option its ValueError names
REFUSED = [
    (["--recompute-loss-function"], "--recompute-loss-function"),
    (["--rollout-top-p", "0.9"], "--rollout-top-p"),
    (["--custom-pg-loss-reducer-function-path", "my.reducer"], "--custom-pg-loss-reducer"),
    (["--use-tis", "--custom-tis-function-path", "my.tis"], "--custom-tis-function-path"),
    (["--use-rollout-logprobs", "--get-mismatch-metrics", "--custom-tis-function-path",
      VANILLA], "--use-rollout-logprobs"),
    (["--advantage-estimator", "gspo", "--use-kl-loss", "--use-unbiased-kl"], "--use-unbiased-kl"),
    (["--use-kl-loss", "--use-unbiased-kl", "--kl-loss-type", "low_var_kl"], "low_var_kl"),
    (["--eps-clip-c", "0.5"], "--eps-clip-c"),
    (["--eps-clip", "-0.1"], "--eps-clip"),
    (["--use-tis", "--tis-clip", "1.5", "--tis-clip-low", "2.0"], "--tis-clip-low"),
    (["--use-opsm", "--opsm-delta", "inf"], "--opsm-delta"),
    (["--entropy-coef", "nan"], "--entropy-coef"),
    (["--rollout-temperature", "0"], "--rollout-temperature"),
]  # fmt: skip


def _errors_case(rank: int) -> None:
    """Bad input raises ValueError on both ranks (TP=2) in slime's terms: each option
    logitless cannot follow, from the model provider before any GPTModel is built (slime's
    arguments are the same on every rank); without the loss switch; slime's logits handed to
    the loss; then one rank's loss inputs that do not match the batch (the other rank raises
    too, naming the group), after which the ranks are still in step."""
    from _megatron_shim import init_parallel
    from megatron.core.models.gpt import GPTModel

    init_parallel(2, 1)
    built = []
    init = GPTModel.__init__
    GPTModel.__init__ = lambda self, *a, **k: (built.append(1), init(self, *a, **k))[1]
    try:
        for cli, option in REFUSED:
            with pytest.raises(ValueError, match=re.escape(option)):
                sl.build(sl.slime_args([*cli, *sl.OURS], tp=2))
        with pytest.raises(ValueError, match="--loss-type custom_loss"):
            sl.build(sl.slime_args(list(sl.OURS[:2]), tp=2))
    finally:
        GPTModel.__init__ = init
    assert not built, "a refused option must cost no model"
    ours, slime, _, data, _, shape = _models(2, 1, False, False)
    with pytest.raises(ValueError, match="needs the hidden states its model provider"):
        _step(slime, sl.slime_args(list(sl.OURS), **shape), data)
    bad = dict(data, advantages=list(data["advantages"]))
    if rank == 1:
        bad["advantages"][1] = bad["advantages"][1][:-1]
    match = "batch\\['advantages'\\]\\[1\\]" if rank == 1 else "another rank"
    with pytest.raises(ValueError, match=match):
        _step(ours, sl.slime_args(list(sl.OURS), **shape), bad)
    _grads(ours)
    short = dict(data, rollout_mask_sums=data["rollout_mask_sums"] + 1)
    with pytest.raises(ValueError, match="rollout_mask_sums"):
        _step(ours, sl.slime_args(list(sl.OURS), **shape), short)
    _grads(ours)
    _step(ours, sl.slime_args(list(sl.OURS), **shape), data)  # still in step


CHECKS = {
    "loss": _loss_case,
    "bf16": _bf16_case,
    "pipeline": _pipeline_case,
    "optimizer": _optimizer_case,
    "errors": _errors_case,
}


def _run_checks(rank: int, world: int, checks: list[tuple[str, tuple]]) -> dict[str, str | None]:
    """Each check on this rank, its failure as text (None: passed); one spawn serves several
    tests. After a failure the rank runs no further check (its collectives would be out of
    step)."""
    import _megatron_shim  # noqa: F401  (the warning filters, before megatron's imports)

    sl.install()
    results: dict[str, str | None] = {}
    failed = None
    for name, args in checks:
        if failed is not None:
            results[name] = f"rank {rank}: not run, after {failed} failed"
            continue
        try:
            CHECKS[name.split(":")[0]](rank, *args)
            results[name] = None
        except (Exception, pytest.fail.Exception):  # noqa: BLE001 - reported by its test
            results[name] = f"rank {rank}: {traceback.format_exc()}"
            failed = name
    return results


TWO_RANKS = [
    ("loss:tp2_sp", (2, 1, True, False, ALL)),
    ("loss:cp2_zigzag", (1, 2, False, False, CROSS_RANK)),
    ("loss:cp2_allgather", (1, 2, False, True, CROSS_RANK)),
    ("bf16", (["ppo_dual_clip_kl_entropy", "gspo_opsm"],)),
    ("pipeline", (["ppo_dual_clip_kl_entropy", "icepop_low_var_kl_per_token_temperature"],)),
    ("optimizer", ("cispo_tis_unbiased_k2",)),
    ("errors", ()),
]


FOUR_RANKS = [
    ("loss:tp2_cp2_sp_allgather", (2, 2, True, True, CROSS_RANK[:2])),
]


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return spawn(_run_checks, 2, TWO_RANKS, timeout_s=120.0)


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    return spawn(_run_checks, 4, FOUR_RANKS, timeout_s=120.0)


def _passed(results: list[dict], name: str) -> None:
    failures = [r[name] for r in results if r[name] is not None]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("name", [n for n, _ in TWO_RANKS if n.startswith("loss:")])
def test_policy_loss_matches_slime_and_float64(two_ranks, name):
    """TP=2 with sequence parallelism (every config), CP=2 zigzag and with --allgather-cp
    (the configs with cross-rank statistics: GSPO, OPSM; TIS, per-token loss): the loss,
    slime's metrics and every gradient vs slime's logits path and float64."""
    _passed(two_ranks, name)


def test_bf16_float16module_ddp_main_grad(two_ranks):
    _passed(two_ranks, "bf16")


def test_pipeline_parallel_both_stages(two_ranks):
    _passed(two_ranks, "pipeline")


def test_distributed_optimizer_both_overlaps_two_steps(two_ranks):
    _passed(two_ranks, "optimizer")


def test_bad_input_raises_on_every_rank(two_ranks):
    """Each refused option names itself (before any model is built); the switch's two halves
    go together; a batch that does not match raises on every rank of the group."""
    _passed(two_ranks, "errors")


@pytest.mark.parametrize("name", [n for n, _ in FOUR_RANKS])
def test_tensor_and_context_parallel(four_ranks, name):
    """TP=2 x CP=2 with sequence parallelism and --allgather-cp on 4 ranks (GSPO with OPSM,
    IcePop with the per-token loss)."""
    _passed(four_ranks, name)
