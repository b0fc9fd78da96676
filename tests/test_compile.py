"""``torch.compile`` traces a training step through the op (no graph break) and gives eager's
numbers: outputs and gradients."""

from __future__ import annotations

import pytest
import torch

import logitless


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
