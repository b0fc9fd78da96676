"""``head: {type: logitless}`` in Fast-LLM (the vendored peer, its head, its losses, its Stage).

Each case builds the same model twice from Fast-LLM's config, once with its own head
(``loss_implementation: per_loss``, which registers the losses one by one as the logitless head
does) and once with ``type: logitless``, runs the head through Fast-LLM's ``Stage`` forward and
backward with the same parameters and batch, and compares with a float64 truth
(tests/fast_llm_backend/_fast_llm.py): the head's loss, each registered loss, the gradients of
its input, its final norm's weight and its output weight (in Fast-LLM's ``grad_buffer``), with
Fast-LLM's ``grad_output``, within 4x Fast-LLM's own error against the truth
(tests/_tolerance.py). The metrics Fast-LLM registers (``<loss>_new_logprobs``, the GRPO/GSPO
families with ``metrics: basic``) come from Fast-LLM's own functions on each side:
logitless's must match Fast-LLM's.

Also: the switch (the config type, what it builds), the refusals (``ValueError`` naming the
option, when the config is validated: before any model exists), a bad batch refused before the
backbone (in ``preprocess``), the head as a distillation teacher, and Fast-LLM's command line
through ``python -m logitless.integrations.fast_llm`` (``--validate``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip(
    "fast_llm", reason="the Fast-LLM peer (../shared/peers/fast-llm) is not in this checkout"
)

from _fast_llm import Case, V, batch, build, model_config, run, truth  # noqa: E402
from _tolerance import assert_no_worse_than_reference  # noqa: E402
from fast_llm.engine.config_utils.tensor_dim import TensorDim  # noqa: E402
from fast_llm.layers.block.config import BlockKwargs  # noqa: E402
from fast_llm.layers.language_model.config import LanguageModelKwargs  # noqa: E402
from fast_llm.layers.language_model.head import LanguageModelHead  # noqa: E402

from logitless.integrations.fast_llm import (  # noqa: E402
    LogitlessHead,
    LogitlessHeadConfig,
    TeacherOutput,
)

ROOT = Path(__file__).resolve().parents[2]
GRPO = {"type": "grpo", "metrics": "basic", "epsilon_low": 0.15, "epsilon_high": 0.3}

CASES = [
    Case("label-scale-softcap", {"ce": {"type": "label", "weight": 0.7}}, scale=1.5, softcap=4.0),
    Case("grpo-metrics-bf16", {"grpo": GRPO}, dtype=torch.bfloat16, softcap=6.0),
    Case("gspo-metrics", {"gspo": {"type": "gspo", "metrics": "basic"}}, scale=0.8),
    Case("grpo+label-splits", {"grpo": GRPO, "ce": {"type": "label"}}, splits=2),
    Case("label-mtp", {"ce": {"type": "label"}}, prediction_heads=2),
    Case(
        "distill-ce-temperature-mask",
        {"kd": {"type": "distillation", "reference_model": "teacher", "temperature": 2.0}},
        scale=1.5,
        softcap=5.0,
        teacher_softcap=4.0,
        loss_mask=True,
    ),  # fmt: skip
    Case(
        "distill-reverse-kl",
        {"kd": {"type": "distillation", "reference_model": "teacher", "loss_type": "reverse_kl"}},
    ),
    Case(
        "distill-forward-kl-bf16",
        {"kd": {"type": "distillation", "reference_model": "teacher", "loss_type": "forward_kl"}},
        dtype=torch.bfloat16,
    ),
]


def _close_metrics(ours: dict, theirs: dict, dtype: torch.dtype) -> None:
    assert ours.keys() == theirs.keys()
    tol = 2e-4 if dtype == torch.float32 else 3e-2
    for name, value in ours.items():
        ref = theirs[name]
        assert abs(float(value) - float(ref)) <= tol * (1 + abs(float(ref))), (name, value, ref)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_matches_fast_llm_and_float64(case: Case):
    b = batch(case)
    ours = run(build(case, True, case.dtype), case, b, True, case.dtype)
    built = build(case, False, case.dtype)
    theirs = run(built, case, b, False, case.dtype)
    eps = built.heads[0].final_norm._config.epsilon
    for k in range(case.prediction_heads):
        t = truth(case, b, k, eps)
        mine, ref = ours["heads"][k], theirs["heads"][k]
        _close_metrics(mine["losses"], ref["losses"], case.dtype)
        for name in case.losses:
            if name in ref["losses"]:  # registered (not when it is the head's only loss)
                assert_no_worse_than_reference(
                    mine["losses"][name], ref["losses"][name], t["values"][name], name
                )
        if "lm_head_loss" in ref["losses"]:
            lm = "lm_head_loss"
            assert_no_worse_than_reference(mine["losses"][lm], ref["losses"][lm], t["loss"], lm)
        for what in ("input", "norm", "weight"):
            assert_no_worse_than_reference(mine[what], ref[what], t[what], f"{what} grad")
            assert float(mine[what].abs().sum()) > 0


def test_the_switch_builds_logitless_heads():
    """``type: logitless`` selects the config class by name, and its model's heads (the main
    one and the multi-token-prediction ones) are logitless heads; without it, Fast-LLM's."""
    case = Case("mtp", {"ce": {"type": "label"}}, prediction_heads=3)
    config = model_config(case, True, torch.float32)
    assert type(config.base_model.head) is LogitlessHeadConfig
    assert config.base_model.head.to_dict()["type"] == "logitless"
    built = build(case, True, torch.float32)
    assert [type(h) for h in built.heads] == [LogitlessHead] * 3
    assert [h._prediction_distance for h in built.heads] == [1, 2, 3]
    plain = build(case, False, torch.float32)
    assert [type(h) for h in plain.heads] == [LanguageModelHead] * 3


