"""The rollout-mismatch diagnostics in the trainers: the HF function (a packed row), TRL's GRPO
trainer (``rollout_topk=k``: vLLM's top-k recorded where TRL calls it, ``rollout_mismatch/*``
logged), Megatron's ``megatron.logprobs`` (TP=2, sequence parallel, a packed THD batch; gloo).

The engine is a perturbed copy of the policy; every output is held to the naive full-logits
computation's error against a float64 truth (tests/_rollout.py).

TRL's ``VLLMGeneration`` needs vLLM, which a CPU machine cannot install: the test gives the
trainer a stand-in with its interface (``logprobs``, ``generate`` returning what
``VLLMGeneration.generate`` returns: prompt ids, completion ids, up to ``logprobs + 1`` sorted
log-probs per position and their token ids; ``sync_weights``), sampling from the trainer's own
model with logit noise. Everything else is TRL's code.
"""

from __future__ import annotations

import math

import pytest
import torch
from _rollout import FLOAT_FIELDS, engine_topk, truth
from _tolerance import assert_no_worse_than_reference

import logitless
from logitless import RolloutTopK
from logitless.losses import rollout_mismatch_metrics


def _held(found, ref: dict, want: dict, name: str = "") -> None:
    for field in FLOAT_FIELDS:
        assert_no_worse_than_reference(getattr(found, field), ref[field], want[field], field + name)
    assert torch.equal(found.compared, want["compared"])
    assert torch.equal(found.top1_agree, want["top1_agree"])


# --- HF -----------------------------------------------------------------------------------


def _qwen2(seed: int = 0):
    import transformers

    cfg = transformers.Qwen2Config(
        vocab_size=120, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.3)
    return model


def test_hf_packed_row():
    """``causal_lm_logprobs(rollout_topk=)`` on one packed row of two documents: the
    diagnostics of the model's own logits (float64 copy: the truth), per document."""
    from logitless.integrations import hf

    model = _qwen2().eval()
    ids = torch.randint(0, 120, (1, 19))
    pos = torch.cat([torch.arange(11), torch.arange(8)])[None]
    labels = hf.causal_lm_labels(ids, position_ids=pos)
    with torch.no_grad():  # the truth: each document on its own (what packing keeps apart)
        z32 = torch.cat([model(ids[:, :11]).logits[0], model(ids[:, 11:]).logits[0]])
        model.double()
        z64 = torch.cat([model(ids[:, :11]).logits[0], model(ids[:, 11:]).logits[0]])
        model.float()
    g = torch.Generator().manual_seed(1)
    engine = (z64 + 0.5 * torch.randn(z64.shape, generator=g, dtype=torch.float64)).log_softmax(-1)
    topk = engine_topk(engine, labels[0], 5)
    topk = RolloutTopK(topk.token_ids[None], topk.logprobs[None])
    out = hf.causal_lm_logprobs(model, ids, position_ids=pos, rollout_topk=topk, with_entropy=True)
    plain = hf.causal_lm_logprobs(model, ids, position_ids=pos, with_entropy=True)
    assert torch.equal(out.logprobs, plain.logprobs) and torch.equal(out.entropy, plain.entropy)
    want = truth(z64, labels, topk)
    _held(out.mismatch, truth(z32, labels, topk), want)
    doc = torch.cat([torch.zeros(11), torch.ones(8)]).long()
    found = rollout_mismatch_metrics(out.mismatch, document_ids=doc[None])
    on = want["compared"][0]
    for d in range(2):
        at = on & (doc == d)
        torch.testing.assert_close(
            found.per_sequence["kl_rollout_trainer"][d],
            want["kl_rollout_trainer"][0][at].mean().float(), rtol=1e-4, atol=1e-6,
        )  # fmt: skip
    with pytest.raises(TypeError, match="rollout_topk"):  # not an argument of the loss function
        hf.causal_lm_policy_loss(model, ids, torch.zeros(1, 19), torch.ones(1), rollout_topk=topk)


# --- TRL ----------------------------------------------------------------------------------


