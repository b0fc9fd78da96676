"""The HF functions on a DeepSpeed ZeRO-3 engine, 2 gloo ranks on the CPU accelerator.

Each rank scores its own batch (so a gradient that is not reduced differs between ranks) with
three engines built from one tiny Qwen2: stock (``engine(ids).logits``, the log-probs / loss /
divergence from the full logits), and logitless (the HF function on the engine). Every case
runs with every parameter partitioned (``stage3_param_persistence_threshold=0``, asserted), and
again under DeepSpeed's default threshold (1e5 elements: every parameter persistent, which is a
partition until DeepSpeed first gathers it in its module's forward: never, for a head whose
``lm_head`` forward does not run). The loss and every parameter's full gradient
(``safe_get_full_grad``, the average over the ranks after ZeRO-3's reduce-scatter) are held to
stock DeepSpeed's own error against a float64 truth (the same model unwrapped in float64,
gradients averaged over the ranks: tests/_tolerance.py). After the backward the head weight
must be partitioned again (no full-size copy kept; persistent weights aside, which DeepSpeed
keeps whole once gathered), no gather left open, and the head weight never read through
DeepSpeed's getter (which, inside the engine's forward, gathers a partitioned parameter for the
whole model's forward and backward).

One launch of 2 processes runs every case (tied and untied heads, both thresholds). A mutation
that closes the gather when the head's forward returns (``_close_early``), run last in the same
launch, must fail every kind: the log-prob op and the divergence read the weight again in
backward, and torch accumulates the fused loss's weight gradient only into a parameter of its
full shape.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _deepspeed import assert_partitioned, ds_env, zero_config
from _dist import spawn
from _tolerance import FLOOR, assert_no_worse_than_reference

pytest.importorskip("deepspeed", reason="pip install -e '.[deepspeed]' in a logitless checkout")
transformers = pytest.importorskip("transformers")

WORLD = 2
V = 96
KINDS = ("logprobs", "loss", "divergence")


def _model(tied: bool, width: int = 16, seed: int = 0):
    config = transformers.Qwen2Config(
        vocab_size=V, hidden_size=width, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(config)
    with torch.no_grad():  # logits of a few units: a peaked, non-uniform softmax
        model.lm_head.weight.normal_(0.0, 0.5)
    return model


def _batch(rank: int):
    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(3, V, (2, 9), generator=g)
    attention = torch.ones_like(ids)
    attention[1, 6:] = 0  # a padded row
    response = torch.zeros_like(ids, dtype=torch.bool)
    response[:, 3:] = True
    up = torch.randn(2, 9, generator=g)
    old = torch.randn(2, 9, generator=g) * 0.1 - 4.0
    adv = torch.randn(2, 9, generator=g)
    return ids, attention, response, up, old, adv


def _stock(kind, model, teacher, batch):
    """The quantity from the full logits (the engine's own forward when model is one)."""
    import logitless
    from logitless.integrations import hf

    ids, attention, response, up, old, adv = batch
    labels = hf.causal_lm_labels(ids, attention_mask=attention, response_mask=response)
    logits = model(ids, attention_mask=attention, use_cache=False).logits.float()
    flat = labels.clamp(min=0)
    logps = logits.log_softmax(-1).gather(-1, flat.unsqueeze(-1)).squeeze(-1)
    logps = torch.where(labels >= 0, logps, 0.0)
    if kind == "logprobs":
        return (logps * up.to(logps.dtype)).sum()
    if kind == "loss":
        config = logitless.PolicyLossConfig()
        return logitless.policy_loss(
            logps, old.to(logps.dtype), adv.to(logps.dtype), labels >= 0, config=config
        )[0]
    with torch.no_grad():
        t_logits = teacher(ids, attention_mask=attention, use_cache=False).logits.float()
    eye = torch.eye(V, dtype=logits.dtype)  # the logits as hidden states of an identity head
    out = logitless.reference.linear_divergence(
        logits, eye, labels, t_logits.to(logits.dtype), eye, beta=0.5
    )
    return (out.divergence * up.to(logits.dtype)).sum()


def _ours(kind, model, teacher, batch):
    import logitless
    from logitless.integrations import hf

    ids, attention, response, up, old, adv = batch
    common = dict(attention_mask=attention, response_mask=response)
    if kind == "logprobs":
        return (hf.causal_lm_logprobs(model, ids, **common).logprobs * up).sum()
    if kind == "loss":
        config = logitless.PolicyLossConfig()
        return hf.causal_lm_policy_loss(
            model, ids, old_logprobs=old, advantages=adv, config=config, **common
        )[0]
    out = hf.causal_lm_divergence(model, teacher, ids, beta=0.5, **common)
    return (out.divergence * up).sum()


def _engine(model, optimizer: bool = True, persistence: int | None = 0):
    import deepspeed

    opt = torch.optim.SGD(model.parameters(), lr=0.1) if optimizer else None
    config = zero_config(3, persistence)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    return engine


def _close_early(params, fn, *args):
    """The mutation: the head's weight gathered for its forward only."""
    import deepspeed

    from logitless.integrations import deepspeed as lds

    todo = [p for p in params if p is not None and lds.needs_gather(p)]
    with deepspeed.zero.GatheredParameters(todo, modifier_rank=None):
        return fn(*args)


def _bad_input(engine) -> str:
    """The error of the head op on a partitioned weight (not gathered by anything)."""
    import logitless

    weight = engine.module.lm_head.weight
    assert_partitioned(weight)
    hidden = torch.randn(3, 16)
    try:
        logitless.linear_logprobs(hidden, weight, torch.tensor([1, 2, 3]))
    except ValueError as e:
        return str(e)
    return "no error"


def _compare(kind, tied: bool, batch, world: int, mutate: bool = False, persistence=0):
    """One kind on fresh engines of one model: the float64 truth and stock's and logitless'
    loss and full gradients; with ``mutate``, the message logitless' backward fails with.
    ``persistence``: ``stage3_param_persistence_threshold`` (None: DeepSpeed's default)."""
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_grad

    from logitless.integrations import deepspeed as lds

    base, t_base = _model(tied), _model(False, width=24, seed=1)
    if not mutate:
        truth_model = copy.deepcopy(base).double()
        truth = _stock(kind, truth_model, copy.deepcopy(t_base).double(), batch)
        truth.backward()
        truth_grads = {}
        for n, p in truth_model.named_parameters():
            g = p.grad.clone()
            dist.all_reduce(g)
            truth_grads[n] = g / world
    teacher = _engine(copy.deepcopy(t_base), optimizer=False, persistence=persistence)
    runs = {}
    for name, fn in (("stock", _stock), ("ours", _ours))[int(mutate) :]:
        engine = _engine(copy.deepcopy(base), persistence=persistence)
        head = engine.module.lm_head.weight
        assert_partitioned(head)  # persistent or not, until its first gather
        assert head.ds_persist == (persistence is None)
        loss = fn(kind, engine, teacher, batch)
        if mutate:
            try:
                engine.backward(loss)
            except RuntimeError as e:
                return str(e)
            return "backward ran"
        engine.backward(loss)
        grads = {n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()}
        if persistence == 0:  # no full-size copy kept after the step
            assert_partitioned(head)
            assert_partitioned(teacher.module.lm_head.weight)
        assert not lds._Hold.open_holds
        if name == "ours":  # the head weight was never read through DeepSpeed's getter
            assert not list(engine.module.ds_external_parameters())
        runs[name] = (loss.detach(), grads)
    return truth.detach(), truth_grads, runs


def _worker(rank: int, world: int, kinds):
    """Every case in one process per rank (one DeepSpeed start): untied and tied heads, then
    the mutation (untied)."""
    ds_env(rank, world, 29531)
    import deepspeed

    from logitless.integrations import deepspeed as lds

    deepspeed.init_distributed(dist_backend="gloo")
    batch = _batch(rank)
    out = {"bad input": _bad_input(_engine(_model(False)))}
    for persistence in (0, None):
        for tied in (False, True):
            run = {k: _compare(k, tied, batch, world, persistence=persistence) for k in kinds}
            out[_case(tied, persistence)] = run
    real, lds.run_gathered = lds.run_gathered, _close_early
    try:
        out["mutated"] = {k: _compare(k, False, batch, world, mutate=True) for k in kinds}
    finally:
        lds.run_gathered = real
    return out


def _case(tied: bool, persistence: int | None) -> str:
    return ("tied" if tied else "untied") + ("" if persistence == 0 else "-persistent")


@pytest.fixture(scope="module")
def ranks():
    return spawn(_worker, WORLD, KINDS, threads=1, timeout_s=600.0)


@pytest.mark.parametrize("persistence", [0, None], ids=["partitioned", "persistent"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("kind", KINDS)
def test_hf_functions_on_zero3_match_stock_deepspeed(ranks, kind, tied, persistence):
    for r in ranks:
        truth, truth_grads, runs = r[_case(tied, persistence)][kind]
        (stock_loss, stock_grads), (loss, grads) = runs["stock"], runs["ours"]
        # a scalar sum: where stock happens to round exactly, a few ulps of the sum's scale
        assert_no_worse_than_reference(loss, stock_loss, truth, f"{kind} loss", floor=4 * FLOOR)
        assert set(grads) == set(truth_grads)
        for n, g in truth_grads.items():
            assert_no_worse_than_reference(grads[n], stock_grads[n], g, f"{kind} {n}.grad")


def test_a_partitioned_weight_is_refused_naming_the_fix(ranks):
    for r in ranks:
        message = r["bad input"]
        assert "weight is a DeepSpeed ZeRO-3 parameter that is not gathered" in message
        assert "[96, 16] whole" in message and "GatheredParameters" in message


def test_offload_and_zero_plus_plus_are_refused_by_name():
    from logitless.integrations.deepspeed import config_problem

    assert config_problem({"zero_optimization": {"stage": 3}}) is None
    assert config_problem({"zero_optimization": {"offload_optimizer": {"device": "none"}}}) is None
    for key in ("offload_param", "offload_optimizer"):
        problem = config_problem({"zero_optimization": {key: {"device": "cpu"}}})
        assert f"zero_optimization.{key}" in problem
    assert "quantized" in config_problem({"zero_optimization": {"zero_quantized_weights": True}})
    assert "hpz" in config_problem({"zero_optimization": {"zero_hpz_partition_size": 2}})


def test_closing_the_gather_before_the_backward_fails(ranks):
    for r in ranks:
        for kind in KINDS:  # the shape torch checks: [0, H] or ZeRO-3's empty [0]
            message = r["mutated"][kind]
            assert "invalid gradient" in message or "size of tensor a (0)" in message, message
