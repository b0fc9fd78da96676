"""logitless.integrations.trl against the real TRL ``GRPOTrainer`` (CPU, fp32, nothing downloaded).

For tiny random transformers models built from configs and a word-level tokenizer built here:

op     = LogitlessGRPOTrainer.compute_loss                  (logitless head and fused loss)
ref    = trl.GRPOTrainer.compute_loss                       (TRL's own chunked head, fp32)
truth  = trl.GRPOTrainer.compute_loss on a float64 copy of the model, its log-probs taken from
         the model's full float64 logits (TRL's loss code itself, in float64)

on the same batch, scored by TRL (``_generate_and_score_completions``) from a deterministic
rollout. The loss and the gradient of every parameter: |op - truth| within 4x |ref - truth|
(max and rms) plus one fp32 ulp of scale (tests/_tolerance.py); the logged metrics equal TRL's.
Then a short ``train()`` (generation, rewards, 2 iterations, gradient accumulation 2) stock vs
adapter, and the options logitless cannot honour, refused before training.
"""

from __future__ import annotations

import math
import types

import pytest
import torch
from _tolerance import assert_no_worse_than_reference

trl = pytest.importorskip(
    "trl", reason="TRL is not installed (pip install -e '.[trl]' in a logitless checkout)"
)
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

from _trl import (  # noqa: E402  (the shared TRL harness)
    EOS,
    RUN,
    TOKENIZERS,
    V,
    assert_same_run,
    dataset,
    grpo_args,
    grpo_trainer,
    initial,
    lora_base,
    reward,
    save_model,
    single_thread,
)

from logitless.integrations.trl import (  # noqa: E402
    LogitlessGRPOMixin,
    LogitlessGRPOTrainer,
    grpo_loss_config,
)

PROMPTS = 8

