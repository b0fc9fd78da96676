"""``torch.compile`` traces a training step through the op (no graph break) and gives eager's
numbers: outputs and gradients. In the capturable mode every entry point compiles whole
(``fullgraph=True``): the head, the fused loss, the modules, the losses and the HF functions,
the recipe of docs/capturable.md with inductor (docs/capturable.md, "Under torch.compile")."""

from __future__ import annotations

import pytest
import torch
from _tolerance import FLOOR, assert_no_worse_than_reference

import logitless
from logitless.losses import document_stats


def _inputs(dtype=torch.float32, bias=True, temperature="tensor"):
    g = torch.Generator().manual_seed(0)
    n, h, v = 23, 16, 101
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) * 0.3).to(dtype)
    b = torch.randn(v, generator=g).to(dtype) if bias else None
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::4] = -100
    temp = torch.rand(n, generator=g) + 0.5 if temperature == "tensor" else 0.8
    up = torch.randn(2, n, generator=g)
    return hidden, weight, b, labels, temp, up


def _step(hidden, weight, bias, labels, temp, up):
    out = logitless.linear_logprobs(
        hidden, weight, labels, bias=bias, temperature=temp, softcap=5.0, with_entropy=True
    )
    return (out.logprobs * up[0]).sum() + (out.entropy * up[1]).sum()


def _run(fn, hidden, weight, bias, labels, temp, up):
    leaves = [t.clone().requires_grad_() if t is not None else None for t in (hidden, weight, bias)]
    loss = fn(leaves[0], leaves[1], leaves[2], labels, temp, up)
    loss.backward()
    return [loss.detach()] + [t.grad for t in leaves if t is not None]


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("temperature", ["tensor", "scalar"])
def test_compiled_step_matches_eager_without_graph_break(backend, temperature):
    torch._dynamo.reset()
    inputs = _inputs(temperature=temperature)
    compiled = torch.compile(_step, fullgraph=True, backend=backend)  # fullgraph: no break
    got = _run(compiled, *inputs)
    want = _run(_step, *inputs)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_compiled_bad_input_still_raises_value_error():
    torch._dynamo.reset()
    hidden, weight, bias, labels, temp, up = _inputs()
    labels = labels.clone()
    labels[1] = 10_000  # out of range
    compiled = torch.compile(_step, fullgraph=True, backend="aot_eager")
    with pytest.raises(ValueError, match=r"labels must be in \[0, 101\)"):
        compiled(hidden, weight, bias, labels, temp, up)


# --------------------------------------------------------------------------------------------
# The capturable mode compiled whole: every entry point under fullgraph=True
# --------------------------------------------------------------------------------------------
# Each case builds its step from a seed in a dtype: fp32 compiled and fp32 eager run the same
# build, and float64 eager is the truth; the compiled numbers must be no worse than eager's
# (tests/_tolerance.py). Inductor (the default backend, what users get) compiles the recipe of
# docs/capturable.md; the others use aot_eager (the same graph capture, a faster compiler on
# 2 cores).

B, T, H, V = 2, 12, 8, 40


def _no_recompile():
    """Dynamo raises on a recompile inside (its own patch: pytest 9.2's monkeypatch deletes
    the option on undo)."""
    return torch._dynamo.config.patch(error_on_recompile=True)


@pytest.fixture
def torch_empty(monkeypatch):
    """torch's own ``empty`` factories, not tests/conftest.py's NaN-filling wrappers, for steps
    that trace the torch tiles' ``torch.empty``. Dynamo lists the torch functions it can trace
    by looking them up once, at its first compile: in a process whose first compile ran under
    the wrappers, the list holds the wrappers, and the builtin (the wrapper's inner call, or
    itself restored) is refused as unknown. So: the builtins back, and the list rebuilt."""
    from torch._dynamo import trace_rules

    for owner, name in ((torch, "empty"), (torch, "empty_like"), (torch.Tensor, "new_empty")):
        factory = getattr(owner, name)
        monkeypatch.setattr(owner, name, getattr(factory, "__wrapped_empty__", factory))
    trace_rules.get_torch_obj_rule_map.cache_clear()
    trace_rules.get_tensor_method.cache_clear()


