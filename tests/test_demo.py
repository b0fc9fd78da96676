"""``logitless demo``: the GRPO loop runs, both head paths agree, the CLI parses.

The fused-vs-naive checks follow tests/_tolerance.py: the same GRPO step is computed by the
logitless path and by the naive full-logits path in fp32, and by the naive path on a float64
copy of the model (the truth); the logitless error must be within 4x the naive error (max and
rms) plus one fp32 ulp of scale, for the log-probs, the entropy, the loss, every metric and the
gradient of every model parameter.
"""

from __future__ import annotations

import copy
import csv
import importlib.util
import io
import math
import sys

import pytest
import torch
from _tolerance import assert_no_worse_than_reference

pytest.importorskip("transformers", reason="the demo's policy is a transformers model")

from logitless.apps import cli, demo  # noqa: E402
from logitless.apps.demo import (  # noqa: E402
    DIGIT0,
    IGNORE,
    Batch,
    DemoConfig,
    DemoResult,
    StepMetrics,
    ToyTask,
    _sample_rows,
    build_policy,
    check_step,
    final_rewards,
    plot_demo,
    rollout,
    run_demo,
    seeds_summary,
    show_samples,
    step_loss,
    token_logprobs,
    write_csv,
)

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
# vocab 32: after a short warm-up some answers hit the digit, so advantages and updates are real
TINY = {"vocab": 32, "hidden": 32, "warmup": 5, "prompts": 3, "group": 4}


def test_run_demo_few_steps_metrics_csv_and_plot(tmp_path):
    seen = []
    result = run_demo(DemoConfig(steps=3, **TINY), progress=False, on_step=seen.append)
    assert [r.step for r in result.rows] == [1, 2, 3] and seen == result.rows
    for row in result.rows:
        for name in ("reward", "loss", "kl", "entropy", "clip_frac", "peak_mem_mb", "seconds"):
            assert math.isfinite(getattr(row, name)), (name, row)
        assert 0.0 <= row.reward <= 1.0 and 0.0 <= row.clip_frac <= 1.0
        assert row.entropy > 0 and row.peak_mem_mb >= 0 and row.seconds > 0
    assert any(r.reward > 0 for r in result.rows), "no learning signal: make TINY easier"
    # k3 is >= 0 per token; once updated, the policy has moved off the reference
    assert min(r.kl for r in result.rows) >= 0 and result.rows[-1].kl > 0
    summary = result.summary()
    assert summary.startswith("logitless, seed 0: reward ") and "naive" not in summary
    assert "3 steps in " in summary and "with build and warm-up" in summary
    # the real run time: model build + warm-up + the steps
    assert 0 < result.warmup_seconds < result.run_seconds
    assert result.run_seconds >= result.warmup_seconds + result.steps_seconds()
    assert len(show_samples(result, n=2)) == 2

    path = tmp_path / "metrics.csv"
    write_csv([result], path)
    with path.open() as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [1, 2, 3]
    assert {r["mode"] for r in rows} == {"logitless"} and {r["seed"] for r in rows} == {"0"}
    assert float(rows[2]["reward"]) == pytest.approx(result.rows[2].reward)

    png = tmp_path / "plot.png"
    assert plot_demo([result], png) is HAS_MATPLOTLIB
    assert png.exists() is HAS_MATPLOTLIB


def test_run_demo_is_deterministic_and_naive_mode_tracks_it():
    fused = run_demo(DemoConfig(steps=2, **TINY), progress=False)
    again = run_demo(DemoConfig(steps=2, **TINY), progress=False)
    naive = run_demo(DemoConfig(steps=2, naive=True, **TINY), progress=False)
    assert [r.reward for r in fused.rows] == [r.reward for r in again.rows]
    assert [r.loss for r in fused.rows] == [r.loss for r in again.rows]
    # same seed, same samples at step 1 (the paths agree to float rounding, tested below)
    assert naive.rows[0].reward == fused.rows[0].reward
    assert naive.rows[0].loss == pytest.approx(fused.rows[0].loss, abs=1e-5)


# ---------------------------------------------------------------------------------------------
# one step, fused vs naive vs float64