class _Engine:
    """A stand-in for TRL's ``VLLMGeneration`` (vLLM cannot be installed here): samples
    completions from the trainer's model with logit noise (a perturbed copy of the policy)
    and returns what ``VLLMGeneration.generate`` returns for its ``logprobs`` setting."""

    def __init__(self, model, noise: float, length: int = 5) -> None:
        self.model, self.noise, self.length = model, noise, length
        self.logprobs = 0  # what TRL's GRPOTrainer builds it with
        self.calls: list[int] = []
        self.g = torch.Generator().manual_seed(3)

    def sync_weights(self) -> None:
        pass

    def generate(self, prompts, images=None, num_generations=1, profiler=None):
        self.calls.append(self.logprobs)
        completions, all_lps, all_ids = [], [], []
        for prompt in prompts[::num_generations]:  # TRL repeats each prompt per generation
            for _ in range(num_generations):
                comp, lps, ids = self._one(list(prompt))
                completions.append(comp)
                all_lps.append(lps)
                all_ids.append(ids)
        return prompts, completions, all_lps, all_ids

    def _one(self, prompt):
        seq, comp, lps, ids = list(prompt), [], [], []
        with torch.no_grad():
            for _ in range(self.length):
                z = self.model(torch.tensor([seq]), use_cache=False).logits[0, -1].double()
                lp = z + self.noise * torch.randn(z.shape, generator=self.g, dtype=z.dtype)
                lp = lp.log_softmax(-1)
                token = int(torch.multinomial(lp.exp(), 1, generator=self.g))
                top = lp.topk(self.logprobs) if self.logprobs else None
                pairs = {token: float(lp[token])}
                if top is not None:
                    pairs |= dict(zip(top.indices.tolist(), top.values.tolist(), strict=True))
                order = sorted(pairs.items(), key=lambda kv: -kv[1])
                ids.append([t for t, _ in order])
                lps.append([v for _, v in order])
                comp.append(token)
                seq.append(token)
        return comp, lps, ids


def test_trl_grpo_logs_the_mismatch(tmp_path):
    pytest.importorskip("trl")
    from _trl import grpo_args, save_model

    model_dir = save_model(tmp_path / "model")
    args = grpo_args(tmp_path, per_device_train_batch_size=4, num_generations=4)
    trainer = _trainer_with_topk(model_dir, args, 4)
    trainer.use_vllm = True  # set after construction: TRL builds VLLMGeneration when it is on
    engine = _Engine(trainer.model, noise=0.4)
    trainer.vllm_generation = engine
    trainer._last_loaded_step = trainer.state.global_step  # no weight sync to do
    trainer.model.train()
    ds = trainer.train_dataset
    inputs = trainer._generate_and_score_completions([ds[i] for i in range(4)])
    assert engine.calls == [4] and engine.logprobs == 0  # asked for 4, put back after
    ids, lps = inputs["rollout_topk_ids"], inputs["rollout_topk_logprobs"]
    assert ids.shape[:2] == inputs["completion_ids"].shape and ids.shape[2] == 5
    # TRL kept the sampled token's log-prob, not the top-1's
    sampled = (ids == inputs["completion_ids"][..., None]) & (ids >= 0)
    torch.testing.assert_close(
        inputs["sampling_per_token_logps"][sampled.any(-1)], lps[sampled], rtol=0, atol=1e-6
    )
    trainer.current_gradient_accumulation_steps = 1
    trainer.compute_loss(trainer.model, inputs)
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items() if "rollout_mismatch" in k}
    want = _trl_truth(trainer, inputs)
    assert logged["rollout_mismatch/tokens"] == want.pop("tokens")
    for name, value in want.items():
        assert logged[f"rollout_mismatch/{name}"] == pytest.approx(value, rel=1e-4, abs=1e-6), name
    assert logged["rollout_mismatch/kl_rollout_trainer"] > 1e-3  # the noise is seen


def _trl_truth(trainer, inputs) -> dict:
    """The token means TRL should log: the definitions on the model's float64 logits."""
    prompt, comp = inputs["prompt_ids"], inputs["completion_ids"]
    ids = torch.cat([prompt, comp], 1)
    att = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    with torch.no_grad():
        z = trainer.model.double()(ids, attention_mask=att, use_cache=False).logits
        trainer.model.float()
    p, c = prompt.shape[1], comp.shape[1]
    z = z[:, p - 1 : p - 1 + c].reshape(-1, z.shape[-1]) / trainer.temperature
    labels = torch.where(inputs["completion_mask"].bool(), comp, -100)
    topk = RolloutTopK(inputs["rollout_topk_ids"], inputs["rollout_topk_logprobs"])
    want = truth(z, labels, topk)
    on = want["compared"]
    names = ("kl_rollout_trainer", "kl_trainer_rollout", "total_variation", "top1_agree")
    out = {name: float(want[name][on].double().mean()) for name in names}
    out["tokens"] = float(on.sum())
    return out


