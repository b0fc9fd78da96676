"""The rollout-mismatch diagnostics through verl's FSDP engine (``impl_backend=logitless``).

verl 0.9's vLLM rollout asks for the sampled token's log-prob only, so no top-k reaches the
actor; the documented way (docs/rollout-mismatch.md, "verl") is a recipe's engine that adds the
micro-batch's top-k to the model inputs verl builds and keeps the forward's
``rollout_mismatch`` (examples/verl_rollout_topk.py, the docs' excerpt), run here through verl's
own ``forward_step`` (remove-padding micro-batch), against the float64 truth of the model's
logits.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from _engine import cpu_devices, engine, micro_batch, patched, tiny_model

import logitless
from logitless import RolloutTopK

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "examples"))
from _rollout import FLOAT_FIELDS, engine_topk, truth  # noqa: E402
from _tolerance import assert_no_worse_than_reference  # noqa: E402
from verl_rollout_topk import RolloutTopKEngine  # noqa: E402  (the docs' recipe)

SEQS = [[5, 6, 7, 8, 9, 3, 2], [10, 11, 12], [13, 14, 15, 16, 1], [40, 41]]


@pytest.fixture(autouse=True)
def _cpu(monkeypatch):
    cpu_devices(monkeypatch)


def test_a_recipe_engine_logs_the_mismatch():
    model = tiny_model()
    packed = torch.tensor([t for s in SEQS for t in s])
    with torch.no_grad():  # the model's own logits, each sequence its own row (the truth)
        z32 = torch.cat([model(torch.tensor([s])).logits[0] for s in SEQS])
        z64 = torch.cat([model.double()(torch.tensor([s])).logits[0] for s in SEQS])
        model.float()
    # the engine: a perturbed copy; its top-k of the distribution each token was sampled from
    # (row t: token t's), -1 at each sequence's first token (the prompt)
    g = torch.Generator().manual_seed(2)
    engine_lp = z64 + 0.4 * torch.randn(z64.shape, generator=g, dtype=torch.float64)
    engine_lp = engine_lp.log_softmax(-1)
    nxt = torch.cat([packed[1:], packed[:1]])  # the token each position's distribution gave
    first = torch.cat([torch.tensor([0]), torch.tensor([len(s) for s in SEQS]).cumsum(0)[:-1]])
    last = torch.tensor([len(s) for s in SEQS]).cumsum(0) - 1
    nxt[last] = -1  # a sequence's last position has no next token
    at_position = engine_topk(engine_lp, nxt, 4)  # row t: the distribution at position t
    rows_ids = torch.full_like(at_position.token_ids, -1)
    rows_lps = torch.zeros_like(at_position.logprobs)
    rows_ids[1:], rows_lps[1:] = at_position.token_ids[:-1], at_position.logprobs[:-1]  # token t's
    rows_ids[first] = -1
    batch = micro_batch(SEQS)
    split = [len(s) for s in SEQS]
    batch["rollout_topk_ids"] = torch.nested.as_nested_tensor(
        list(rows_ids.split(split)), layout=torch.jagged
    )
    batch["rollout_topk_logprobs"] = torch.nested.as_nested_tensor(
        list(rows_lps.split(split)), layout=torch.jagged
    )
    eng = engine(patched(model, "logitless"))
    eng.__class__ = RolloutTopKEngine
    seen = {}

    def loss_function(model_output, data, dp_group):
        seen.update(model_output)
        return model_output["log_probs"].values().sum() * 0.0, {}

    with torch.no_grad():
        eng.forward_step(batch, loss_function=loss_function, forward_only=True)
    found = logitless.types.RolloutMismatch(**seen["rollout_mismatch"])
    labels = torch.where(nxt >= 0, nxt, -100)[None]
    topk = RolloutTopK(at_position.token_ids[None], at_position.logprobs[None])
    want, ref = truth(z64, labels, topk), truth(z32.float(), labels, topk)
    for field in FLOAT_FIELDS:
        got = getattr(found, field)[:, : len(packed)]
        assert_no_worse_than_reference(got, ref[field], want[field], field)
    assert torch.equal(found.compared[:, : len(packed)], want["compared"])
    assert want["compared"].sum() == len(packed) - len(SEQS)