def _perturbed_batch(batch: Batch, generator: torch.Generator) -> Batch:
    """Old / reference log-probs moved off the current policy (ratios != 1, clip and KL active),
    random advantages (a random-init policy rarely emits a digit: its GRPO advantages are 0)."""
    mask = batch.labels != IGNORE
    advantages = torch.randn(batch.advantages.shape, generator=generator)
    noise = torch.randn(batch.old_logprobs.shape, generator=generator)
    old = torch.where(mask, batch.old_logprobs + 0.3 * noise, 0.0)
    ref = torch.where(mask, batch.old_logprobs - 0.2 * noise.roll(1, 0), 0.0)
    return Batch(batch.ids, batch.labels, batch.rewards, advantages, old, ref, batch.entropy)


def _as_double(batch: Batch) -> Batch:
    d = lambda t: t.double()  # noqa: E731
    return Batch(
        batch.ids,
        batch.labels,
        d(batch.rewards),
        d(batch.advantages),
        d(batch.old_logprobs),
        d(batch.ref_logprobs),
        d(batch.entropy),
    )


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def test_fused_and_naive_agree_on_one_grpo_step():
    config = DemoConfig(vocab=1000, hidden=32, prompts=4, group=4, digits=3)
    task = ToyTask(config.digits)
    policy = build_policy(config)
    reference = copy.deepcopy(policy).requires_grad_(False)
    gen = torch.Generator().manual_seed(3)
    batch = rollout(policy, reference, task, config, gen, torch.Generator().manual_seed(4))
    batch = _perturbed_batch(batch, gen)
    truth_model = copy.deepcopy(policy).double()
    loss_config = config.loss_config()

    # log-probs and entropy with random upstream gradients
    g_lp = torch.randn(batch.ids.shape, generator=gen)
    g_ent = torch.randn(batch.ids.shape, generator=gen)
    results = {}
    for name, model, naive, up in (
        ("fused", policy, False, lambda t: t),
        ("naive", policy, True, lambda t: t),
        ("truth", truth_model, True, lambda t: t.double()),
    ):
        model.zero_grad(set_to_none=True)
        lp, ent = token_logprobs(model, batch.ids, batch.labels, naive=naive, with_entropy=True)
        (lp * up(g_lp) + ent * up(g_ent)).sum().backward()
        results[name] = (lp.detach(), ent.detach(), _grads(model))
    (f_lp, f_ent, f_g), (n_lp, n_ent, n_g), (t_lp, t_ent, t_g) = (
        results["fused"],
        results["naive"],
        results["truth"],
    )
    assert_no_worse_than_reference(f_lp, n_lp, t_lp, "logprobs")
    assert_no_worse_than_reference(f_ent, n_ent, t_ent, "entropy")
    assert bool((f_lp[batch.labels == IGNORE] == 0).all())
    for name in t_g:
        assert_no_worse_than_reference(f_g[name], n_g[name], t_g[name], f"logprobs grad {name}")

    # the policy loss, its metrics and every parameter's gradient
    results = {}
    for name, model, naive, b in (
        ("fused", policy, False, batch),
        ("naive", policy, True, batch),
        ("truth", truth_model, True, _as_double(batch)),
    ):
        model.zero_grad(set_to_none=True)
        loss, metrics = step_loss(model, b, loss_config, naive=naive)
        loss.backward()
        results[name] = (loss.detach(), metrics, _grads(model))
    (f_loss, f_m, f_g), (n_loss, n_m, n_g), (t_loss, t_m, t_g) = (
        results["fused"],
        results["naive"],
        results["truth"],
    )
    assert f_m["clip_frac_low"] > 0 and f_m["clip_frac_high"] > 0, "the clip should be active"
    assert f_m["kl_ref"] > 0
    assert_no_worse_than_reference(f_loss, n_loss, t_loss, "loss")
    assert set(f_m) == set(n_m) == set(t_m)
    for key in t_m:
        assert_no_worse_than_reference(f_m[key], n_m[key], t_m[key], f"metric {key}")
    for name in t_g:
        assert_no_worse_than_reference(f_g[name], n_g[name], t_g[name], f"loss grad {name}")


