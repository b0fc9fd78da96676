"""A small but real GRPO loop on a tiny random-init transformers policy: ``logitless demo``.

The policy is a 2-layer Llama built from a config (nothing is downloaded) with a 16k
vocabulary, so the LM head holds most of the parameters and the ``[tokens, vocab]`` logits
dominate the memory of a training step. It learns a verifiable toy task: given
``<bos> d1 d2 d3``, answer ``d3 d3 d3`` (echo the last digit); the reward is the fraction of
answer tokens that are right. The toy tokenizer maps ``<pad> <bos>`` and the ten digits to
ids 0-11; the other ids never occur in the data, but the policy spreads probability over them
and every log-prob is normalized over the whole vocabulary.

One step is what an RL trainer does:

1. sample ``group`` completions per prompt from the policy itself (temperature 1, KV cache);
2. score them; group-relative (GRPO) advantages;
3. under ``torch.no_grad()``: the log-probs of the response tokens under the sampling policy
   (``old``) and under the frozen initial policy (``ref``, for the KL term);
4. ``updates`` AdamW steps on the clipped policy loss (DAPO clip-higher, token mean) with a k3
   KL to the reference; the second update sees ratios != 1, so the clip matters.

The head path is the only difference between the two modes. ``logitless`` runs the backbone
and calls :func:`logitless.integrations.hf.causal_lm_logprobs` /
:func:`~logitless.integrations.hf.causal_lm_policy_loss` (prompt rows are never projected,
the loss's head gradients are taken in forward). ``naive`` takes ``model(...).logits`` ->
``log_softmax`` -> :func:`logitless.policy_loss`, the code people write by hand. Both give
the same numbers (tests/test_demo.py, and :func:`check_step` on the demo's own policy, in
float64); the naive one holds several ``[tokens, vocab]`` fp32 tensors. Same numbers is not the
same run: from the first sampled token that float rounding turns another way, two runs part,
and each lands anywhere in the spread of its seeds; :func:`seeds_summary` compares the modes
over seeds.

A random-init policy spreads its mass over the 16k ids, so a reward on digits would start at
~0 and GRPO would see no signal. A short supervised warm-up (``warmup`` steps of
cross-entropy on *random* digit answers) first teaches the format; the answers are random, so
the RL reward starts at chance (0.1) and what it gains above that is RL's work. The warm-up
policy is the KL reference.

>>> from logitless.apps.demo import DemoConfig, run_demo
>>> result = run_demo(DemoConfig(steps=2, vocab=256, warmup=2), progress=False)
>>> [row.step for row in result.rows]
[1, 2]
"""

from __future__ import annotations

import copy
import csv
import gc
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import torch

from ..advantages import grpo_advantages
from ..losses import PolicyLossConfig, policy_loss
from .memory import peak_memory_meter

if TYPE_CHECKING:  # transformers is an optional dependency (extra "hf")
    from transformers import PreTrainedModel

__all__ = [
    "Batch",
    "DemoConfig",
    "DemoResult",
    "StepCheck",
    "StepMetrics",
    "ToyTask",
    "build_policy",
    "check_step",
    "final_rewards",
    "paired_difference",
    "plot_demo",
    "read_csv",
    "rollout",
    "run_demo",
    "sample",
    "seeds_summary",
    "show_samples",
    "step_loss",
    "token_logprobs",
    "write_csv",
]

IGNORE = -100
PAD, BOS, DIGIT0 = 0, 1, 2  # toy tokenizer: <pad> <bos> 0 1 … 9  ->  ids 0 1 2 3 … 11


# ---------------------------------------------------------------------------------------------
# configuration and results


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


# ---------------------------------------------------------------------------------------------
# the toy task


