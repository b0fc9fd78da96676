"""One update of both head paths on the same policy and batch, in float64 and fp32: the demo's
check that logitless and the naive full-logits path compute the same step."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, replace

import torch

from .config import DemoConfig
from .loop import _warmup
from .policy import build_policy
from .step import Batch, rollout, step_loss
from .task import ToyTask


def _as_double(batch: Batch) -> Batch:
    """``batch`` with its float tensors in float64."""
    return Batch(
        batch.ids,
        batch.labels,
        batch.rewards.double(),
        batch.advantages.double(),
        batch.old_logprobs.double(),
        batch.ref_logprobs.double(),
        batch.entropy.double(),
    )


@dataclass(frozen=True)
class StepCheck:
    """One GRPO update computed by both head paths on the same policy and batch.

    float64: the logitless and the naive path on a float64 copy of the policy;
    ``loss64_diff`` / ``grad64_diff`` are the absolute differences of their losses and the
    largest over every gradient entry of every parameter; ``grad_scale`` is the largest
    gradient entry, to read them against. fp32: ``loss32_err`` / ``grad32_err`` are each fp32
    path's error against the float64 naive result (``{"logitless": ..., "naive": ...}``).
    ``clip_frac``: tokens whose ratio was clipped (the update is not a trivial one).
    """

    seed: int
    loss64_diff: float
    grad64_diff: float
    grad_scale: float
    loss32_err: dict[str, float]
    grad32_err: dict[str, float]
    clip_frac: float
    seconds: float

    def summary(self) -> str:
        """Two lines: the float64 agreement, then the fp32 errors of both paths."""
        return (
            f"one GRPO update, same policy and batch (seed {self.seed}, "
            f"{self.clip_frac:.0%} of tokens clipped): in float64, logitless and naive differ "
            f"by {self.loss64_diff:.1e} in the loss and at most {self.grad64_diff:.1e} in any "
            f"gradient entry (largest entry {self.grad_scale:.1e})\n"
            f"in fp32, against float64: logitless loss error {self.loss32_err['logitless']:.1e}, "
            f"gradient {self.grad32_err['logitless']:.1e}; naive loss error "
            f"{self.loss32_err['naive']:.1e}, gradient {self.grad32_err['naive']:.1e}"
        )


def check_step(config: DemoConfig) -> StepCheck:
    """Compute one GRPO update by both head paths, in float64 and fp32, on the same batch.

    The policy is the run's own at its first RL step: built and warmed up as
    :func:`run_demo` does for ``config.seed``, then one update on the first rollout batch so
    that the checked (second) update sees ratios != 1, clipping and a KL term, as in the loop.
    The two paths must agree to float64 rounding; in fp32 both carry rounding errors of the
    same size. Training runs of the two modes drift apart from such rounding alone (a
    different sample, then a different trajectory), which is why the demo compares them over
    several seeds.
    """
    t0 = time.perf_counter()
    config = replace(config, naive=False)
    task = ToyTask(config.digits)
    device = torch.device(config.device)
    prompt_generator = torch.Generator().manual_seed(config.seed)
    sample_generator = torch.Generator(device=device).manual_seed(config.seed + 1)
    policy = build_policy(config)
    _warmup(policy, task, config, prompt_generator)
    reference = copy.deepcopy(policy).requires_grad_(False).eval()
    batch = rollout(policy, reference, task, config, prompt_generator, sample_generator)
    loss_config = config.loss_config()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=config.lr, weight_decay=0.0)
    loss, _ = step_loss(policy, batch, loss_config, naive=False)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(policy.parameters(), config.max_grad_norm)
    optimizer.step()

    double = copy.deepcopy(policy).double()
    results: dict[tuple[str, bool], tuple[torch.Tensor, dict[str, torch.Tensor]]] = {}
    clip_frac = 0.0
    for precision, model, b in (("fp32", policy, batch), ("fp64", double, _as_double(batch))):
        for naive in (False, True):
            model.zero_grad(set_to_none=True)
            loss, metrics = step_loss(model, b, loss_config, naive=naive)
            loss.backward()
            grads = {n: p.grad.detach().double() for n, p in model.named_parameters()}
            results[(precision, naive)] = (loss.detach().double(), grads)
            if precision == "fp32" and not naive:
                clip_frac = float(metrics["clip_frac_low"] + metrics["clip_frac_high"])

    def loss_diff(a: tuple[str, bool], b: tuple[str, bool]) -> float:
        return float((results[a][0] - results[b][0]).abs())

    def grad_diff(a: tuple[str, bool], b: tuple[str, bool]) -> float:
        ga, gb = results[a][1], results[b][1]
        return max(float((ga[n] - gb[n]).abs().max()) for n in gb)

    truth = ("fp64", True)
    return StepCheck(
        seed=config.seed,
        loss64_diff=loss_diff(("fp64", False), truth),
        grad64_diff=grad_diff(("fp64", False), truth),
        grad_scale=max(float(g.abs().max()) for g in results[truth][1].values()),
        loss32_err={m: loss_diff(("fp32", m == "naive"), truth) for m in ("logitless", "naive")},
        grad32_err={m: grad_diff(("fp32", m == "naive"), truth) for m in ("logitless", "naive")},
        clip_frac=clip_frac,
        seconds=time.perf_counter() - t0,
    )
