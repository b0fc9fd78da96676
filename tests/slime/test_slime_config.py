"""slime's arguments onto logitless's loss (``logitless.integrations.slime.loss_config``), read
from slime's own parser (its defaults, its option strings), in this process; and the pieces of
the switch that need no ranks. tests/slime/test_slime.py holds the numbers on gloo ranks."""

from __future__ import annotations

import dataclasses

import _slime as sl
import pytest
import torch

if not sl.SLIME.is_dir():
    pytest.skip(f"slime's source is not at {sl.SLIME} (../shared/peers/slime)",
                allow_module_level=True)  # fmt: skip
sl.install()

from logitless import PolicyLossConfig  # noqa: E402
from logitless.integrations import slime as ls  # noqa: E402

ICEPOP = "slime.backends.megatron_utils.loss.icepop_function"


def test_slime_defaults_are_grpo_with_its_per_sample_mean():
    assert ls.loss_config(sl.slime_args([])) == PolicyLossConfig(
        clip_low=0.2, clip_high=0.2, aggregation="seq_mean_token_mean", kl_coef=0.0
    )


@pytest.mark.parametrize(
    ("cli", "megatron", "expected"),
    [
        (["--eps-clip", "0.1", "--eps-clip-high", "0.3", "--eps-clip-c", "3"], {},
         dict(clip_low=0.1, clip_high=0.3, dual_clip=3.0)),
        (["--advantage-estimator", "gspo"], {}, dict(ratio_level="sequence_mean")),
        (["--advantage-estimator", "cispo", "--eps-clip-c", "3"], {},
         dict(surrogate="cispo", dual_clip=None)),
        ([], {"calculate_per_token_loss": True}, dict(aggregation="token_sum")),
        (["--entropy-coef", "0.01"], {}, dict(entropy_coef=0.01)),
        (["--use-kl-loss", "--kl-loss-coef", "0.1"], {},
         dict(kl_coef=0.1, kl_estimator="k1", kl_log_ratio_clamp=None, kl_value_clamp=None)),
        (["--use-kl-loss", "--kl-loss-type", "low_var_kl"], {},
         dict(kl_estimator="k3", kl_log_ratio_clamp=None, kl_value_clamp=10.0)),
        (["--use-kl-loss", "--kl-loss-type", "k3", "--use-unbiased-kl"], {},
         dict(kl_estimator="k3", kl_log_ratio_clamp=None, kl_value_clamp=None,
              kl_importance_weight=True)),
        (["--use-tis", "--tis-clip", "3", "--tis-clip-low", "0.2"], {},
         dict(mismatch_is="token", mismatch_is_cap=3.0, mismatch_is_floor=0.2)),
        (["--use-tis"], {}, dict(mismatch_is="token", mismatch_is_cap=2.0, mismatch_is_floor=None)),
        (["--use-tis", "--custom-tis-function-path", ICEPOP, "--tis-clip-low", "0.5"], {},
         dict(mismatch_is="token", mismatch_token_mask=(0.5, 2.0), mismatch_is_floor=None)),
        (["--use-opsm", "--opsm-delta", "0.02"], {}, dict(opsm_delta=0.02)),
        (["--opsm-delta", "0.02"], {}, dict(opsm_delta=None)),  # without --use-opsm
    ],
)  # fmt: skip
def test_each_option_maps_to_its_field(cli, megatron, expected):
    config = ls.loss_config(sl.slime_args(cli, **megatron))
    got = {k: getattr(config, k) for k in expected}
    assert got == expected, (cli, got)
    untouched = dataclasses.asdict(PolicyLossConfig())
    for field, value in dataclasses.asdict(config).items():
        if field not in expected and field not in ("clip_low", "clip_high", "aggregation"):
            assert value == untouched[field], field


def test_slime_loads_the_switch_by_name():
    """The two values of slime's command line resolve, through slime's own ``load_function``,
    to the functions of this package."""
    from slime.utils.misc import load_function

    assert load_function(ls.POLICY_LOSS) is ls.policy_loss
    assert load_function(ls.MODEL_PROVIDER) is ls.model_provider


def test_with_head_needs_an_output_processor_and_skips_a_stage_without_the_head():
    with pytest.raises(ValueError, match="takes no output_processor"):
        ls.with_head(torch.nn.Linear(2, 2))
    stage = torch.nn.Linear(2, 2)
    stage.post_process = False
    assert ls.with_head(stage) is stage and "forward" not in vars(stage)


def test_the_loss_refuses_logits():
    with pytest.raises(ValueError, match="custom-model-provider-path"):
        ls.head_stage(torch.zeros(1, 4, 8))


def test_benchmark_script_runs(tmp_path):
    """benchmarks/slime_step.py (its full-size run is the lead's: docs/slime.md) at a tiny
    shape, on one rank (the two-rank numbers are test_slime.py's): both rows in the CSV, the
    same loss both ways."""
    import csv
    import os
    import subprocess
    import sys

    out = tmp_path / "slime_step.csv"
    env = dict(os.environ, PYTHONPATH=str(sl.ROOT / "src"))
    cmd = [sys.executable, str(sl.ROOT / "benchmarks" / "slime_step.py"), "--seq", "256",
           "--samples", "2", "--hidden", "32", "--vocab", "256", "--repeats", "1",
           "--tp", "1", "--slime-args=--entropy-coef 0.01", "--csv", str(out)]  # fmt: skip
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "ratio logitless/slime: memory" in run.stdout
    rows = list(csv.DictReader(out.open()))
    assert [r["method"] for r in rows] == ["slime", "logitless"]
    assert rows[0]["tokens"] == "256" and rows[0]["slime_args"] == "--entropy-coef 0.01"
    assert float(rows[0]["loss"]) == pytest.approx(float(rows[1]["loss"]), rel=1e-5)