def test_warmup_and_steps_show_progress():
    """The warm-up (minutes at the default size) has its own progress bar, then the RL steps."""
    stream = io.StringIO()
    run_demo(DemoConfig(steps=2, **{**TINY, "warmup": 3}), progress=True, stream=stream)
    text = stream.getvalue()
    assert "warm-up logitless seed 0" in text and "cross-entropy=" in text and "3/3" in text
    assert "GRPO logitless seed 0" in text and "reward=" in text
    assert text.index("warm-up") < text.index("GRPO")
    quiet = io.StringIO()
    run_demo(DemoConfig(steps=1, **TINY), progress=False, stream=quiet)
    assert quiet.getvalue() == ""


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_without_tqdm_is_the_shared_status_line(monkeypatch):
    """Without tqdm the bars are ``apps.output.StatusLine``s (the bench's status line): in a
    log one line per step, on a terminal one line redrawn in place and kept when it ends."""
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm raises ImportError
    log = io.StringIO()
    run_demo(DemoConfig(steps=2, **{**TINY, "warmup": 2}), progress=True, stream=log)
    lines = log.getvalue().splitlines()
    assert [ln.split(" cross-entropy=")[0] for ln in lines[:2]] == [
        "warm-up logitless seed 0 1/2",
        "warm-up logitless seed 0 2/2",
    ]
    assert lines[2].startswith("GRPO logitless seed 0 1/2 reward=") and len(lines) == 4
    tty = _Terminal()
    run_demo(DemoConfig(steps=2, **{**TINY, "warmup": 0}), progress=True, stream=tty)
    text = tty.getvalue()
    assert text.count("\r\x1b[KGRPO logitless seed 0 ") == 2 and text.count("\n") == 1
    assert text.endswith("\n") and "2/2 reward=" in text.splitlines()[-1]


# ---------------------------------------------------------------------------------------------
# one update in float64; several seeds


def test_check_step_agrees_in_float64():
    """Both head paths compute the same update: in float64 they agree to float64 rounding, in
    fp32 each is off float64 by fp32 rounding only."""
    check = check_step(DemoConfig(**TINY))
    assert check.grad_scale > 0 and check.seed == 0
    assert check.loss64_diff <= 1e-13
    assert check.grad64_diff <= 1e-13 * check.grad_scale
    for mode in ("logitless", "naive"):
        assert 0 < check.grad32_err[mode] <= 1e-5 * check.grad_scale
        assert check.loss32_err[mode] <= 1e-5
    text = check.summary()
    assert "in float64, logitless and naive differ by" in text and "in fp32" in text


def test_check_step_catches_a_wrong_path(monkeypatch):
    """The check is not vacuous: a naive loss off by 1e-4 shows up in float64."""
    from logitless.apps.demo import check as check_module

    real = demo.step_loss

    def off(model, batch, config, *, naive):
        loss, metrics = real(model, batch, config, naive=naive)
        return (loss * (1 + 1e-4) if naive else loss), metrics

    monkeypatch.setattr(check_module, "step_loss", off)
    check = check_step(DemoConfig(**TINY))
    assert check.loss64_diff > 1e-7 and check.grad64_diff > 1e-9 * check.grad_scale


def _result(mode: str, seed: int, rewards: list[float], seconds: float = 1.0) -> DemoResult:
    rows = [StepMetrics(i + 1, r, 0.0, 0.0, 1.0, 0.0, 10.0, 0.1) for i, r in enumerate(rewards)]
    config = DemoConfig(naive=mode == "naive", seed=seed, steps=len(rewards))
    return DemoResult(config, rows, "", None, warmup_seconds=0.5, run_seconds=seconds)


def test_seeds_summary_by_hand():
    """Final reward = mean of the last 10 steps (half the run if shorter); mean ± sample
    standard deviation over seeds; the difference of the modes seed by seed."""
    results = []
    for seed, (a, b) in enumerate([(0.9, 0.6), (0.7, 0.8), (0.8, 0.7)]):
        results.append(_result("logitless", seed, [0.1] * 4 + [a] * 4, seconds=30.0))
        results.append(_result("naive", seed, [0.1] * 4 + [b] * 4, seconds=60.0))
    finals = final_rewards(results)
    assert finals == {"logitless": [0.9, 0.7, 0.8], "naive": [0.6, 0.8, 0.7]}
    lines = seeds_summary(results)
    assert lines[0].startswith("final reward (mean of the last 4 steps) over 3 seeds (0, 1, 2)")
    assert lines[1] == "  logitless  0.800 ± 0.100  [0.90, 0.70, 0.80]  run time 30 s per seed"
    assert lines[2] == "  naive      0.700 ± 0.100  [0.60, 0.80, 0.70]  run time 60 s per seed"
    assert lines[3] == "  logitless - naive, paired by seed: +0.100 ± 0.200 [+0.30, -0.10, +0.10]"
    # areas (mean reward over the 8 steps): 0.5 / 0.35, 0.4 / 0.45, 0.45 / 0.4 -> differences
    # 0.15, -0.05, 0.05: mean 0.05, std 0.1, half-width 4.303 * 0.1 / sqrt(3)
    half = 4.303 * 0.1 / 3**0.5
    assert lines[4] == (
        "  area under the reward curve (mean reward over all steps), logitless - naive paired "
        f"by seed: +0.0500, 95% CI [{0.05 - half:+.4f}, {0.05 + half:+.4f}] over 3 seeds "
        "(std 0.1000; not significant at 5%)"
    )
    one = seeds_summary([_result("logitless", 0, [0.2, 0.4])])
    assert one[1].startswith("  logitless  0.400 ± 0.000  [0.40]") and len(one) == 2