def test_trl_refusals(tmp_path):
    pytest.importorskip("trl")
    from _trl import grpo_args, save_model

    model_dir = save_model(tmp_path / "model")
    trainer = _trainer_with_topk(model_dir, grpo_args(tmp_path), 2)
    ds = trainer.train_dataset
    with pytest.raises(ValueError, match="rollout_topk without use_vllm"):
        trainer._generate_and_score_completions([ds[i] for i in range(8)])
    with pytest.raises(ValueError, match="rollout_topk must be None or an int >= 1"):
        _trainer_with_topk(model_dir, grpo_args(tmp_path), 0)


def _trainer_with_topk(model_dir: str, args, k):
    from _trl import TOKENIZERS, dataset, reward

    from logitless.integrations.trl import LogitlessGRPOTrainer

    return LogitlessGRPOTrainer(
        model=model_dir, reward_funcs=reward, args=args, train_dataset=dataset(),
        processing_class=TOKENIZERS[model_dir], rollout_topk=k,
    )  # fmt: skip


# --- Megatron -----------------------------------------------------------------------------


def _megatron_worker(rank: int, world: int) -> None:
    import _megatron_shim  # noqa: F401  (its warning filters, before megatron's imports)
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    from test_megatron import _batch, _mask, _model_inputs, _setup

    from logitless.integrations import megatron

    model, model64, _ = _setup(2, 1, True)
    batch = _batch(2, 1, True, packed=True)
    with torch.no_grad():
        z32, z64 = (
            gather_from_tensor_model_parallel_region(
                m(*_model_inputs(batch), packed_seq_params=batch["packed_seq_params"])
            ).transpose(0, 1)  # [B, S, V]
            for m in (model, model64)
        )
    labels = torch.where(_mask(batch), batch["labels"], -100)
    g = torch.Generator().manual_seed(5)
    engine = (z64 + 0.5 * torch.randn(z64.shape, generator=g, dtype=torch.float64)).log_softmax(-1)
    flat = engine_topk(engine.reshape(-1, engine.shape[-1]), labels.reshape(-1), 6)
    topk = RolloutTopK(*(t.reshape(*labels.shape, -1) for t in flat[:2]))
    out = megatron.logprobs(
        model, *_model_inputs(batch), batch["labels"], loss_mask=batch["loss_mask"],
        packed_seq_params=batch["packed_seq_params"], rollout_topk=topk, with_entropy=True,
    )  # fmt: skip
    n, v = labels.numel(), z64.shape[-1]
    want = truth(z64.reshape(n, v), labels, topk)
    _held(out.mismatch, truth(z32.reshape(n, v), labels, topk), want, f" rank {rank}")
    assert want["compared"].sum() > 10 and math.isfinite(
        float(out.mismatch.kl_rollout_trainer.sum())
    )
    found = rollout_mismatch_metrics(out.mismatch, _mask(batch), document_ids=batch["document_ids"])
    assert found.per_sequence["tokens"].sum() == want["compared"].sum()


def test_megatron_tp2_sequence_parallel_packed():
    pytest.importorskip("megatron.core", reason="the megatron extra: pip install -e '.[megatron]'")
    from _dist import spawn

    spawn(_megatron_worker, 2)


def test_a_logitless_name_is_refused_by_the_loss_functions():
    """``rollout_topk`` is an option of the log-prob functions; elsewhere it is refused by name
    (it would otherwise reach a backbone that drops it)."""
    from logitless.integrations import hf

    model = _qwen2()
    ids = torch.randint(0, 120, (1, 6))
    with pytest.raises(TypeError, match="rollout_topk"):
        hf.causal_lm_hidden_states(model, ids, rollout_topk=None)
    assert logitless.RolloutTopK is RolloutTopK
