"""What the torchtitan tests share: torchtitan's RL losses without vLLM, the data, the runs of
torchtitan's ``ChunkedLossWrapper`` and of ``LogitlessLoss`` on one ``lm_head``, and a float64
truth (plain torch, written here from torchtitan's docstrings and code: the sum of the negative
log-likelihood over ``global_valid_tokens``; DAPO's clipped surrogate with its token mask and its
log-ratio cap at 10)."""

from __future__ import annotations

import dataclasses
import sys
import types
from pathlib import Path

import torch
import torchtitan.experiments

_RL = "torchtitan.experiments.rl"
if _RL not in sys.modules:  # its __init__ imports vLLM: a module with its __path__ stands in
    _stand_in = types.ModuleType(_RL)
    _stand_in.__path__ = [str(Path(torchtitan.experiments.__path__[0]) / "rl")]
    sys.modules[_RL] = _stand_in

from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss  # noqa: E402
from torchtitan.experiments.rl.losses import DAPOLoss, GRPOLoss  # noqa: E402

from logitless.integrations.torchtitan import LogitlessLoss  # noqa: E402

B, L, H, V = 2, 12, 16, 97


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    inner: object  # the inner loss's Config
    dtype: torch.dtype = torch.float32
    ignored: float = 0.2
    far: bool = False  # some generator log-probs far from the policy's (|log-ratio| > 10)

    @property
    def rl(self) -> bool:
        return not isinstance(self.inner, CrossEntropyLoss.Config)


def data(case: Case, seed: int = 0) -> dict:
    """float64 tensors, the same on every rank unless a rank offsets ``seed``."""
    g = torch.Generator().manual_seed(seed)
    out = {
        "hidden": torch.randn(B, L, H, generator=g, dtype=torch.float64),
        "weight": torch.randn(V, H, generator=g, dtype=torch.float64) * 0.4,
        "labels": torch.randint(0, V, (B, L), generator=g),
        # a random upstream gradient for LogitlessLoss alone: ChunkedLossWrapper ignores the
        # one its loss gets (_DecoderOutputGradientBackProp returns the gradients its chunks
        # took with upstream 1), so the two are compared with upstream 1
        "upstream": torch.rand((), generator=g, dtype=torch.float64) + 0.5,
    }
    drop = torch.rand(B, L, generator=g) < case.ignored
    out["labels"][drop] = -100
    out["gvt"] = torch.tensor(float((out["labels"] != -100).sum()) + 3.0)
    if case.rl:
        gen = -4.0 + 0.4 * torch.randn(B, L, generator=g, dtype=torch.float64)
        if case.far:
            gen[0, :3] = torch.tensor([9.0, -16.0, 11.0])  # log-ratios far beyond ±10
            gen[1, 5] = float("nan")  # a non-finite generator log-prob: dropped
        out["inputs"] = {
            "generator_logprobs": gen.float(),
            "advantages": torch.randn(B, L, generator=g),
            "loss_mask": out["labels"] != -100,
        }
        if case.far:
            # A < 0 where r > e^10 (DAPO caps it: the dual clip), and where r < e^-10 (clipped)
            out["inputs"]["advantages"][0, :3] = torch.tensor([-1.0, -1.0, -2.0])
    return out


def truth(case: Case, d: dict, upstream: float | torch.Tensor = 1.0) -> dict:
    """Loss and float64 gradients (hidden, weight) of ``upstream`` times it."""
    h = d["hidden"].clone().requires_grad_()
    w = d["weight"].clone().requires_grad_()
    logp = torch.log_softmax(h @ w.T, dim=-1)
    labels = d["labels"]
    lp = logp.gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    if not case.rl:
        loss = -(lp * (labels != -100)).sum() / d["gvt"]
    else:
        x = d["inputs"]
        gen = x["generator_logprobs"].double()
        mask = x["loss_mask"] & torch.isfinite(gen)
        lr = torch.where(mask, lp - gen, torch.zeros_like(lp)).clamp(-10, 10)
        r = lr.exp()
        inner = case.inner
        lo = getattr(inner, "ratio_clip_low", getattr(inner, "clip_eps", None))
        hi = getattr(inner, "ratio_clip_high", getattr(inner, "clip_eps", None))
        adv = x["advantages"].double()
        per = -torch.minimum(r * adv, r.clamp(1 - lo, 1 + hi) * adv)
        loss = (per * mask).sum() / max(d["gvt"], 1)
    (loss * upstream).backward()
    return {"loss": loss.detach(), "hidden": h.grad, "weight": w.grad}


def run_loss(loss_fn, lm_head, hidden, labels, gvt, inputs, upstream) -> dict:
    """``loss_fn(hidden, labels, gvt, **inputs)`` as torchtitan's trainer calls it (after
    ``set_lm_head``), then ``backward`` with ``upstream``: the loss, metrics and the gradients
    that reached ``hidden`` and ``lm_head.weight``."""
    loss_fn.set_lm_head(lm_head)
    loss, metrics = loss_fn(hidden, labels, gvt, **inputs)
    loss.backward(torch.as_tensor(upstream, dtype=loss.dtype))
    return {"loss": loss.detach(), "metrics": metrics}


def losses(case: Case):
    """torchtitan's ChunkedLossWrapper (2 chunks) and LogitlessLoss, with the same inner loss."""
    return (
        ChunkedLossWrapper.Config(num_chunks=2, loss_fn=case.inner).build(),
        LogitlessLoss.Config(loss_fn=case.inner).build(),
    )


__all__ = [
    "B",
    "DAPOLoss",
    "GRPOLoss",
    "H",
    "L",
    "V",
    "Case",
    "ChunkedLossWrapper",
    "CrossEntropyLoss",
    "LogitlessLoss",
    "data",
    "losses",
    "run_loss",
    "truth",
]