_one_thread = pytest.fixture(autouse=True, scope="module")(single_thread)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Qwen2 saved locally (the trainer loads the policy, and with beta > 0 the
    reference model, from this path); the word-level tokenizer is kept in memory."""
    return save_model(tmp_path_factory.mktemp("tiny_qwen2"))


# --------------------------------------------------------------------------------------------
# a deterministic rollout (TRL's rollout_func hook): random completions of varied lengths, some
# ending in EOS, with "inference engine" log-probs = the policy's own + noise (one unscored)


def _rollout(prompts, trainer):
    g = torch.Generator().manual_seed(1234)
    tok = trainer.processing_class
    prompt_ids = [tok(p)["input_ids"] for p in prompts]
    completion_ids, logprobs = [], []
    for i, ids in enumerate(prompt_ids):
        n = 3 + int(torch.randint(0, 5, (1,), generator=g))
        comp = torch.randint(3, V, (n,), generator=g).tolist()
        if i % 3 == 0:
            comp[-1] = EOS
        with torch.no_grad():
            logits = trainer.model(torch.tensor([ids + comp]), use_cache=False).logits[0].float()
        lp = (logits[len(ids) - 1 : -1] / trainer.temperature).log_softmax(-1)
        lp = lp.gather(-1, torch.tensor(comp)[:, None])[:, 0]
        noisy = (lp + 0.15 * torch.randn(n, generator=g)).tolist()
        if i == 1:
            noisy[0] = None  # a token the engine could not score
        completion_ids.append(comp)
        logprobs.append(noisy)
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}


def _score(trainer, vllm: bool):
    """TRL scores the rollout: advantages, old / reference / sampling log-probs, IS ratios."""
    trainer.rollout_func = _rollout
    if vllm:
        trainer._last_loaded_step = trainer.state.global_step  # no vLLM weight sync to do
    trainer.model.train()
    ds = trainer.train_dataset
    return trainer._generate_and_score_completions([ds[i % len(ds)] for i in range(PROMPTS)])


# --------------------------------------------------------------------------------------------
# the float64 truth: TRL's loss code on a float64 model, log-probs from its full logits


def _full_logits_logps(self, model, input_ids, attention_mask, logits_to_keep, **kwargs):
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    logits = logits[:, -logits_to_keep - 1 : -1] / self.temperature
    logp = logits.log_softmax(-1)
    target = input_ids[:, -logits_to_keep:]
    lp = logp.gather(-1, target[..., None])[..., 0]
    entropy = -(logp.exp() * logp).sum(-1)
    return lp, entropy, None


def _double(inputs):
    return {
        k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
        for k, v in inputs.items()
    }


def _loss_and_grads(trainer, inputs):
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(trainer.model, dict(inputs))
    if loss.requires_grad:
        loss.backward()
    grads = {n: p.grad for n, p in trainer.model.named_parameters() if p.grad is not None}
    metrics = {
        k: v[-1] for k, v in trainer._metrics["train" if trainer.model.training else "eval"].items()
    }
    return loss.detach(), grads, metrics


def _same_off_policy_step(ours, stock):
    """Both trainers' ``(loss, grads, metrics)`` on one off-policy batch of stock's (two
    accumulation steps, training mode); the losses and every gradient must be equal."""
    inputs = _batch(stock, ("off_policy",))
    for t in (ours, stock):
        t.current_gradient_accumulation_steps = 2
        t.model.train()
    a, b = _loss_and_grads(ours, inputs), _loss_and_grads(stock, inputs)
    torch.testing.assert_close(a[0], b[0], rtol=1e-5, atol=1e-7)
    assert set(a[1]) == set(b[1])
    for k in b[1]:
        torch.testing.assert_close(a[1][k], b[1][k], rtol=1e-4, atol=1e-6, msg=k)
    return a, b


def _same_train_run(model_dir, tmp_path) -> None:
    """A short ``train()`` of stock TRL and of logitless: the same run (tests/_trl.py)."""
    stock_run = _train(trl.GRPOTrainer, model_dir, tmp_path / "a")
    ours_run = _train(LogitlessGRPOTrainer, model_dir, tmp_path / "b")
    assert assert_same_run(*stock_run, *ours_run, initial(model_dir)) > 0


# name -> (GRPOConfig options, trainer attributes set after construction, batch tweaks)
# tweaks: "off_policy" (stale old log-probs, as with num_iterations > 1), "tools" (a tool mask),
# "eval" (eval mode: no accumulation scaling)
COMBOS = {
    "dapo_default_on_policy": ({}, {}, ()),
    "dapo_clip_higher_off_policy": ({"epsilon_high": 0.28}, {}, ("off_policy",)),
    "grpo_beta_bias_corrected": ({"loss_type": "grpo", "beta": 0.05}, {}, ("off_policy",)),
    "grpo_beta_plain_kl": (
        {"loss_type": "grpo", "beta": 0.05, "use_bias_correction_kl": False},
        {},
        ("off_policy",),
    ),
    "bnpo_entropy_bonus": ({"loss_type": "bnpo", "entropy_coef": 0.02}, {}, ("off_policy",)),
    "dr_grpo_temperature": ({"loss_type": "dr_grpo", "temperature": 0.7}, {}, ("off_policy",)),
    "cispo_beta": (
        {"loss_type": "cispo", "epsilon_high": 3.0, "beta": 0.1},
        {},
        ("off_policy",),
    ),
    "sapo_entropy_bonus": ({"loss_type": "sapo", "entropy_coef": 0.03}, {}, ("off_policy",)),
    "luspo_sequence_beta": (
        {"loss_type": "luspo", "importance_sampling_level": "sequence", "beta": 0.1},
        {},
        ("off_policy",),
    ),
    "gspo_bias_corrected_kl": (
        {
            "loss_type": "grpo",
            "importance_sampling_level": "sequence",
            "epsilon": 3e-2,
            "epsilon_high": 4e-2,
            "beta": 0.1,
        },
        {},
        ("off_policy",),
    ),
    "dapo_sequence_level": ({"importance_sampling_level": "sequence"}, {}, ("off_policy",)),
    "dapo_delta_two_sided": ({"delta": 1.4}, {}, ("off_policy",)),
    "top_entropy_quantile": ({"top_entropy_quantile": 0.4}, {}, ("off_policy",)),
    "off_policy_mask_entropy_kl": (
        {"off_policy_mask_threshold": 0.02, "entropy_coef": 0.05, "beta": 0.04},
        {},
        ("off_policy",),
    ),
    "steps_per_generation_4": ({"steps_per_generation": 4}, {}, ("off_policy",)),
    "tool_mask_truncated": (
        {"mask_truncated_completions": True, "loss_type": "grpo"},
        {},
        ("off_policy", "tools"),
    ),
    "eval_mode_dapo_entropy": ({"entropy_coef": 0.02, "beta": 0.05}, {}, ("off_policy", "eval")),
}
# TRL's vLLM importance-sampling correction (use_vllm needs vLLM at construction: set after)
for _mode, _low, _high in (
    ("token_truncate", 0.8, 1.2),
    ("token_truncate", 0.0, 1.2),  # TRL accepts a floor of 0: no floor (issue 21)
    ("token_mask", 0.0, 1.5),
    ("token_mask", 0.85, 1.15),
    ("sequence_truncate", 0.9, 1.1),
    ("sequence_mask", None, 3.0),  # TRL's default
    ("sequence_mask", 0.7, 1.3),
):
    COMBOS[f"vllm_{_mode}_{_low}_{_high}"] = (
        {"loss_type": "grpo" if "token" in _mode else "dapo"},
        {
            "use_vllm": True,
            "vllm_importance_sampling_correction": True,
            "vllm_importance_sampling_mode": _mode,
            "vllm_importance_sampling_clip_min": _low,
            "vllm_importance_sampling_clip_max": _high,
        },
        (),
    )


def _batch(stock, tweaks):
    inputs = _score(stock, vllm=getattr(stock, "use_vllm", False))
    g = torch.Generator().manual_seed(7)
    if "off_policy" in tweaks and "old_per_token_logps" not in inputs:
        with torch.no_grad():
            ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
            att = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
            now, _, _ = stock._get_per_token_logps_and_entropies(
                stock.model, ids, att, inputs["completion_ids"].shape[1]
            )
        noise = 0.2 * torch.randn(now.shape, generator=g)
        inputs["old_per_token_logps"] = now + noise  # the policy moved since the rollout
    if "ref_per_token_logps" in inputs:  # the policy has moved away from the reference
        ref = inputs["ref_per_token_logps"]
        inputs["ref_per_token_logps"] = ref + 0.3 * torch.randn(ref.shape, generator=g)
    if "tools" in tweaks:
        tool = torch.ones_like(inputs["completion_mask"])
        tool[::3, 1:3] = 0  # tool-output tokens: attended, not trained on
        inputs["tool_mask"] = tool
    return inputs


@pytest.mark.parametrize("name", list(COMBOS))
def test_compute_loss_matches_trl(name, model_dir, tmp_path):
    options, attrs, tweaks = COMBOS[name]
    args = grpo_args(tmp_path, **options)
    stock = grpo_trainer(trl.GRPOTrainer, model_dir, args, **attrs)
    ours = grpo_trainer(LogitlessGRPOTrainer, model_dir, args, **attrs)
    truth = grpo_trainer(trl.GRPOTrainer, model_dir, args, **attrs)
    truth.model.double()
    truth._get_per_token_logps_and_entropies = types.MethodType(_full_logits_logps, truth)
    inputs = _batch(stock, tweaks)
    for t in (stock, ours, truth):
        t.current_gradient_accumulation_steps = args.gradient_accumulation_steps
        t.model.train("eval" not in tweaks)
    if "eval" in tweaks:
        with torch.no_grad():
            results = [_loss_and_grads(t, i) for t, i in ((ours, inputs), (stock, inputs))]
            true = _loss_and_grads(truth, _double(inputs))
    else:
        results = [_loss_and_grads(t, i) for t, i in ((ours, inputs), (stock, inputs))]
        true = _loss_and_grads(truth, _double(inputs))
    (op_loss, op_grads, op_metrics), (ref_loss, ref_grads, ref_metrics) = results
    assert_no_worse_than_reference(op_loss, ref_loss, true[0], f"{name}: loss")
    assert set(op_grads) == set(ref_grads) == set(true[1])
    assert ("eval" in tweaks) == (not op_grads)
    for param, g in op_grads.items():
        assert_no_worse_than_reference(g, ref_grads[param], true[1][param], f"{name}: {param}")
    # the same metric names with the same values (the batch's own, logged by TRL's scoring,
    # are in both trainers' logs only in the stock one, which scored it)
    loss_metrics = {k for k in ref_metrics if k not in op_metrics}
    assert loss_metrics <= {"num_tokens", "reward", "reward_std", "frac_reward_zero_std"} | {
        k for k in ref_metrics if k.startswith(("completions/", "rewards/", "sampling/"))
    }
    for key, value in op_metrics.items():
        assert value == pytest.approx(ref_metrics[key], rel=1e-4, abs=1e-6), key


def test_compute_loss_under_bf16_matches_trl(model_dir, tmp_path):
    """TRL's default ``bf16=True``: stock TRL scores and computes its loss under the
    accelerator's autocast (the head in bf16), and so does the adapter. The metrics computed
    from the head (entropy, kl) equal TRL's, which they would not with an fp32 head (2.7976 vs
    2.7973 here); the loss and every gradient are within 4x TRL's own bf16 error against the
    same loss computed without autocast (an fp32 stock trainer on the same batch). The
    log-probs and entropies TRL takes when it scores a batch (old policy, reference) are TRL's
    to within 1% of its own bf16 error (an fp32 head would be 100x that away)."""
    options, attrs, tweaks = COMBOS["off_policy_mask_entropy_kl"]
    results, scored, inputs = {}, {}, None
    # One after the other: the accelerator's mixed-precision setting is process-wide state.
    for name, cls, bf16 in (
        ("fp32", trl.GRPOTrainer, False),
        ("stock", trl.GRPOTrainer, True),
        ("ours", LogitlessGRPOTrainer, True),
    ):
        args = grpo_args(tmp_path / name, **options, bf16=bf16)
        trainer = grpo_trainer(cls, model_dir, args, **attrs)
        assert trainer.accelerator.mixed_precision == ("bf16" if bf16 else "no")
        trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps
        inputs = _batch(trainer, tweaks) if inputs is None else inputs
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        with torch.no_grad():
            scored[name] = trainer._get_per_token_logps_and_entropies(
                trainer.model, ids, attention, inputs["completion_ids"].shape[1],
                compute_entropy=True,
            )[:2]  # fmt: skip
        trainer.model.train()
        results[name] = _loss_and_grads(trainer, inputs)
    mask = inputs["completion_mask"].bool()
    for i, what in enumerate(("log-probs", "entropies")):
        op, ref, true = (scored[k][i][mask] for k in ("ours", "stock", "fp32"))
        atol = 0.01 * float((ref - true).abs().max())
        torch.testing.assert_close(op, ref, rtol=0.0, atol=atol, msg=f"scoring {what}")
    (op_loss, op_grads, op_metrics), (ref_loss, ref_grads, ref_metrics) = (
        results["ours"],
        results["stock"],
    )
    true_loss, true_grads, true_metrics = results["fp32"]
    assert_no_worse_than_reference(op_loss, ref_loss, true_loss, "bf16 loss")
    assert set(op_grads) == set(ref_grads) == set(true_grads)
    for param, g in op_grads.items():
        assert_no_worse_than_reference(g, ref_grads[param], true_grads[param], f"bf16 {param}")
    for key in ("entropy", "kl"):
        assert op_metrics[key] == pytest.approx(ref_metrics[key], rel=1e-5), key
    assert op_metrics["entropy"] != pytest.approx(true_metrics["entropy"], rel=1e-5)


def test_batch_invariant_reaches_every_head_call(model_dir, tmp_path, monkeypatch):
    """``LogitlessGRPOTrainer(..., batch_invariant=True)``: the scoring passes (old policy,
    reference) and the loss's head calls all run in the mode; the loss is the default mode's
    up to rounding. A value that is not a bool is refused."""
    from logitless.integrations import hf, seam

    options, attrs, tweaks = COMBOS["off_policy_mask_entropy_kl"]
    seen: list[object] = []

    def spy(fn):
        def wrapped(*args, **kwargs):
            if fn.__name__ == "causal_lm_logprobs":
                flag = kwargs.get("batch_invariant")
            else:  # the seam's head calls: their prepared call's options
                flag = args[0].options.batch_invariant
            seen.append((fn.__name__, flag))
            return fn(*args, **kwargs)

        return wrapped

    losses = {}
    for invariant in (False, True):
        trainer = LogitlessGRPOTrainer(
            model=model_dir, reward_funcs=reward, train_dataset=dataset(),
            args=grpo_args(tmp_path / str(invariant), **options),
            processing_class=TOKENIZERS[model_dir],
            batch_invariant=invariant,
        )  # fmt: skip
        trainer.current_gradient_accumulation_steps = 2
        if invariant:
            for name in ("logprobs", "policy_loss"):
                monkeypatch.setattr(seam, name, spy(getattr(seam, name)))
            monkeypatch.setattr(hf, "causal_lm_logprobs", spy(hf.causal_lm_logprobs))
        inputs = _batch(trainer, tweaks)
        trainer.model.train()
        losses[invariant] = _loss_and_grads(trainer, inputs)[0]
    names = {name for name, _ in seen}
    assert names == {"causal_lm_logprobs", "logprobs", "policy_loss"}, seen
    assert all(flag is True for _, flag in seen), seen
    torch.testing.assert_close(losses[True], losses[False], rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="batch_invariant must be a bool"):
        LogitlessGRPOTrainer(
            model=model_dir, reward_funcs=reward, args=grpo_args(tmp_path / "bad"),
            train_dataset=dataset(), processing_class=TOKENIZERS[model_dir],
            batch_invariant="yes",
        )  # fmt: skip


def test_loss_configs_of_trl_presets():
    """The PolicyLossConfig each TRL preset maps to (the table of docs/trl.md)."""

    def cfg(**options):
        return trl.GRPOConfig(
            output_dir="unused", report_to=[], bf16=False, use_cpu=True, **options
        )

    dapo = grpo_loss_config(cfg())
    assert (dapo.surrogate, dapo.clip_low, dapo.clip_high, dapo.aggregation) == (
        "ppo_clip",
        0.2,
        0.2,
        "token_mean",
    )
    grpo = grpo_loss_config(cfg(loss_type="grpo", beta=0.04))
    assert grpo.aggregation == "seq_mean_token_mean"
    assert (grpo.kl_coef, grpo.kl_importance_weight, grpo.kl_value_clamp) == (0.04, True, None)
    cap = cfg(vllm_importance_sampling_cap=2.5)
    cap.use_vllm = True  # the deprecated cap is clip_max
    assert grpo_loss_config(cap).mismatch_seq_mask_range == (0.0, 2.5)


# --------------------------------------------------------------------------------------------
# a short training run, stock vs adapter


def _train(cls, model_dir, tmp_path, peft_config=None, **options):
    args = grpo_args(tmp_path, **(RUN | options))
    trainer = grpo_trainer(cls, model_dir, args, peft_config)
    trainer.train()
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return trainer.state.log_history, params


@pytest.mark.parametrize(
    "options",
    [{}, {"loss_type": "grpo", "beta": 0.05, "entropy_coef": 0.01, "gradient_checkpointing": True}],
    ids=["dapo", "grpo_kl_entropy_checkpointing"],
)
def test_train_matches_trl(options, model_dir, tmp_path):
    """Generation with model.generate, rewards, 2 iterations of the batch (off-policy old
    log-probs on the second), gradient accumulation 2: the same losses, metrics and weights."""
    stock_log, stock_params = _train(trl.GRPOTrainer, model_dir, tmp_path / "a", **options)
    ours_log, ours_params = _train(LogitlessGRPOTrainer, model_dir, tmp_path / "b", **options)
    moved = assert_same_run(stock_log, stock_params, ours_log, ours_params, initial(model_dir))
    assert moved > 0  # the run trained


# --------------------------------------------------------------------------------------------
# what logitless cannot honour: refused at construction, naming the option


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"loss_type": "vespo"}, "loss_type='vespo'"),
        ({"use_adaptive_entropy": True}, "use_adaptive_entropy"),
        ({"top_entropy_quantile": 0.5, "entropy_coef": 0.01}, "top_entropy_quantile"),
        ({"loss_type": "cispo"}, "epsilon_high"),  # TRL's default caps the weight at 0.2
        ({"delta": 1.1, "epsilon_high": 0.28}, "delta"),
        ({"cast_lm_head_to_fp32": True}, "cast_lm_head_to_fp32"),
    ],
)
def test_unsupported_options_raise_before_training(options, match, model_dir, tmp_path):
    with pytest.raises(ValueError, match=match):
        grpo_trainer(LogitlessGRPOTrainer, model_dir, grpo_args(tmp_path, **options))


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"epsilon": -0.5}, r"cannot honour epsilon=-0\.5"),
        ({"loss_type": "sapo", "sapo_temperature_neg": 0.0}, r"sapo_temperature_neg=0\.0"),
    ],
)
def test_an_option_that_maps_to_an_invalid_value_is_named(options, match, tmp_path):
    """The error names the TRL option the user set, not the logitless field it became."""
    with pytest.raises(ValueError, match=match):
        grpo_loss_config(grpo_args(tmp_path, **options))


def test_floor_of_zero_is_no_floor(tmp_path):
    args = grpo_args(
        tmp_path,
        use_vllm=True,
        vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode="token_truncate",
        vllm_importance_sampling_clip_min=0.0,
    )
    assert grpo_loss_config(args).mismatch_is_floor is None


def test_unsupported_model_and_later_changes_raise(tmp_path, model_dir):
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=V, n_embd=16, n_layer=1, n_head=2)
    )
    tok = TOKENIZERS[model_dir]
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        LogitlessGRPOTrainer(
            model=gpt2,
            reward_funcs=reward,
            args=grpo_args(tmp_path),
            train_dataset=dataset(),
            processing_class=tok,
        )
    # an option changed after construction is caught at the next loss, before any compute
    trainer = grpo_trainer(LogitlessGRPOTrainer, model_dir, grpo_args(tmp_path))
    inputs = _score(trainer, vllm=False)
    trainer.current_gradient_accumulation_steps = 2
    trainer.loss_type = "vespo"
    with pytest.raises(ValueError, match="vespo"):
        trainer.compute_loss(trainer.model, inputs)


@pytest.mark.parametrize("temperature", [0.0, float("nan")])
def test_a_bad_temperature_raises_before_the_backbone(tmp_path, model_dir, temperature):
    """The head call is checked (the seam's prepare) before the backbone's forward runs:
    a temperature TRL lets through costs no forward (it was refused inside the head, after
    the whole backbone had run)."""
    trainer = grpo_trainer(LogitlessGRPOTrainer, model_dir, grpo_args(tmp_path))
    inputs = _score(trainer, vllm=False)
    trainer.current_gradient_accumulation_steps = 2
    calls = []
    backbone = trainer.model.model
    handle = backbone.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        trainer.temperature = temperature
        with pytest.raises(ValueError, match="temperature"):
            trainer.compute_loss(trainer.model, inputs)
        assert calls == []
        trainer.temperature = 1.0  # the same batch runs once the option is good
        trainer.compute_loss(trainer.model, inputs)
        assert len(calls) == 1
    finally:
        handle.remove()


def test_mixin_on_a_user_subclass(model_dir, tmp_path):
    """A trainer of the user's own keeps its overrides; the mixin adds logitless' loss."""

    class MyTrainer(trl.GRPOTrainer):
        def marker(self):
            return "mine"

    class MyLogitlessTrainer(LogitlessGRPOMixin, MyTrainer):
        pass

    args = grpo_args(tmp_path, epsilon_high=0.28)
    ours = grpo_trainer(MyLogitlessTrainer, model_dir, args)
    stock = grpo_trainer(trl.GRPOTrainer, model_dir, args)
    assert ours.marker() == "mine"
    a, _ = _same_off_policy_step(ours, stock)
    assert math.isfinite(float(a[0]))


def test_no_full_logits_on_the_adapter_path(model_dir, tmp_path, monkeypatch):
    """Neither the loss nor TRL's scoring of completions calls lm_head or the model forward."""
    ours = grpo_trainer(LogitlessGRPOTrainer, model_dir, grpo_args(tmp_path, beta=0.05))
    inputs = _score(ours, vllm=False)  # the rollout itself calls model(...) for its log-probs
    calls = []
    for m in (ours.model, ours.ref_model):
        m.lm_head.register_forward_hook(lambda *a: calls.append("lm_head"))
    with torch.no_grad():
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        att = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        ours._get_per_token_logps_and_entropies(
            ours.ref_model, ids, att, inputs["completion_ids"].shape[1]
        )
    ours.current_gradient_accumulation_steps = 2
    ours.compute_loss(ours.model, inputs).backward()
    assert calls == []


# --------------------------------------------------------------------------------------------
# the preset table of docs/trl.md: rendered from the combinations tested above


def _config_text(config) -> str:
    from dataclasses import asdict, fields

    from logitless.integrations.trl.grpo import _NO_BOUND

    defaults = {f.name: f.default for f in fields(config)}

    def show(v):
        if isinstance(v, float) and v == _NO_BOUND:
            return "∞"
        if isinstance(v, tuple):
            return "(" + ", ".join(show(x) for x in v) + ")"
        return repr(v)

    items = [f"{k}={show(v)}" for k, v in asdict(config).items() if v != defaults[k]]
    return ", ".join(items) or "defaults"


def preset_table() -> str:
    """Markdown rows: the TRL options of each tested combination and its PolicyLossConfig."""
    rows = [
        "| tested case | TRL options (beyond `GRPOConfig` defaults) | `PolicyLossConfig` |",
        "|---|---|---|",
    ]
    for name, (options, attrs, _) in COMBOS.items():
        args = trl.GRPOConfig(
            output_dir="unused", report_to=[], bf16=False, use_cpu=True, **options
        )
        for k, v in attrs.items():
            setattr(args, k, v)
        trl_text = ", ".join(f"`{k}={v!r}`" for k, v in {**options, **attrs}.items()) or "—"
        rows.append(f"| `{name}` | {trl_text} | `{_config_text(grpo_loss_config(args))}` |")
    return "\n".join(rows) + "\n"


DOC = __import__("pathlib").Path(__file__).resolve().parents[1] / "docs" / "trl.md"


def test_docs_preset_table_is_the_tested_one():
    """docs/trl.md carries the table rendered from COMBOS (regenerate: python tests/test_trl.py)."""
    text = DOC.read_text()
    begin, end = "<!-- trl-presets:begin -->\n", "<!-- trl-presets:end -->"
    assert begin in text and end in text
    current = text.split(begin, 1)[1].split(end, 1)[0]
    assert current == preset_table(), "docs/trl.md preset table is stale:\n" + preset_table()


def test_docs_examples_run():
    import re

    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert blocks
    for i, block in enumerate(blocks):
        exec(compile(block, f"docs/trl.md[python block {i}]", "exec"), {})


if __name__ == "__main__":
    print(preset_table(), end="")


def test_module_doctests():
    import doctest

    from logitless.integrations.trl import common, distillation, grpo

    for module in (grpo, distillation, common):
        result = doctest.testmod(module, raise_on_error=False)
        assert result.failed == 0, module.__name__
    assert doctest.testmod(grpo).attempted > 0 and doctest.testmod(common).attempted > 0


# --------------------------------------------------------------------------------------------
# LoRA (PEFT) and a mixture-of-experts model, single process


def test_lora_train_matches_trl(model_dir, tmp_path):
    """A LoRA adapter on the attention projections, beta > 0 (the reference log-probs come
    from the policy with its adapter disabled): the same run as TRL's, and only the adapters
    move."""
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    options = {"beta": 0.05, "learning_rate": 0.5}
    stock = _train(trl.GRPOTrainer, model_dir, tmp_path / "a", lora, **options)
    ours = _train(LogitlessGRPOTrainer, model_dir, tmp_path / "b", lora, **options)
    base = lora_base(model_dir, ours[1])
    moved = assert_same_run(*stock, *ours, base)
    lora_params = [n for n in ours[1] if "lora_" in n]
    assert lora_params and moved == len(lora_params)  # the adapters, and nothing else


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return save_model(tmp_path_factory.mktemp("tiny_qwen3_moe"), moe=True)


def test_moe_loss_and_train_match_trl(moe_dir, tmp_path):
    """Qwen3-MoE with the router load-balancing loss (the config's coefficient): the loss,
    every gradient (the routers' included) and the aux_loss metric equal TRL's; then a short
    train()."""
    args = grpo_args(tmp_path)
    ours = grpo_trainer(LogitlessGRPOTrainer, moe_dir, args)
    stock = grpo_trainer(trl.GRPOTrainer, moe_dir, args)
    assert stock.aux_loss_enabled and stock.router_aux_loss_coef == 0.02
    a, b = _same_off_policy_step(ours, stock)
    assert a[2]["aux_loss"] == pytest.approx(b[2]["aux_loss"], rel=1e-5)
    assert any("gate" in k for k in b[1])
    _same_train_run(moe_dir, tmp_path)


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    return save_model(tmp_path_factory.mktemp("tiny_qwen3_5_text"), hybrid=True)


def test_qwen3_5_text_model_loss_and_train_match_trl(hybrid_dir, tmp_path):
    """A Qwen3.5 checkpoint as TRL loads it (AutoModelForCausalLM: the text model, Gated
    DeltaNet and attention layers; one completion per padded row): the loss and every
    gradient equal TRL's; then a short train()."""
    args = grpo_args(tmp_path)
    ours = grpo_trainer(LogitlessGRPOTrainer, hybrid_dir, args)
    stock = grpo_trainer(trl.GRPOTrainer, hybrid_dir, args)
    assert type(stock.model).__name__ == "Qwen3_5ForCausalLM"
    a, b = _same_off_policy_step(ours, stock)
    assert any("linear_attn" in k for k in b[1])
    _same_train_run(hybrid_dir, tmp_path)
