"""What a demo run is (:class:`DemoConfig`) and what it gives (:class:`StepMetrics` per step,
:class:`DemoResult` per run)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ...losses import PolicyLossConfig
from .task import DIGIT0

if TYPE_CHECKING:  # transformers is an optional dependency (extra "hf")
    from transformers import PreTrainedModel


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"DemoConfig.{name} must be an int >= {minimum}, got {value!r}")


def _check_float(name: str, value: object, *, positive: bool) -> None:
    ok = (
        not isinstance(value, bool)
        and isinstance(value, (int, float))
        and math.isfinite(value)
        and (value > 0 if positive else value >= 0)
    )
    if not ok:
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"DemoConfig.{name} must be a finite number {bound}, got {value!r}")


@dataclass(frozen=True)
class DemoConfig:
    """Everything :func:`run_demo` needs; the defaults are the ``logitless demo`` run.

    Model: ``vocab``, ``hidden``, ``layers``, ``heads`` of a Llama built from a config.
    Task: ``digits`` per prompt (= answer length).
    Batch: ``prompts`` per step x ``group`` completions per prompt (the GRPO group).
    Optimization: ``lr`` (AdamW), ``updates`` optimizer steps per rollout batch,
    ``clip_low`` / ``clip_high`` (PPO ε, DAPO clip-higher), ``kl_coef`` (k3 KL to the initial
    policy), ``max_grad_norm``; ``warmup`` supervised format steps at ``warmup_lr`` first.
    Run: ``steps`` RL steps, ``naive`` (full-logits head path), ``seed``, ``device``.
    """

    steps: int = 200
    naive: bool = False
    seed: int = 0
    device: str = "cpu"
    vocab: int = 16384
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    digits: int = 3
    prompts: int = 16
    group: int = 8
    lr: float = 1.5e-3
    updates: int = 2
    clip_low: float = 0.2
    clip_high: float = 0.28
    kl_coef: float = 0.01
    max_grad_norm: float = 1.0
    warmup: int = 60
    warmup_lr: float = 3e-3

    def __post_init__(self) -> None:
        for name in ("steps", "vocab", "hidden", "layers", "heads", "digits", "prompts"):
            _check_int(name, getattr(self, name), 1)
        _check_int("updates", self.updates, 1)
        _check_int("group", self.group, 2)  # group-relative advantages need two samples
        _check_int("warmup", self.warmup, 0)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"DemoConfig.seed must be an int, got {self.seed!r}")
        if not isinstance(self.naive, bool):
            raise ValueError(f"DemoConfig.naive must be a bool, got {self.naive!r}")
        if self.vocab < DIGIT0 + 10:
            raise ValueError(
                f"DemoConfig.vocab must be >= {DIGIT0 + 10} (the toy tokens), got {self.vocab}"
            )
        if self.hidden % self.heads:
            raise ValueError(
                f"DemoConfig.hidden ({self.hidden}) must be a multiple of heads ({self.heads})"
            )
        for name in ("lr", "max_grad_norm", "warmup_lr"):
            _check_float(name, getattr(self, name), positive=True)
        for name in ("clip_low", "clip_high", "kl_coef"):
            _check_float(name, getattr(self, name), positive=False)
        if not isinstance(self.device, str):
            raise ValueError(f"DemoConfig.device must be a string, got {self.device!r}")
        try:
            torch.device(self.device)
        except RuntimeError:
            raise ValueError(
                f"DemoConfig.device must be a torch device string such as 'cpu' or 'cuda', "
                f"got {self.device!r}"
            ) from None

    @property
    def mode(self) -> str:
        """``"naive"`` or ``"logitless"``."""
        return "naive" if self.naive else "logitless"

    def loss_config(self) -> PolicyLossConfig:
        """GRPO with DAPO's clip-higher: PPO clip, token mean, k3 KL to the reference policy."""
        return PolicyLossConfig(
            clip_low=self.clip_low,
            clip_high=self.clip_high,
            aggregation="token_mean",
            kl_coef=self.kl_coef,
            kl_estimator="k3",
        )


@dataclass(frozen=True)
class StepMetrics:
    """One RL step.

    reward: mean reward of the step's rollouts (sampled before its updates). loss, kl,
    clip_frac: means over the step's ``updates`` optimizer steps (``kl``: the k3 estimate of
    KL(π_θ ‖ π_ref) per response token; ``clip_frac``: the fraction of tokens whose ratio was
    clipped, low + high). entropy: mean entropy (nats) of the sampling policy
    over the response tokens. peak_mem_mb: peak extra memory of the whole step (sampling,
    no-grad log-probs, loss, backward, optimizer) above what was in use when it started, see
    :func:`memory_meaning`. seconds: wall time of the step.
    """

    step: int
    reward: float
    loss: float
    kl: float
    entropy: float
    clip_frac: float
    peak_mem_mb: float
    seconds: float


@dataclass(frozen=True)
class DemoResult:
    """What :func:`run_demo` returns.

    config; rows: one :class:`StepMetrics` per RL step; memory_note: what ``peak_mem_mb``
    means on this device; policy: the trained model (see :func:`show_samples`);
    warmup_seconds: wall time of the supervised warm-up; run_seconds: wall time of the whole
    :func:`run_demo` call (model build, warm-up and the RL steps).
    """

    config: DemoConfig
    rows: list[StepMetrics]
    memory_note: str
    policy: PreTrainedModel | None = field(default=None, repr=False, compare=False)
    warmup_seconds: float = 0.0
    run_seconds: float = 0.0

    def window(self, steps: int = 10) -> int:
        """``steps``, or half the run if it is shorter (at least 1)."""
        return max(1, min(steps, len(self.rows) // 2))

    def reward_window(self, first: bool, steps: int = 10) -> float:
        """Mean reward of the first (or last) :meth:`window` steps."""
        w = self.window(steps)
        rows = self.rows[:w] if first else self.rows[-w:]
        return sum(r.reward for r in rows) / len(rows) if rows else float("nan")

    def peak_mb(self, typical: bool = False) -> float:
        """Largest (or median) ``peak_mem_mb`` over the steps."""
        values = sorted(r.peak_mem_mb for r in self.rows)
        if not values:
            return float("nan")
        return values[len(values) // 2] if typical else values[-1]

    def reward_auc(self) -> float:
        """Area under the reward curve: the mean reward over all steps (how fast it learned,
        not only where it ended)."""
        return sum(r.reward for r in self.rows) / len(self.rows) if self.rows else float("nan")

    def steps_seconds(self) -> float:
        """Wall time of the RL steps alone."""
        return sum(r.seconds for r in self.rows)

    def summary(self) -> str:
        """One line: reward first -> last (means of :meth:`window` steps), peak step memory,
        times, e.g.
        ``logitless, seed 0: reward 0.096 -> 0.993 (first/last 10 steps), peak step memory
        66 MB median / 86 MB max, 200 steps in 46 s (run 52 s with build and warm-up)``."""
        head = f"{self.config.mode}, seed {self.config.seed}"
        if not self.rows:
            return f"{head}: no steps"
        return (
            f"{head}: reward {self.reward_window(True):.3f} -> "
            f"{self.reward_window(False):.3f} (first/last {self.window()} steps), peak step memory "
            f"{self.peak_mb(typical=True):.0f} MB median / {self.peak_mb():.0f} MB max, "
            f"{len(self.rows)} steps in {self.steps_seconds():.0f} s "
            f"(run {self.run_seconds:.0f} s with build and warm-up)"
        )