def _batch(seed: int, dtype):
    """Labels (a prompt of 5 + seed tokens, two padding tokens), old log-probs, advantages."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[:, : 5 + seed] = -100
    labels[1, -2:] = -100
    old = torch.where(labels != -100, -torch.rand(B, T, generator=g) * 3 - 0.5, 0.0)
    return {"labels": labels, "old": old.to(dtype), "adv": torch.tensor([1.0, -0.5], dtype=dtype)}


def _tensors(dtype, seed: int = 0):
    g = torch.Generator().manual_seed(100 + seed)
    hidden = torch.randn(B, T, H, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=g) * 0.5).to(dtype).requires_grad_()
    return hidden, weight


def _recipe(dtype, seed):
    """docs/capturable.md's recipe: the head with row_capacity, then policy_loss."""
    hidden, weight = _tensors(dtype, seed)
    d = _batch(seed, dtype)
    cfg = logitless.PolicyLossConfig()

    def step(hidden, weight, labels, old, adv):
        out = logitless.linear_logprobs(hidden, weight, labels, with_entropy=True,
                                        capturable=True, row_capacity=16)  # fmt: skip
        loss, _ = logitless.policy_loss(out.logprobs, old, adv,
                                        labels != -100, config=cfg, capturable=True)  # fmt: skip
        return loss + 0.01 * out.entropy.sum()

    return step, [hidden, weight], (hidden, weight, d["labels"], d["old"], d["adv"])


def _fused(dtype, seed):
    hidden, weight = _tensors(dtype, seed)
    d = _batch(seed, dtype)
    cfg = logitless.PolicyLossConfig(clip_high=0.28, aggregation="token_mean", entropy_coef=0.01)

    def step(hidden, weight, labels, old, adv):
        loss, metrics = logitless.fused_policy_loss(
            hidden, weight, labels, old, adv, config=cfg, capturable=True,
            row_capacity=16,
        )  # fmt: skip
        return loss + 0.0 * metrics["clip_frac_high"]

    return step, [hidden, weight], (hidden, weight, d["labels"], d["old"], d["adv"])


def _modules(dtype, seed):
    """LinearLogprobs, LogprobHead and PolicyLossHead (sequence-level ratio) in one step."""
    hidden, weight = _tensors(dtype, seed)
    d = _batch(seed, dtype)
    lm_head = torch.nn.Linear(H, V, bias=True).to(dtype)
    with torch.no_grad():
        lm_head.weight.copy_(weight)
        lm_head.bias.copy_(torch.linspace(-0.2, 0.2, V, dtype=dtype))
    plain = logitless.LinearLogprobs(with_entropy=True, capturable=True)
    head = logitless.LogprobHead(lm_head, capturable=True, row_capacity=16)
    cfg = logitless.PolicyLossConfig(ratio_level="sequence", aggregation="seq_mean_token_mean")
    loss_head = logitless.PolicyLossHead(lm_head, config=cfg, capturable=True, row_capacity=16)

    def step(hidden, labels, old, adv):
        a = plain(hidden, lm_head.weight, labels)
        b = head(hidden, labels)
        loss, _ = loss_head(hidden, labels, old, adv)
        return a.logprobs.sum() + 0.1 * a.entropy.sum() + b.logprobs.sum() + loss

    return step, [hidden, lm_head.weight, lm_head.bias], (hidden, d["labels"], d["old"], d["adv"])


def _losses(dtype, seed):
    """document_stats, then policy_loss with a loss_normalizer over two micro-batches."""
    hidden, weight = _tensors(dtype, seed)
    d = _batch(seed, dtype)
    cfg = logitless.PolicyLossConfig(ratio_level="sequence", mismatch_is="sequence")

    def step(hidden, weight, labels, old, adv):
        lp = logitless.linear_logprobs(hidden, weight, labels, capturable=True).logprobs
        mask = labels != -100
        rollout = old - 0.05
        norm = logitless.loss_normalizer([mask, mask[:, 2:]], capturable=True)
        kw = dict(config=cfg, rollout_logprobs=rollout, capturable=True)
        stats = document_stats(lp.detach(), old, adv, mask, **kw)
        loss, _ = logitless.policy_loss(lp, old, adv, mask, document_stats=stats,
                                        normalizer=norm, **kw)  # fmt: skip
        return loss

    return step, [hidden, weight], (hidden, weight, d["labels"], d["old"], d["adv"])