def test_paired_difference_interval():
    """A paired t interval: significant when it excludes 0; the t quantile follows its table
    and then the expansion."""
    from logitless.apps.demo import _t975, paired_difference

    d = paired_difference([0.2, 0.25, 0.15, 0.2])
    assert d.mean == pytest.approx(0.2) and d.significant
    assert d.high - d.low == pytest.approx(2 * 3.182 * d.std / 2)
    assert not paired_difference([0.1, -0.1]).significant
    assert _t975(15) == 2.131 and _t975(30) == 2.042
    assert 1.96 < _t975(60) < 2.0 and abs(_t975(60) - 2.000) < 0.002


def test_csv_round_trip_and_cli_summarize(tmp_path, capsys):
    """Runs written by --csv (e.g. seeds split over processes) give the same seeds summary
    when read back: ``logitless demo --summarize A.csv B.csv``."""
    from logitless.apps.cli import main
    from logitless.apps.demo import read_csv

    modes = ("logitless", "naive")
    runs = [_result(m, s, [0.1, 0.3, 0.5, 0.9 - 0.1 * s]) for s in (0, 1, 2) for m in modes]
    write_csv(runs[:2], tmp_path / "a.csv")
    write_csv(runs[2:], tmp_path / "b.csv")
    back = read_csv([tmp_path / "a.csv", tmp_path / "b.csv"])
    assert [(r.config.mode, r.config.seed) for r in back] == [
        (r.config.mode, r.config.seed) for r in runs
    ]
    assert [r.rows for r in back] == [r.rows for r in runs]
    assert main(["demo", "--summarize", str(tmp_path / "a.csv"), str(tmp_path / "b.csv")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[4:] == seeds_summary(runs)[4:]


def test_plot_demo_several_seeds(tmp_path):
    results = [_result(m, s, [0.1, 0.3, 0.5, 0.9]) for s in (0, 1) for m in ("logitless", "naive")]
    png = tmp_path / "compare.png"
    assert plot_demo(results, png) is HAS_MATPLOTLIB
    assert png.exists() is HAS_MATPLOTLIB


# ---------------------------------------------------------------------------------------------
# pieces


def test_toy_task_reward_by_hand():
    task = ToyTask(3)
    values = torch.tensor([[3, 1, 4], [0, 0, 9], [5, 5, 5]])
    assert task.encode(values).tolist()[0] == [1, 3 + DIGIT0, 1 + DIGIT0, 4 + DIGIT0]  # <bos> 3 1 4
    responses = torch.tensor(
        [
            [4 + DIGIT0, 4 + DIGIT0, 4 + DIGIT0],  # all right
            [9 + DIGIT0, 0 + DIGIT0, 250],  # one right; a non-digit id is wrong
            [4 + DIGIT0, 6 + DIGIT0, 1],  # none
        ]
    )
    torch.testing.assert_close(task.reward(values, responses), torch.tensor([1.0, 1 / 3, 0.0]))
    with pytest.raises(ValueError, match="shape"):
        task.reward(values, responses[:, :2])


def test_sampler_draws_from_the_distribution():
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3]]).expand(20000, 4).contiguous()
    draws = _sample_rows(probs, torch.Generator().manual_seed(0)).squeeze(1)
    freq = torch.bincount(draws, minlength=4).double() / draws.numel()
    sigma = (probs[0].double() * (1 - probs[0].double()) / draws.numel()).sqrt()
    assert freq[1] == 0, "a zero-probability token was sampled"
    assert bool(((freq - probs[0]).abs() <= 5 * sigma + 1e-12).all()), freq


