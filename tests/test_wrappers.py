"""integrations.wrappers.run_in_forward: a function run as a wrapper's forward, one process.

The instance's own ``forward`` (accelerate installs one for autocast) is restored after the
call, also when the function raises, and inside the function (so it may call the real
forward); the wrapper's forward hooks run around the function; arguments travel in a closure
(a wrapper's pre-hook that rewrites its inputs never sees them); a wrapper that does not call
the inner module's forward is an error, not a silent skip.
"""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from logitless.integrations import wrappers


class Wrapper(nn.Module):
    """A DDP-like wrapper: its forward calls the inner module's."""

    def __init__(self, module: nn.Module, call_inner: bool = True) -> None:
        super().__init__()
        self.module, self.call_inner, self.calls = module, call_inner, 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        return self.module(*args, **kwargs) if self.call_inner else None


def _wrapped(monkeypatch, inner, outer):
    """Make unwrap() treat ``outer`` as a DDP wrapper of ``inner``."""
    monkeypatch.setattr(wrappers, "DistributedDataParallel", Wrapper)
    return wrappers.unwrap(outer)


def test_plain_model_is_a_plain_call():
    net = nn.Linear(2, 3)
    assert wrappers.unwrap(net).borrowed is None
    assert wrappers.run_in_forward(net, lambda lm, k: (lm is net, k), k=5) == (True, 5)


def test_runs_inside_the_wrapper_and_restores_forward(monkeypatch):
    inner = nn.Linear(2, 2)
    own = lambda x: "instance forward"  # noqa: E731  (like accelerate's autocast wrapper)
    inner.forward = own
    outer = Wrapper(inner)
    _wrapped(monkeypatch, inner, outer)
    seen = []
    outer.register_forward_pre_hook(lambda m, a: seen.append(("pre", a)))

    def fn(lm, x):
        seen.append(("fn", lm.forward is own, lm.forward(x)))  # the real forward is back
        return x * 2

    out = wrappers.run_in_forward(outer, fn, torch.ones(1))
    assert torch.equal(out, torch.full((1,), 2.0))
    assert seen == [("pre", ()), ("fn", True, "instance forward")]  # hooks ran, no inputs
    assert outer.calls == 1 and vars(inner)["forward"] is own

    def boom(lm):
        raise ValueError("bad input")

    with pytest.raises(ValueError, match="bad input"):
        wrappers.run_in_forward(outer, boom)
    assert vars(inner)["forward"] is own
    plain = nn.Linear(2, 2)
    _wrapped(monkeypatch, plain, Wrapper(plain))
    wrappers.run_in_forward(Wrapper(plain), lambda lm: None)
    assert "forward" not in vars(plain)  # no instance attribute left behind


def test_a_wrapper_that_skips_the_inner_forward_is_an_error(monkeypatch):
    inner = nn.Linear(2, 2)
    outer = Wrapper(inner, call_inner=False)
    _wrapped(monkeypatch, inner, outer)
    with pytest.raises(RuntimeError, match="did not call Linear's forward"):
        wrappers.run_in_forward(outer, lambda lm: 1)
    assert "forward" not in vars(inner)


def test_refusals():
    class DeepSpeedEngine(nn.Module):  # found by its class name; ZeRO-Infinity's offload
        _config = types.SimpleNamespace(
            _param_dict={"zero_optimization": {"offload_optimizer": {"device": "nvme"}}}
        )

    class FullyShardedDataParallel(nn.Module):
        pass

    with pytest.raises(ValueError, match="offload_optimizer"):
        wrappers.unwrap(DeepSpeedEngine())
    with pytest.raises(ValueError, match="FSDP1"):
        wrappers.unwrap(FullyShardedDataParallel())
    with pytest.raises(ValueError, match="must be a transformers causal LM"):
        wrappers.unwrap("model")
