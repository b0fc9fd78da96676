"""The training loop of ``logitless demo``: the supervised format warm-up, then GRPO steps, each
with its peak memory measured and its metrics shown on a progress bar."""

from __future__ import annotations

import copy
import gc
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TextIO

import torch

from ...losses import PolicyLossConfig
from ..memory import peak_memory_meter
from ..output import StatusLine
from .config import DemoConfig, DemoResult, StepMetrics
from .policy import build_policy, sample, token_logprobs
from .step import rollout, step_loss
from .task import DIGIT0, IGNORE, ToyTask, response_labels

if TYPE_CHECKING:  # transformers is an optional dependency (extra "hf")
    from transformers import PreTrainedModel


def _warmup(
    model: PreTrainedModel,
    task: ToyTask,
    config: DemoConfig,
    generator: torch.Generator,
    on_step: Callable[[float], None] | None = None,
) -> None:
    """Supervised format warm-up: cross-entropy on answers of *random* digits.

    ``on_step`` is called with each step's loss (for the progress bar).
    """
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.warmup_lr, weight_decay=0.0)
    n = config.prompts * config.group
    for _ in range(config.warmup):
        values = task.prompts(n, generator)
        answers = torch.randint(0, 10, (n, task.digits), generator=generator) + DIGIT0
        ids = torch.cat([task.encode(values), answers], dim=1).to(config.device)
        labels = response_labels(ids, task.prompt_len)
        logp, _ = token_logprobs(model, ids, labels, naive=config.naive)
        loss = -logp.sum() / (labels != IGNORE).sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if on_step is not None:
            on_step(float(loss.detach()))


class _StepMemory:
    """Peak extra memory of a region, with the meters of :mod:`logitless.apps.memory`.

    CUDA: ``max_memory_allocated`` minus ``memory_allocated`` at start (peak stats reset). CPU
    (Linux): the RSS high-water mark (``VmHWM``), reset through ``/proc/self/clear_refs``,
    minus the RSS at start after returning freed heap pages to the OS. Without a resettable
    high-water mark (not Linux) it is the growth of the lifetime ``ru_maxrss``, which only
    moves when a step exceeds every earlier peak; ``note`` says so.
    """

    def __init__(self, device: torch.device) -> None:
        self._meter = peak_memory_meter(device)
        self.peak_bytes = 0

    @property
    def note(self) -> str:
        return self._meter.note

    def __enter__(self) -> _StepMemory:
        self._meter.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.peak_bytes = self._meter.peak_extra_bytes()


def memory_meaning(device: torch.device, note: str = "") -> str:
    """What ``peak_mem_mb`` means on this device (printed with the summary)."""
    if device.type == "cuda":
        return (
            "peak step memory = torch.cuda.max_memory_allocated during the step minus the "
            "memory allocated when it started"
        )
    if note:
        return f"peak step memory: {note}"
    return (
        "peak step memory = process RSS high-water mark during the step (reset each step "
        "through /proc/self/clear_refs) minus the RSS when it started; step 1 also allocates "
        "the AdamW state"
    )