@pytest.mark.parametrize(
    ("head", "match"),
    [
        ({"losses": {"z": {"type": "z_loss"}}}, r"head\.losses\.z: loss type 'z_loss'"),
        (
            {"losses": {"d": {"type": "dpo", "reference_model": "ref"}}},
            r"head\.losses\.d: loss type 'dpo'",
        ),
        ({"logits_scale_factor": 0.0}, r"head\.logits_scale_factor must be > 0"),
    ],
    ids=["z_loss", "dpo", "zero-scale"],
)
def test_refused_when_the_config_is_validated(head, match):
    with pytest.raises(ValueError, match=match):
        LogitlessHeadConfig.from_dict({"normalization": {"type": "rms_norm"}, **head})


@pytest.mark.parametrize(
    ("distributed", "vocab_parallel", "match"),
    [
        ({"sequence_data_parallel": 2}, True, "sequence_data_parallel=1"),
        ({"tensor_parallel": 2, "sequence_tensor_parallel": True}, False, "vocab_parallel=true"),
    ],
    ids=["sequence-data-parallel", "sequence-parallel-without-vocab-split"],
)
def test_gspo_refused_when_documents_are_split(distributed, vocab_parallel, match):
    """Refused when the model is built from its config (the head's constructor reads only the
    distributed config: no process group exists yet)."""
    case = Case("gspo", {"gspo": {"type": "gspo"}})
    dist = {"world_size": 2, "local_world_size": 2, "rank": 0, **distributed}
    config = model_config(case, True, torch.float32, dist)
    if not vocab_parallel:
        config = type(config).from_dict(
            config.to_dict(), {("base_model", "embeddings", "vocab_parallel"): False}
        )
    with pytest.raises(ValueError, match=match):
        config.get_base_model_config_class().get_base_model(config.base_model, config.distributed)


def test_bad_batch_is_refused_before_the_backbone():
    """A label outside the vocabulary: ``preprocess`` (before Fast-LLM's forward) raises."""
    case = Case("bad", {"grpo": GRPO})
    built = build(case, True, torch.float32)
    b = batch(case)
    kw = dict(b.kwargs)
    labels = kw[LanguageModelKwargs.labels][0].clone()
    labels[3] = V + 5
    kw[LanguageModelKwargs.labels] = [labels]
    with pytest.raises(ValueError, match=r"labels.*\[0, 96\)"):
        built.heads[0].preprocess(kw)


