"""Mixture-of-experts models in logitless.integrations.hf: the router's load-balancing loss.

For tiny random Qwen2-MoE, Qwen3-MoE and Mixtral models (4 experts, 2 per token):

op     = hf.causal_lm_policy_loss                      (backbone once, logitless head and loss,
                                                         + coef * the router loss of that call)
ref    = policy_loss on model(...).logits, + coef * model(..., output_router_logits=True).aux_loss
truth  = the same reference on a float64 copy of the model

The loss, the metrics (``aux_loss`` included) and the gradient of every parameter, the
routers' included, within the reference's own error against the truth (tests/_tolerance.py);
with the router loss on (the config's ``output_router_logits``, or a coefficient given as TRL
gives it) and off. The log-probs of these models are checked in tests/test_hf.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _tolerance import assert_no_worse_than_reference
from test_hf import (
    IGNORE,
    LOSS_CONFIGS,
    MOE_MODELS,
    _check_grads,
    _from_logits,
    _grads,
    _labels,
    _layout,
    _loss_inputs,
    _model,
)

from logitless import policy_loss
from logitless.integrations import hf

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _run(kind, model, lay, labels, p, coef):
    """(loss, metrics, grads); coef: the router loss's weight, 0 for none."""
    cfg = LOSS_CONFIGS["dapo_kl_entropy"]
    model.zero_grad(set_to_none=True)
    if kind == "op":
        given = {} if coef is None else {"router_aux_loss_coef": coef}
        loss, metrics = hf.causal_lm_policy_loss(
            model, lay["ids"], p["old"], p["adv"], config=cfg, ref_logprobs=p["ref"],
            temperature=0.9, **lay["kw"], **given,
        )  # fmt: skip
    else:
        weight = hf.causal_lm_router_aux_coef(model, coef)
        out = model(
            lay["ids"], use_cache=False, output_router_logits=weight != 0, **lay["model_kw"]
        )
        as_kind = (lambda t: t.double()) if kind == "truth" else (lambda t: t)
        lp, ent = _from_logits(as_kind(out.logits.float()), labels, 0.9)
        loss, metrics = policy_loss(
            lp, as_kind(p["old"]), as_kind(p["adv"]), labels != IGNORE, config=cfg,
            ref_logprobs=as_kind(p["ref"]), entropy=ent,
        )  # fmt: skip
        if weight != 0:
            loss = loss + weight * out.aux_loss
            metrics = {**metrics, "aux_loss": out.aux_loss.detach()}
    (1.5 * loss).backward()
    return loss.detach(), metrics, _grads(model)


@pytest.mark.parametrize(
    ("output_router_logits", "coef"),
    [(True, None), (False, None), (False, 0.05), (True, 0.0)],
    ids=["config_on", "config_off", "given_coef", "given_zero"],
)
@pytest.mark.parametrize("name", MOE_MODELS)
def test_policy_loss_with_the_router_loss(name, output_router_logits, coef):
    model = _model(name)
    model.config.output_router_logits = output_router_logits
    lay = _layout("left_pad", seed=4)
    labels = _labels(lay)
    p = _loss_inputs(model, lay, labels)
    op = _run("op", model, lay, labels, p, coef)
    ref = _run("ref", model, lay, labels, p, coef)
    truth = _run("truth", copy.deepcopy(model).double(), lay, labels, p, coef)
    on = hf.causal_lm_router_aux_coef(model, coef) != 0
    assert on == (output_router_logits if coef is None else coef != 0)
    assert set(op[1]) == set(ref[1]) and ("aux_loss" in op[1]) == on
    floor = int((labels != IGNORE).sum()) * torch.finfo(torch.float32).eps
    assert_no_worse_than_reference(op[0], ref[0], truth[0], "loss", floor=floor)
    for key in truth[1]:
        assert_no_worse_than_reference(op[1][key], ref[1][key], truth[1][key], key, floor=floor)
    _check_grads(op[2], ref[2], truth[2], labels.numel())
    routers = [n for n in op[2] if n.endswith(("gate.weight", "router.weight"))]
    assert routers and all(bool(op[2][n].abs().sum() > 0) for n in routers)


def test_the_router_loss_moves_the_routers():
    """The router loss is not a no-op on the routers' gradients (so the test above would
    catch a dropped term)."""
    model = _model("qwen3_moe")
    lay = _layout("left_pad", seed=4)
    labels = _labels(lay)
    p = _loss_inputs(model, lay, labels)
    without = _run("op", model, lay, labels, p, 0.0)[2]
    with_aux = _run("op", model, lay, labels, p, 0.5)[2]
    router = next(n for n in without if n.endswith("gate.weight"))
    assert not torch.allclose(without[router], with_aux[router], rtol=1e-3, atol=1e-6)


def test_router_coefficient_errors():
    dense = _model("llama")
    assert hf.causal_lm_router_aux_coef(dense) == 0.0
    with pytest.raises(ValueError, match="not a mixture-of-experts model"):
        hf.causal_lm_router_aux_coef(dense, 0.01)
    with pytest.raises(ValueError, match="finite and >= 0"):
        hf.causal_lm_router_aux_coef(_model("mixtral"), -1.0)
