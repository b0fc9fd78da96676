"""One GRPO step's pieces: the rollout batch (sampled, scored, with no-grad old and reference
log-probs) and the policy loss on it by either head path."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ...advantages import grpo_advantages
from ...losses import PolicyLossConfig, policy_loss
from .config import DemoConfig
from .policy import _naive_logprobs, sample, token_logprobs
from .task import IGNORE, ToyTask, response_labels

if TYPE_CHECKING:  # transformers is an optional dependency (extra "hf")
    from transformers import PreTrainedModel


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
    from ...integrations.hf import causal_lm_policy_loss

    return causal_lm_policy_loss(
        model,
        batch.ids,
        batch.old_logprobs,
        batch.advantages,
        config=loss_config,
        target_ids=batch.labels,
        ref_logprobs=batch.ref_logprobs,
    )