def test_distillation_needs_the_teacher_hidden_states():
    case = Case("kd", {"kd": {"type": "distillation", "reference_model": "teacher"}})
    built = build(case, True, torch.float32)
    b = batch(case)
    kw = dict(b.kwargs)
    kw["reference_teacher_hidden_states"] = {"head.logits": torch.zeros(case.tokens, V)}
    with pytest.raises(ValueError, match="teacher_hidden_states=true"):
        built.heads[0].preprocess(kw)


def test_as_teacher_hands_hidden_states_instead_of_logits():
    """A head with ``teacher_hidden_states`` run as a reference model (inference: no losses,
    Fast-LLM asks for ``<head>.logits``) stores its final hidden states and weight there; with
    the option off it stores Fast-LLM's logits, as Fast-LLM's own head does."""
    import re

    for hands in (True, False):
        config = model_config(Case("t", {}), True, torch.float32)
        head_config = config.base_model.head.to_dict() | {"teacher_hidden_states": hands}
        case = Case("t", {})
        built = build(case, True, torch.float32)
        head = built.heads[0]
        head._config = LogitlessHeadConfig.from_dict(head_config)
        head.eval()
        x = torch.randn(case.tokens, head.output_weights.shape[1])
        kw = {BlockKwargs.output_hidden_states: {re.compile(r"(?:.*\.)?logits.*$")}}
        kw[BlockKwargs.hidden_states] = {}
        kw[LanguageModelKwargs.hidden_token_dim] = TensorDim("token", case.tokens)
        assert head._logits_loss_forward_backward(x, kw) == (None, None)
        (_, out) = kw[BlockKwargs.hidden_states]["head.logits"]
        if hands:
            assert isinstance(out, TeacherOutput)
            assert torch.equal(out.hidden, x) and out.weight is not head.output_weights
            assert torch.equal(out.weight, head.output_weights)
        else:
            assert torch.allclose(out, x @ head.output_weights.T, atol=1e-5)


def _cli(config: str, tmp_path: Path) -> subprocess.CompletedProcess:
    path = tmp_path / "run.yaml"
    path.write_text(config)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    cmd = [sys.executable, "-m", "logitless.integrations.fast_llm", "train", "gpt"]
    return subprocess.run(
        [*cmd, "--validate", "--config", str(path)],
        capture_output=True, text=True, env=env, timeout=300, cwd=ROOT,
    )  # fmt: skip


def _page_config() -> str:
    """The run config of docs/fast-llm.md (its first YAML block)."""
    import re

    page = (ROOT / "docs" / "fast-llm.md").read_text()
    return re.findall(r"```yaml\n(.*?)```", page, re.S)[0]


def test_fast_llm_command_line(tmp_path):
    """Fast-LLM's own command line, run as ``python -m logitless.integrations.fast_llm``:
    the config docs/fast-llm.md shows is accepted with ``type: logitless``, and a loss logitless
    cannot compute is refused by name."""
    config = _page_config()
    assert "type: logitless" in config
    ok = _cli(config, tmp_path)
    assert ok.returncode == 0, ok.stdout[-3000:] + ok.stderr[-3000:]
    assert "logitless" in ok.stdout + ok.stderr
    grpo = "grpo: {type: grpo, epsilon_low: 0.2, epsilon_high: 0.28}"
    assert grpo in config
    bad = _cli(config.replace(grpo, "z: {type: z_loss}"), tmp_path)
    assert bad.returncode != 0
    assert "head.losses.z: loss type 'z_loss'" in bad.stdout + bad.stderr


def test_benchmark_script_runs(tmp_path):
    """benchmarks/fast_llm_head.py end to end on a tiny shape (its full size is for a quiet
    machine: docs/fast-llm.md), Fast-LLM eager; both variants' rows reach the CSV."""
    import csv

    out = tmp_path / "bench.csv"
    script = ROOT / "benchmarks" / "fast_llm_head.py"
    args = ["--tokens", "64", "--hidden", "16", "--vocab", "50", "--repeats", "1"]
    proc = subprocess.run(
        [sys.executable, str(script), *args, "--no-compile", "--csv", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(out.open()))
    assert [r["variant"] for r in rows] == ["fast_llm", "logitless"]
    assert rows[0]["loss"] == "grpo" and float(rows[1]["time_median_s"]) > 0