def _hf(dtype, seed):
    """hf.causal_lm_logprobs and hf.causal_lm_policy_loss of a tiny Llama in one step."""
    transformers = pytest.importorskip("transformers")
    from logitless.integrations import hf

    torch.manual_seed(7)
    cfg = transformers.LlamaConfig(
        vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg).to(dtype)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    response = torch.zeros(B, T, dtype=torch.bool)
    response[:, 5:] = True
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, -2:] = 0
    old = (-torch.rand(B, T, generator=g) * 3 - 0.5).to(dtype)
    loss_cfg = logitless.PolicyLossConfig(ratio_level="sequence")

    def step(ids, response, mask, old, adv):
        kw = dict(response_mask=response, attention_mask=mask, capturable=True)
        out = hf.causal_lm_logprobs(model, ids, with_entropy=True, **kw)
        loss, _ = hf.causal_lm_policy_loss(model, ids, old, adv, config=loss_cfg, **kw)
        return out.logprobs.sum() + 0.1 * out.entropy.sum() + loss

    params = [p for p in model.parameters() if p.requires_grad]
    return step, params, (ids, response, mask, old, torch.tensor([1.0, -0.5], dtype=dtype))


def _results(step, leaves, inputs):
    """The step's loss and its leaves' gradients."""
    loss = step(*inputs)
    loss.backward()
    return [loss.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize(
    "build,backend,seeds",
    [
        (_recipe, "inductor", (0, 1)),  # two batches, other masks: no recompile
        (_fused, "aot_eager", (0,)),
        (_modules, "aot_eager", (0,)),
        (_losses, "aot_eager", (0,)),
        (_hf, "aot_eager", (0,)),
    ],
    ids=["recipe-inductor", "fused_policy_loss", "modules", "losses", "hf"],
)
def test_capturable_entry_point_compiles_whole(build, backend, seeds, torch_empty):
    torch._dynamo.reset()
    compiled = None
    for seed in seeds:
        step, leaves, inputs = build(torch.float32, seed)
        if compiled is None:
            compiled = torch.compile(step, fullgraph=True, dynamic=False, backend=backend)
        with _no_recompile():
            got = _results(compiled, leaves, inputs)
        ref = _results(*build(torch.float32, seed))
        truth = _results(*build(torch.float64, seed))
        floor = B * T * torch.finfo(torch.float32).eps  # the loss: a sum over tokens
        for i, (a, r, t) in enumerate(zip(got, ref, truth, strict=True)):
            name = "loss" if i == 0 else f"grad {i - 1}"
            assert a is not None and a.dtype == r.dtype, name
            assert_no_worse_than_reference(
                a.reshape(-1), r.reshape(-1), t.reshape(-1), name, floor=floor if i == 0 else FLOOR
            )


def test_no_frame_introspection_dynamo_cannot_trace_on_older_torch():
    """torch 2.11 and 2.12 (the package accepts torch >= 2.11; the lent GPU machine runs
    2.11) cannot trace ``locals()`` or an argument-less ``vars()``: an entry point that reads
    its options that way fails to compile there, though it compiles on the torch of CI. The
    entry points bind their arguments with ``contract.options.given_arguments`` instead."""
    import ast
    from pathlib import Path

    src = Path(logitless.__file__).parent
    found = []
    for path in sorted(src.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("locals", "vars")
                and not node.args
            ):
                found.append(f"{path.relative_to(src)}:{node.lineno}")
    assert found == []


def test_given_arguments_binds_what_locals_gave():
    """The decorator hands the function every argument by name, defaults filled, and shows
    the function's own signature (no ``given``)."""
    import inspect

    from logitless.contract.options import given_arguments

    @given_arguments
    def f(given, /, a, b=2, *, c=3, **rest):
        return dict(given)

    assert f(1, c=5, d=6) == {"a": 1, "b": 2, "c": 5, "rest": {"d": 6}}
    assert "given" not in inspect.signature(f).parameters
    assert "given" not in inspect.signature(logitless.linear_logprobs).parameters
    with pytest.raises(TypeError):
        f()


@pytest.mark.parametrize("name", ["linear_logprobs", "linear_divergence"])
def test_reference_takes_the_ops_arguments_less_how_it_runs(name):
    """The reference's signature is derived from the op's (``arguments_like``): the same
    parameters, defaults and order, less the options that say how and where the op runs,
    which it refuses as unknown keywords."""
    import inspect

    from logitless import reference

    op, ref = (
        inspect.signature(getattr(logitless, name)),
        inspect.signature(getattr(reference, name)),
    )
    dropped = [p for p in op.parameters if p not in ref.parameters]
    assert {"backend", "vocab_parallel", "batch_invariant"} <= set(dropped)
    assert list(ref.parameters.values()) == [
        p for p in op.parameters.values() if p.name not in dropped
    ]
    h, w, y = torch.randn(3, 4), torch.randn(7, 4), torch.tensor([1, 2, -100])
    with pytest.raises(TypeError, match="backend"):
        getattr(reference, name)(h, w, y, backend="torch")