@dataclass(frozen=True)
class ToyTask:
    """Prompts ``<bos> d1 … dL`` (random digits) and the reward of an ``L``-token answer.

    The right answer repeats the last prompt digit ``L`` times (``<bos> 3 1 4`` ->
    ``4 4 4``). The reward is the fraction of answer tokens equal to ``dL``; a policy guessing
    digits at random scores 0.1. It cannot be gamed by a fixed answer (that also scores 0.1 on
    average): the policy has to read the prompt.
    """

    digits: int = 3

    def __post_init__(self) -> None:
        if isinstance(self.digits, bool) or not isinstance(self.digits, int) or self.digits < 1:
            raise ValueError(f"ToyTask.digits must be an int >= 1, got {self.digits!r}")

    @property
    def prompt_len(self) -> int:
        """Tokens per prompt: ``<bos>`` and the digits."""
        return self.digits + 1

    def prompts(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """``[n, L]`` random digit values 0-9 (int64, CPU)."""
        return torch.randint(0, 10, (n, self.digits), generator=generator)

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        """Digit values ``[n, L]`` -> prompt ids ``[n, L + 1]``."""
        bos = torch.full((values.shape[0], 1), BOS, dtype=torch.long)
        return torch.cat([bos, values + DIGIT0], dim=1)

    def correct(self, values: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """``[n, L]`` bool: which answer tokens are right."""
        if responses.shape != values.shape:
            raise ValueError(
                f"responses must have the prompts' shape {list(values.shape)}, "
                f"got {list(responses.shape)}"
            )
        return responses.cpu() == values[:, -1:] + DIGIT0

    def reward(self, values: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """``[n]`` fraction of answer tokens that are right (fp32)."""
        return self.correct(values, responses).float().mean(dim=1)


# ---------------------------------------------------------------------------------------------
# the policy


def build_policy(config: DemoConfig) -> PreTrainedModel:
    """A random-init ``LlamaForCausalLM`` from a config, seeded by ``config.seed``.

    Raises:
        ImportError: transformers is not installed (``pip install -e '.[hf]'`` in a logitless
            checkout).
    """
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as exc:
        raise ImportError(
            "logitless demo needs transformers: pip install -e '.[hf]' in a logitless checkout"
        ) from exc
    model_config = LlamaConfig(
        vocab_size=config.vocab,
        hidden_size=config.hidden,
        intermediate_size=4 * config.hidden,
        num_hidden_layers=config.layers,
        num_attention_heads=config.heads,
        num_key_value_heads=config.heads,
        max_position_embeddings=2 * config.digits + 1,
        tie_word_embeddings=False,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = LlamaForCausalLM(model_config)
    return model.to(config.device)


def _sample_rows(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One index per row of ``probs`` ``[B, V]`` by inverse CDF: ``[B, 1]`` int64.

    The distribution of ``torch.multinomial(probs, 1)``, which is ~10x slower on CPU.
    """
    cdf = probs.cumsum(dim=-1)  # [B, V]
    u = torch.rand(probs.shape[0], 1, generator=generator, device=probs.device, dtype=cdf.dtype)
    idx = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)  # first j with cdf_j > u·total
    return idx.clamp_(max=probs.shape[-1] - 1)


@torch.no_grad()
def sample(
    model: PreTrainedModel,
    prompt_ids: torch.Tensor,
    new_tokens: int,
    generator: torch.Generator,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Sample ``new_tokens`` per row from the policy, with its KV cache.

    ``prompt_ids`` ``[B, P]`` (no padding) -> response ids ``[B, new_tokens]``. Only the last
    position's logits are computed, ``[B, V]`` per new token (inference needs them).
    """
    out = model(input_ids=prompt_ids, use_cache=True, logits_to_keep=1)
    tokens = []
    for i in range(new_tokens):
        probs = torch.softmax(out.logits[:, -1].float() / temperature, dim=-1)  # [B, V]
        nxt = _sample_rows(probs, generator)  # [B, 1]
        tokens.append(nxt)
        if i + 1 < new_tokens:
            out = model(input_ids=nxt, past_key_values=out.past_key_values, use_cache=True)
    return torch.cat(tokens, dim=1)


def response_labels(ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Next-token labels of the response tokens only: ``[B, S]``, ``IGNORE`` elsewhere.

    Aligned like HF logits: position ``t`` predicts token ``t + 1``; positions
    ``prompt_len - 1 … S - 2`` predict the response, the prompt and the last position get
    ``IGNORE``.
    """
    labels = torch.full_like(ids, IGNORE)
    labels[:, prompt_len - 1 : -1] = ids[:, prompt_len:]
    return labels


def _naive_logprobs(
    model: PreTrainedModel, ids: torch.Tensor, labels: torch.Tensor, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``model(ids).logits`` -> ``log_softmax``: the full-logits code people write by hand."""
    logits = model(input_ids=ids, use_cache=False).logits  # [B, S, V]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32 (or fp64)
    logp_all = torch.log_softmax(logits, dim=-1)  # [B, S, V]
    valid = labels != IGNORE
    logp = logp_all.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # [B, S]
    logp = torch.where(valid, logp, 0.0)
    entropy = None
    if with_entropy:
        entropy = torch.where(valid, -(logp_all.exp() * logp_all).sum(-1), 0.0)  # [B, S]
    return logp, entropy


def token_logprobs(
    model: PreTrainedModel,
    ids: torch.Tensor,
    labels: torch.Tensor,
    *,
    naive: bool,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each label (and the entropy), ``[B, S]``, 0 where the label is ``IGNORE``.

    ``naive=False``: :func:`logitless.integrations.hf.causal_lm_logprobs` (backbone + head op,
    ignored rows never projected); ``naive=True``: full logits. Differentiable: wrap in
    ``torch.no_grad()`` for old / reference log-probs.
    """
    if naive:
        return _naive_logprobs(model, ids, labels, with_entropy)
    from ..integrations.hf import causal_lm_logprobs

    out = causal_lm_logprobs(model, ids, target_ids=labels, with_entropy=with_entropy)
    return out.logprobs, out.entropy


# ---------------------------------------------------------------------------------------------
# one GRPO step


@dataclass
class Batch:
    """One rollout batch: ``B = prompts x group`` rows of ``S = 2·digits + 1`` tokens.

    ids ``[B, S]``; labels ``[B, S]`` (response tokens, ``IGNORE`` elsewhere); rewards and
    advantages ``[B]``; old_logprobs, ref_logprobs, entropy ``[B, S]`` (0 where ignored).
    """

    ids: torch.Tensor
    labels: torch.Tensor
    rewards: torch.Tensor
    advantages: torch.Tensor
    old_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor
    entropy: torch.Tensor


def rollout(
    policy: PreTrainedModel,
    reference: PreTrainedModel,
    task: ToyTask,
    config: DemoConfig,
    prompt_generator: torch.Generator,
    sample_generator: torch.Generator,
) -> Batch:
    """Sample and score a batch; advantages and no-grad old / reference log-probs.

    Prompts are drawn with ``prompt_generator`` (CPU), completions with ``sample_generator``
    (on ``config.device``).
    """
    device = torch.device(config.device)
    values = task.prompts(config.prompts, prompt_generator)  # [P, L]
    values = values.repeat_interleave(config.group, dim=0)  # [B, L], each group contiguous
    prompt_ids = task.encode(values).to(device)  # [B, L + 1]
    with torch.no_grad():
        responses = sample(policy, prompt_ids, task.digits, sample_generator)  # [B, L]
        rewards = task.reward(values, responses).to(device)  # [B]
        advantages = grpo_advantages(rewards, group_size=config.group)  # [B]
        ids = torch.cat([prompt_ids, responses], dim=1)  # [B, S]
        labels = response_labels(ids, task.prompt_len)  # [B, S]
        old, entropy = token_logprobs(policy, ids, labels, naive=config.naive, with_entropy=True)
        ref, _ = token_logprobs(reference, ids, labels, naive=config.naive)
    return Batch(ids, labels, rewards, advantages, old, ref, entropy)


def step_loss(
    model: PreTrainedModel, batch: Batch, loss_config: PolicyLossConfig, *, naive: bool
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy loss of ``batch`` under ``model``: ``(loss, metrics)``, ready for backward.

    ``naive=False``: :func:`logitless.integrations.hf.causal_lm_policy_loss` (backbone +
    :func:`logitless.fused_policy_loss`: the head's gradients are taken in forward, one
    ``[chunk, V]`` buffer); ``naive=True``: ``model(...).logits`` -> ``log_softmax`` ->
    :func:`logitless.policy_loss`. Same loss, metrics and gradients up to float rounding.
    """
    with_entropy = loss_config.entropy_coef != 0
    if naive:
        logp, entropy = _naive_logprobs(model, batch.ids, batch.labels, with_entropy)
        return policy_loss(
            logp,
            batch.old_logprobs,
            batch.advantages,
            batch.labels != IGNORE,
            config=loss_config,
            ref_logprobs=batch.ref_logprobs,
            entropy=entropy,
        )
    from ..integrations.hf import causal_lm_policy_loss

    return causal_lm_policy_loss(
        model,
        batch.ids,
        batch.old_logprobs,
        batch.advantages,
        config=loss_config,
        target_ids=batch.labels,
        ref_logprobs=batch.ref_logprobs,
    )


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


# ---------------------------------------------------------------------------------------------
# peak memory of a step


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


# ---------------------------------------------------------------------------------------------
# the loop


class _Progress:
    """tqdm when installed, else a ``\\r`` status line on ``stream``; nothing if disabled."""

    def __init__(self, total: int, desc: str, stream: TextIO, enabled: bool) -> None:
        self.enabled, self.stream, self.total, self.desc = enabled, stream, total, desc
        self.n, self.bar = 0, None
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
            self.stream.write(f"\r{self.desc} {self.n}/{self.total} {text}")
            self.stream.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            self.stream.write("\n")
            self.stream.flush()


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


# ---------------------------------------------------------------------------------------------
# one update of both modes on the same batch, in float64 and fp32


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


# ---------------------------------------------------------------------------------------------
# several seeds


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, 0.0
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def final_rewards(results: Sequence[DemoResult]) -> dict[str, list[float]]:
    """Per mode (in run order), the final reward of each run: the mean of its last
    :meth:`DemoResult.window` steps."""
    out: dict[str, list[float]] = {}
    for r in results:
        out.setdefault(r.config.mode, []).append(r.reward_window(False))
    return out


def seeds_summary(results: Sequence[DemoResult]) -> list[str]:
    """Lines comparing the modes over seeds: final reward mean ± standard deviation (and each
    seed's), run time per seed; with two modes, their difference seed by seed (mean ±
    standard deviation, and each)."""
    if not results:
        return []
    seeds = list(dict.fromkeys(r.config.seed for r in results))
    window = results[0].window()
    lines = [
        f"final reward (mean of the last {window} steps) over {len(seeds)} seed"
        f"{'s' if len(seeds) > 1 else ''} ({', '.join(map(str, seeds))}): mean ± standard "
        "deviation across seeds [each seed]"
    ]
    finals = final_rewards(results)
    width = max(len(m) for m in finals)
    for mode, values in finals.items():
        mean, std = _mean_std(values)
        runs = [r for r in results if r.config.mode == mode]
        run_s = sum(r.run_seconds for r in runs) / len(runs)
        timed = f"  run time {run_s:.0f} s per seed" if run_s > 0 else ""  # 0: read from a CSV
        lines.append(
            f"  {mode:<{width}}  {mean:.3f} ± {std:.3f}  [{', '.join(f'{v:.2f}' for v in values)}]"
            f"{timed}"
        )
    modes = list(finals)
    if len(modes) == 2 and len(seeds) > 1:  # paired by seed: same init, warm-up data, prompts
        by_run = {(r.config.mode, r.config.seed): r for r in results}
        pairs = [(by_run[(modes[0], s)], by_run[(modes[1], s)]) for s in seeds]
        diffs = [a.reward_window(False) - b.reward_window(False) for a, b in pairs]
        mean, std = _mean_std(diffs)
        lines.append(
            f"  {modes[0]} - {modes[1]}, paired by seed: {mean:+.3f} ± {std:.3f} "
            f"[{', '.join(f'{d:+.2f}' for d in diffs)}]"
        )
        auc = paired_difference([a.reward_auc() - b.reward_auc() for a, b in pairs])
        lines.append(
            f"  area under the reward curve (mean reward over all steps), {modes[0]} - "
            f"{modes[1]} paired by seed: {auc.describe()}"
        )
    return lines


# Two-sided 95% quantiles of Student's t for 1..30 degrees of freedom.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)  # fmt: skip


def _t975(df: int) -> float:
    """The 97.5% quantile of Student's t with ``df`` degrees of freedom (table up to 30, then
    the first-order Cornish-Fisher expansion around the normal's 1.96)."""
    return _T975[df - 1] if df <= len(_T975) else 1.96 + 2.37 / df


@dataclass(frozen=True)
class PairedDifference:
    """Mean of ``n`` paired differences with its 95% confidence interval (Student's t):
    ``mean ± t·std/√n``. ``significant``: the interval excludes 0."""

    n: int
    mean: float
    std: float
    low: float
    high: float

    @property
    def significant(self) -> bool:
        return self.n > 1 and (self.low > 0 or self.high < 0)

    def describe(self) -> str:
        if self.n < 2:
            return f"{self.mean:+.4f} (one seed: no interval)"
        verdict = "significant" if self.significant else "not significant"
        return (
            f"{self.mean:+.4f}, 95% CI [{self.low:+.4f}, {self.high:+.4f}] over {self.n} seeds "
            f"(std {self.std:.4f}; {verdict} at 5%)"
        )


def paired_difference(diffs: Sequence[float]) -> PairedDifference:
    """:class:`PairedDifference` of per-seed differences (a paired t interval)."""
    mean, std = _mean_std(diffs)
    n = len(diffs)
    half = _t975(n - 1) * std / math.sqrt(n) if n > 1 else float("nan")
    return PairedDifference(n, mean, std, mean - half, mean + half)


def read_csv(paths: Sequence[Path | str]) -> list[DemoResult]:
    """The runs of :func:`write_csv` files (per-step metrics, no policy), in file order; each
    (mode, seed) once. For a summary of runs made in several processes."""
    runs: dict[tuple[str, int], list[StepMetrics]] = {}
    kinds = {f.name: f.type for f in fields(StepMetrics)}
    for path in paths:
        with Path(path).open(newline="") as f:
            for rec in csv.DictReader(f):
                key = (rec["mode"], int(rec["seed"]))
                values = {k: (int if kinds[k] in (int, "int") else float)(rec[k]) for k in kinds}
                runs.setdefault(key, []).append(StepMetrics(**values))
    out = []
    for (mode, seed), rows in runs.items():
        config = DemoConfig(naive=mode == "naive", seed=seed, steps=len(rows))
        out.append(DemoResult(config, rows, "", None))
    return out


# ---------------------------------------------------------------------------------------------
# output: CSV and plot


def write_csv(results: Sequence[DemoResult], path: Path | str) -> None:
    """One row per (mode, seed, step) with every :class:`StepMetrics` field; overwrites
    ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    names = ["mode", "seed"] + [f.name for f in fields(StepMetrics)]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=names)
        writer.writeheader()
        for result in results:
            for row in result.rows:
                writer.writerow(
                    {"mode": result.config.mode, "seed": result.config.seed, **asdict(row)}
                )


def _moving_mean(values: Sequence[float], k: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= k:
            acc -= values[i - k]
        out.append(acc / min(i + 1, k))
    return out


MODE_COLORS = {"logitless": "#1f5fb4", "naive": "#e6862e"}


def _plot_mode(ax_r, ax_m, mode: str, runs: list[DemoResult]) -> None:
    """One mode's curves of :func:`plot_demo`: its reward (a moving mean; with several seeds
    their mean in a min-max band) and its peak step memory (the median over seeds)."""
    color = MODE_COLORS.get(mode)
    steps = [r.step for r in runs[0].rows[: min(len(r.rows) for r in runs)]]
    n = len(steps)
    k = runs[0].window()  # 10 steps, or half a shorter run: what the final reward averages
    curves = [_moving_mean([r.reward for r in run.rows[:n]], k) for run in runs]
    mems = [[r.peak_mem_mb for r in run.rows[:n]] for run in runs]
    mean_final, std_final = _mean_std([run.reward_window(False) for run in runs])
    if len(runs) == 1:
        ax_r.plot(steps, [r.reward for r in runs[0].rows], color=color, alpha=0.25, lw=0.8)
        label = f"{mode}: {k}-step moving mean (final {mean_final:.2f})"
    else:
        lo = [min(c[i] for c in curves) for i in range(n)]
        hi = [max(c[i] for c in curves) for i in range(n)]
        ax_r.fill_between(steps, lo, hi, color=color, alpha=0.2, lw=0)
        label = (
            f"{mode}: mean of {len(runs)} seeds, band min-max "
            f"(final {mean_final:.2f} ± {std_final:.2f})"
        )
    ax_r.plot(
        steps,
        [sum(c[i] for c in curves) / len(curves) for i in range(n)],
        color=color,
        label=label,
    )
    median = [statistics.median(m[i] for m in mems) for i in range(n)]
    if len(runs) > 1:
        ax_m.fill_between(
            steps,
            [min(m[i] for m in mems) for i in range(n)],
            [max(m[i] for m in mems) for i in range(n)],
            color=color,
            alpha=0.2,
            lw=0,
        )
    ax_m.plot(
        steps, median, color=color, label=f"{mode}: median {statistics.median(median):.0f} MB"
    )


def plot_demo(results: Sequence[DemoResult], path: Path | str) -> bool:
    """PNG of reward and peak step memory per step, one curve per mode.

    With one seed per mode: the reward of each step (faint) and its moving mean over
    :meth:`DemoResult.window` steps (10, or half a shorter run). With several: the mean over
    seeds of that moving mean, in a band from the lowest to the
    highest seed; the legend gives the final reward, mean ± standard deviation across seeds.
    Memory: the median over seeds of each step's peak, in the same kind of band.

    Returns False, writing nothing, when matplotlib is not installed (the caller prints a
    note: ``pip install -e '.[bench]'`` in a logitless checkout).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (ax_r, ax_m) = plt.subplots(1, 2, figsize=(12, 4.6), layout="constrained")
    by_mode: dict[str, list[DemoResult]] = {}
    for result in results:
        by_mode.setdefault(result.config.mode, []).append(result)
    for mode, runs in by_mode.items():
        _plot_mode(ax_r, ax_m, mode, runs)
    c = results[0].config if results else DemoConfig()
    seeds = sorted({r.config.seed for r in results})
    seed_text = f"seed {seeds[0]}" if len(seeds) == 1 else f"{len(seeds)} seeds"
    ax_r.set(
        xlabel="GRPO step",
        ylabel="mean reward of the step's samples",
        ylim=(0, 1.02),
        title=f"reward (chance: 0.1), {seed_text}",
    )
    ax_m.set(
        xlabel="GRPO step",
        ylabel="MB",
        title=f"peak extra memory of each step ({c.device})",
    )
    ax_m.set_ylim(bottom=0)
    fig.suptitle(
        f"GRPO on a random-init Llama (V={c.vocab}, H={c.hidden}, {c.layers} layers): echo the "
        f"last of {c.digits} digits; {c.prompts} prompts x {c.group} samples per step"
    )
    for ax in (ax_r, ax_m):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=9, loc="lower right" if ax is ax_r else "best")
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
