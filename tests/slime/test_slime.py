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
         "--use-opsm", "--opsm-delta", "0.01"],
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


CHECKS = {"loss": _loss_case}


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
        except Exception:  # noqa: BLE001 - reported by the test of this check
            results[name] = f"rank {rank}: {traceback.format_exc()}"
            failed = name
    return results


TWO_RANKS = [
    ("loss:tp2_sp", (2, 1, True, False, ALL)),
    ("loss:cp2_zigzag", (1, 2, False, False, CROSS_RANK)),
    ("loss:cp2_allgather", (1, 2, False, True, CROSS_RANK)),
]


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return spawn(_run_checks, 2, TWO_RANKS, timeout_s=120.0)


def _passed(results: list[dict], name: str) -> None:
    failures = [r[name] for r in results if r[name] is not None]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("name", [n for n, _ in TWO_RANKS if n.startswith("loss:")])
def test_policy_loss_matches_slime_and_float64(two_ranks, name):
    """TP=2 with sequence parallelism (every config), CP=2 zigzag and with --allgather-cp
    (the configs with cross-rank statistics: GSPO, OPSM; TIS, per-token loss): the loss,
    slime's metrics and every gradient vs slime's logits path and float64."""
    _passed(two_ranks, name)
