"""``batch_invariant=True`` through the HF functions: the head's numbers at a position do not
depend on the other positions of the call (the backbone's are the model's own business, so
the backbone runs on the same inputs throughout and only the head's company changes)."""

from __future__ import annotations

import pytest
import torch

import logitless
from logitless.integrations import hf

transformers = pytest.importorskip("transformers")  # the [hf] extra: installed in CI

B, T, V = 3, 24, 20000  # V wider than one CPU vocabulary tile


def _model():
    cfg = transformers.Qwen2Config(vocab_size=V, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1)  # fmt: skip
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(cfg).eval()


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (B, T), generator=g)
    wide = torch.zeros(B, T, dtype=torch.bool)
    wide[:, 4:] = True  # every response position
    narrow = torch.zeros(B, T, dtype=torch.bool)
    narrow[0, 20:] = True  # a few of them: the head sees another row count
    return ids, wide, narrow


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_logprobs_at_a_position_do_not_depend_on_the_other_positions():
    model, (ids, wide, narrow) = _model(), _batch()
    with torch.no_grad():
        full = hf.causal_lm_logprobs(
            model, ids, response_mask=wide, with_entropy=True, batch_invariant=True
        )
        few = hf.causal_lm_logprobs(
            model, ids, response_mask=narrow, with_entropy=True, batch_invariant=True
        )
        # the op itself on those rows alone gives the same bits
        hidden = hf.causal_lm_hidden_states(model, ids)
        labels = hf.causal_lm_labels(ids, response_mask=narrow)
        alone = logitless.linear_logprobs(
            hidden[narrow], model.lm_head.weight, labels[narrow], with_entropy=True,
            batch_invariant=True,
        )  # fmt: skip
    assert _bits_equal(full.logprobs[narrow], few.logprobs[narrow])
    assert _bits_equal(full.entropy[narrow], few.entropy[narrow])
    assert _bits_equal(alone.logprobs, few.logprobs[narrow])


def test_policy_loss_ratio_on_unchanged_weights_is_exactly_one():
    """Old log-probs recorded on the whole batch, the loss on a few positions: with the mode
    every ratio is 1.0 (the metrics' extremes are exact)."""
    model, (ids, wide, narrow) = _model(), _batch()
    with torch.no_grad():
        old = hf.causal_lm_logprobs(model, ids, response_mask=wide, batch_invariant=True)
    loss, metrics = hf.causal_lm_policy_loss(
        model, ids, old.logprobs, torch.tensor([1.0, -0.5, 0.25]),
        config=logitless.PolicyLossConfig(), response_mask=narrow, batch_invariant=True,
    )  # fmt: skip
    loss.backward()
    assert float(metrics["ratio_min"]) == 1.0 and float(metrics["ratio_max"]) == 1.0


def test_divergence_takes_the_option():
    model, (ids, wide, narrow) = _model(), _batch()
    teacher = _model()
    with torch.no_grad():
        full = hf.causal_lm_divergence(model, teacher, ids, response_mask=wide,
                                       batch_invariant=True)  # fmt: skip
        few = hf.causal_lm_divergence(model, teacher, ids, response_mask=narrow,
                                      batch_invariant=True)  # fmt: skip
    assert _bits_equal(full.divergence[narrow], few.divergence[narrow])