class _Progress:
    """tqdm when installed, else a :class:`~logitless.apps.output.StatusLine` on ``stream``
    (``desc i/total text``); nothing if disabled."""

    def __init__(self, total: int, desc: str, stream: TextIO, enabled: bool) -> None:
        self.enabled, self.total, self.desc = enabled, total, desc
        self.n, self.bar, self.line = 0, None, StatusLine(stream)
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self.bar = tqdm(total=total, desc=desc, file=stream, dynamic_ncols=True)

    def update(self, text: str) -> None:
        self.n += 1
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(1)
        else:
            self.line.show(f"{self.desc} {self.n}/{self.total} {text}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        else:
            self.line.keep()


def run_demo(
    config: DemoConfig,
    *,
    progress: bool = True,
    stream: TextIO | None = None,
    on_step: Callable[[StepMetrics], None] | None = None,
) -> DemoResult:
    """Warm up, then train the toy policy with GRPO for ``config.steps`` steps.

    Deterministic for a given config on one machine (prompts and samples use their own
    generators). ``progress`` shows a bar (tqdm if installed) on ``stream`` (default
    stderr): the warm-up's cross-entropy, then each RL step's reward, loss, KL, entropy and
    memory; ``on_step`` is called with each step's metrics.

    ``peak_mem_mb`` of a step is its peak memory above what was in use when it started (see
    :func:`memory_meaning`): what the step itself allocates (sampling, logits or head chunks,
    activations, gradients), not the model, reference and optimizer state held across steps.

    Raises:
        ValueError: ``config`` is not a :class:`DemoConfig`, or its device is unavailable.
        ImportError: transformers is not installed.
    """
    if not isinstance(config, DemoConfig):
        raise ValueError(f"config must be a DemoConfig, got {type(config).__name__}")
    device = torch.device(config.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {config.device!r}: CUDA is not available in this torch build")
    stream = sys.stderr if stream is None else stream
    task = ToyTask(config.digits)
    loss_config = config.loss_config()
    prompt_generator = torch.Generator().manual_seed(config.seed)
    sample_generator = torch.Generator(device=device).manual_seed(config.seed + 1)
    generators = (prompt_generator, sample_generator)

    t_start = time.perf_counter()
    policy = build_policy(config)
    label = f"{config.mode} seed {config.seed}"
    warmup_seconds = _warm_up(policy, task, config, prompt_generator, label, stream, progress)
    reference = copy.deepcopy(policy).requires_grad_(False).eval()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=config.lr, weight_decay=0.0)

    rows: list[StepMetrics] = []
    note = ""
    bar = _Progress(config.steps, f"GRPO {label}", stream, progress)
    # The CPU memory meter collects garbage before each step; a full collection walks every
    # object of torch and transformers (~0.2 s, half a step). Frozen, they are skipped: the
    # collection still frees everything the steps create.
    gc.collect()
    gc.freeze()
    try:
        for step in range(1, config.steps + 1):
            row, note = _rl_step(
                step, policy, reference, optimizer, task, config, loss_config, generators
            )
            rows.append(row)
            if on_step is not None:
                on_step(row)
            bar.update(
                f"reward={row.reward:.3f} loss={row.loss:+.4f} kl={row.kl:.4f} "
                f"entropy={row.entropy:.3f} mem={row.peak_mem_mb:.0f}MB"
            )
    finally:
        gc.unfreeze()
        bar.close()
    return DemoResult(
        config,
        rows,
        memory_meaning(device, note),
        policy,
        warmup_seconds=warmup_seconds,
        run_seconds=time.perf_counter() - t_start,
    )


def _warm_up(policy, task, config: DemoConfig, generator, label: str, stream, progress: bool):
    """:func:`run_demo`'s supervised warm-up of ``policy`` (with its progress bar); its
    duration in seconds."""
    t_warmup = time.perf_counter()
    bar = _Progress(config.warmup, f"warm-up {label}", stream, progress and config.warmup > 0)
    try:
        _warmup(
            policy,
            task,
            config,
            generator,
            on_step=lambda loss: bar.update(f"cross-entropy={loss:.3f}"),
        )
    finally:
        bar.close()
    return time.perf_counter() - t_warmup


def _rl_step(
    step: int, policy, reference, optimizer, task: ToyTask, config: DemoConfig,
    loss_config: PolicyLossConfig, generators: tuple[torch.Generator, torch.Generator],
) -> tuple[StepMetrics, str]:  # fmt: skip
    """One GRPO step of :func:`run_demo`: a rollout, ``config.updates`` optimizer updates on
    it; its metrics and the memory meter's note."""
    t0 = time.perf_counter()
    with _StepMemory(torch.device(config.device)) as mem:
        batch = rollout(policy, reference, task, config, *generators)
        loss_sum = kl_sum = clip_sum = 0.0
        for _ in range(config.updates):
            loss, metrics = step_loss(policy, batch, loss_config, naive=config.naive)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(policy.parameters(), config.max_grad_norm)
            optimizer.step()
            loss_sum += float(loss.detach())
            kl_sum += float(metrics["kl_ref"]) if "kl_ref" in metrics else 0.0
            clip_sum += float(metrics["clip_frac_low"] + metrics["clip_frac_high"])
            del loss, metrics
        entropy = float(batch.entropy[batch.labels != IGNORE].mean())
        reward = float(batch.rewards.mean())
        del batch
    row = StepMetrics(
        step=step,
        reward=reward,
        loss=loss_sum / config.updates,
        kl=kl_sum / config.updates,
        entropy=entropy,
        clip_frac=clip_sum / config.updates,
        peak_mem_mb=mem.peak_bytes / 2**20,
        seconds=time.perf_counter() - t0,
    )
    return row, mem.note


def show_samples(result: DemoResult, n: int = 4, seed: int = 12345) -> list[str]:
    """``n`` lines ``"<bos> d1 … dL -> r1 … rL  (reward x)"`` sampled from the trained policy."""
    if result.policy is None:
        raise ValueError("result.policy is None: there is no policy to sample from")
    c = result.config
    task = ToyTask(c.digits)
    values = task.prompts(n, torch.Generator().manual_seed(seed))
    generator = torch.Generator(device=torch.device(c.device)).manual_seed(seed)
    responses = sample(result.policy, task.encode(values).to(c.device), c.digits, generator)
    rewards = task.reward(values, responses)
    lines = []
    for v, r, rew in zip(values.tolist(), responses.cpu().tolist(), rewards.tolist(), strict=True):
        answer = " ".join(str(t - DIGIT0) if 0 <= t - DIGIT0 <= 9 else f"<id {t}>" for t in r)
        lines.append(f"<bos> {' '.join(map(str, v))} -> {answer}  (reward {rew:.2f})")
    return lines
