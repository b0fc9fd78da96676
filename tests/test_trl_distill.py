"""logitless.integrations.trl.LogitlessDistillationTrainer against the real TRL 1.16
``DistillationTrainer`` (CPU, fp32, tiny random models, nothing downloaded).

A student Qwen2 (width 16) and a wider teacher Qwen2 (width 24) from tests/_trl.py's
harness. On the same generated batch (TRL's own ``_generate_and_score_completions``), in
train mode with TRL's ``num_items_in_batch`` and in eval mode (the local token mean):
``LogitlessDistillationTrainer.compute_loss`` and the stock ``compute_loss`` give the same loss,
the same gradient of every student parameter and the same logged ``entropy``; the teacher gets
no gradient. Then a short ``train()`` of each (generation, gradient accumulation 2, 2 optimizer
steps) logs the same losses and metrics and ends with the same weights. For beta 0 (forward
KL), 0.5 (JSD), 1 (reverse KL) and 0.3 with a temperature.
"""

from __future__ import annotations

import pytest
import torch

trl = pytest.importorskip(
    "trl", reason="TRL is not installed (pip install -e '.[trl]' in a logitless checkout)"
)
transformers = pytest.importorskip("transformers")

import _trl as T  # noqa: E402  (models, tokenizer, data, run comparison)

from logitless.integrations.trl import LogitlessDistillationTrainer  # noqa: E402

_one_thread = pytest.fixture(autouse=True, scope="module")(T.single_thread)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    return T.save_model(root / "student"), T.save_model(root / "teacher", width=24)


def _trainer(cls, models, tmp_path, mixin=None, **options):
    """``cls`` on the tiny models; ``mixin``: the logitless trainer's own keywords."""
    student, teacher = models
    args = dict(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_completion_length=6,
        gradient_accumulation_steps=2, max_steps=2, bf16=False, use_cpu=True, report_to=[],
        save_strategy="no", seed=0, logging_steps=1, optim="sgd", learning_rate=0.2,
    )  # fmt: skip
    return cls(
        model=student,
        teacher_model=teacher,
        args=trl.DistillationConfig(**(args | options)),
        train_dataset=T.dataset(),
        processing_class=T.TOKENIZERS[student],
        **(mixin or {}),
    )


def _loss_and_grads(trainer, inputs, train: bool):
    trainer.model.train(train)
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(trainer.model, dict(inputs))
    loss.backward()
    grads = {n: p.grad for n, p in trainer.model.named_parameters()}
    entropy = trainer._metrics["train" if train else "eval"]["entropy"][-1]
    return loss.detach(), grads, entropy


BETAS = [
    pytest.param({"beta": 0.0}, id="forward_kl"),
    pytest.param({"beta": 0.5}, id="jsd"),
    pytest.param({"beta": 1.0}, id="reverse_kl"),
    pytest.param({"beta": 0.3, "temperature": 0.7}, id="jsd_0.3_temperature"),
]


@pytest.mark.parametrize("options", BETAS)
def test_compute_loss_matches_trl(options, models, tmp_path):
    stock = _trainer(trl.DistillationTrainer, models, tmp_path / "a", **options)
    ours = _trainer(LogitlessDistillationTrainer, models, tmp_path / "b", **options)
    inputs = stock._generate_and_score_completions(next(iter(stock.get_train_dataloader())))
    assert int(inputs["completion_mask"].sum()) > 8
    for train in (True, False):
        a = _loss_and_grads(ours, inputs, train)
        b = _loss_and_grads(stock, inputs, train)
        torch.testing.assert_close(a[0], b[0], rtol=1e-5, atol=1e-7)
        assert float(a[0]) > 0
        assert set(a[1]) == set(b[1])
        for name, g in b[1].items():  # both fp32: a few ulps of the gradient's own scale
            atol = 1e-6 * max(1.0, float(g.abs().max()))
            torch.testing.assert_close(a[1][name], g, rtol=1e-4, atol=atol, msg=name)
        assert a[2] == pytest.approx(b[2], rel=1e-5)
    assert all(p.grad is None for p in ours.teacher_model.parameters())


def test_compute_loss_under_bf16_matches_trl(models, tmp_path):
    """TRL's default ``bf16=True``: stock TRL runs its loss through its forward redirection,
    which bypasses the autocast accelerate wraps the model's forward in, so both models and
    heads compute in their own dtype (fp32 here). The logitless trainer must do the same: the
    same loss, gradients and entropy as stock TRL (under autocast the loss was 1e-4 and the
    embedding gradient 1e-3 away)."""
    stock = _trainer(trl.DistillationTrainer, models, tmp_path / "a", beta=0.5, bf16=True)
    ours = _trainer(LogitlessDistillationTrainer, models, tmp_path / "b", beta=0.5, bf16=True)
    assert ours.accelerator.mixed_precision == "bf16"
    inputs = stock._generate_and_score_completions(next(iter(stock.get_train_dataloader())))
    a = _loss_and_grads(ours, inputs, True)
    b = _loss_and_grads(stock, inputs, True)
    torch.testing.assert_close(a[0], b[0], rtol=1e-5, atol=1e-7)
    for name, g in b[1].items():
        atol = 1e-6 * max(1.0, float(g.abs().max()))
        torch.testing.assert_close(a[1][name], g, rtol=1e-4, atol=atol, msg=name)
    assert a[2] == pytest.approx(b[2], rel=1e-5)


@pytest.mark.parametrize("options", BETAS[1:3])
def test_train_matches_trl(options, models, tmp_path):
    runs = []
    for cls, sub in ((trl.DistillationTrainer, "a"), (LogitlessDistillationTrainer, "b")):
        trainer = _trainer(cls, models, tmp_path / sub, **options)
        trainer.train()
        params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        runs.append((trainer.state.log_history, params))
    assert T.assert_same_run(*runs[0], *runs[1], T.initial(models[0])) > 0


def test_batch_invariant_reaches_the_divergence(models, tmp_path, monkeypatch):
    """``LogitlessDistillationTrainer(..., batch_invariant=True)`` runs its divergence in the
    mode; the loss is the default mode's up to rounding; a non-bool is refused."""
    from logitless.integrations import hf

    default = _trainer(LogitlessDistillationTrainer, models, tmp_path / "a", beta=0.5)
    ours = _trainer(
        LogitlessDistillationTrainer, models, tmp_path / "b", {"batch_invariant": True}, beta=0.5
    )
    inputs = default._generate_and_score_completions(next(iter(default.get_train_dataloader())))
    seen = []
    real = hf.causal_lm_divergence

    def spy(*args, **kwargs):
        seen.append(kwargs.get("batch_invariant"))
        return real(*args, **kwargs)

    monkeypatch.setattr(hf, "causal_lm_divergence", spy)
    a, b = _loss_and_grads(ours, inputs, True), _loss_and_grads(default, inputs, True)
    assert seen == [True, False]
    torch.testing.assert_close(a[0], b[0], rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="batch_invariant must be a bool"):
        _trainer(LogitlessDistillationTrainer, models, tmp_path / "c", {"batch_invariant": 1})


def test_unsupported_teacher_is_refused(models, tmp_path):
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=T.V, n_embd=16, n_layer=1, n_head=2)
    )
    with pytest.raises(ValueError, match="teacher_model.*GPT2LMHeadModel"):
        LogitlessDistillationTrainer(
            model=models[0],
            teacher_model=gpt2,
            args=trl.DistillationConfig(
                output_dir=str(tmp_path), bf16=False, use_cpu=True, report_to=[]
            ),
            train_dataset=T.dataset(),
            processing_class=T.TOKENIZERS[models[0]],
        )