def test_naive_step_holds_more_memory():
    """One step at the default head size: the naive step's peak is several times larger."""
    kw = {"steps": 1, "warmup": 0, "prompts": 8, "group": 8}
    fused = run_demo(DemoConfig(**kw), progress=False)
    naive = run_demo(DemoConfig(naive=True, **kw), progress=False)
    # [64, 7, 16384] fp32 logits are 29 MB; naive holds several such tensors at once
    if "not resettable" in fused.memory_note:  # no /proc/self/clear_refs: lifetime peak only
        assert naive.peak_mb() >= 0 and fused.peak_mb() >= 0
    else:
        assert naive.peak_mb() > 2 * fused.peak_mb() > 0, (fused.summary(), naive.summary())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"group": 1}, "group"),
        ({"vocab": 5}, "vocab"),
        ({"hidden": 30, "heads": 4}, "multiple of heads"),
        ({"lr": 0.0}, "lr"),
        ({"kl_coef": -1.0}, "kl_coef"),
        ({"steps": 0}, "steps"),
        ({"naive": 1}, "naive"),
        ({"device": "gpu9"}, "device"),
    ],
)
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DemoConfig(**kwargs)


# ---------------------------------------------------------------------------------------------
# CLI


def test_cli_demo_help(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--steps", "--naive", "--compare", "--plot", "--seed", "--device"):
        assert flag in out


@pytest.mark.parametrize(
    "argv",
    [
        ["--steps", "0"],
        ["--naive", "--compare"],
        ["--check-step", "--compare"],
        ["--group", "1"],
        ["--vocab", "5"],
        ["--seeds", "0"],
        ["--warmup", "-1"],
    ],
)
def test_cli_demo_bad_input(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", *argv])
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


def test_cli_demo_compare_runs(tmp_path, capsys):
    png, table = tmp_path / "demo_{mode}.png", tmp_path / "demo.csv"
    argv = ["demo", "--compare", "--seeds", "2", "--steps", "2", "--vocab", "64", "--prompts", "2"]
    argv += ["--group", "2", "--warmup", "3", "--quiet", "--plot", str(png), "--csv", str(table)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "2 steps, seeds 0, 1" in out.splitlines()[0]
    for mode in ("logitless", "naive"):
        for seed in (0, 1):
            assert f"{mode}, seed {seed}: reward" in out
    assert "naive / logitless peak step memory" in out
    assert "final reward (mean of the last 1 steps) over 2 seeds (0, 1)" in out
    assert "  logitless - naive, paired by seed: " in out
    assert "in float64, logitless and naive differ by" in out
    assert "demo run time: " in out and "(4 runs)" in out
    with table.open() as f:
        rows = [(r["mode"], r["seed"]) for r in csv.DictReader(f)]
    assert rows == [(m, s) for s in ("0", "1") for m in ("logitless", "naive") for _ in range(2)]
    assert (tmp_path / "demo_compare.png").exists() is HAS_MATPLOTLIB


def test_cli_demo_check_step_only(capsys):
    argv = ["demo", "--check-step", "--vocab", "64", "--prompts", "2", "--group", "2"]
    argv += ["--warmup", "3"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "one update checked in float64" in out.splitlines()[0]
    assert "in float64, logitless and naive differ by" in out and "reward" not in out


def test_cli_demo_seeds_default(capsys):
    """Several seeds by default only where modes are compared: one run stays one run."""
    argv = ["demo", "--steps", "1", "--vocab", "64", "--prompts", "2", "--group", "2"]
    assert cli.main([*argv, "--warmup", "0", "--quiet", "--no-plot"]) == 0
    out = capsys.readouterr().out
    assert "1 steps, seed 0," in out and "seed 1" not in out and "final reward" not in out


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="needs matplotlib (the [bench] extra)")
def test_plot_demo_names_the_window_it_averages(tmp_path, monkeypatch):
    """A 5-step run averages over 2 steps (half the run), and the legend says so."""
    from matplotlib.figure import Figure

    saved = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: saved.append(fig))
    result = _result("logitless", 0, [0.1, 0.3, 0.5, 0.7, 0.9])
    assert result.window() == 2
    assert plot_demo([result], tmp_path / "one.png")
    labels = [line.get_label() for line in saved[0].axes[0].lines]
    assert "logitless: 2-step moving mean (final 0.80)" in labels
