"""Small public result types."""

from __future__ import annotations

from typing import NamedTuple

import torch


class LogProbs(NamedTuple):
    """Result of :func:`logitless.linear_logprobs`.

    logprobs: ``[...]`` fp32 log-probability of each label; 0.0 where the label is ignored.
    entropy: ``[...]`` fp32 entropy of each row's distribution (0.0 where ignored), or ``None``
    when ``with_entropy=False``.

    With sampling replay (``sampling_mask=`` / ``top_k=`` / ``top_p=`` / ``min_p=``) the call
    returns a :class:`ReplayLogProbs`, whose extra attributes report the kept sets; with
    ``rollout_topk=`` its ``mismatch`` attribute holds a :class:`RolloutMismatch` (a
    :class:`RolloutLogProbs` without replay). They are attributes, not tuple items, so
    ``logp, ent = out`` unpacks two values either way; on a plain result they are None.
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor | None

    # Sampling-replay attributes (see ReplayLogProbs); None without replay.
    label_added = None
    kept_size = None
    log_kept_mass = None
    # The rollout-mismatch diagnostics (see RolloutLogProbs); None without rollout_topk.
    mismatch = None


class RolloutMismatch(NamedTuple):
    """The trainer's next-token distribution against the rollout engine's, per position: the
    ``mismatch`` of a call given ``rollout_topk=`` (docs/rollout-mismatch.md).

    The engine reported ``k`` ids ``K`` with its log-probs; the trainer's distribution ``t``
    (the call's: full vocabulary, or the sampler's kept set with sampling replay) is compared
    with the engine's ``r`` on the partition {each id of ``K``, the rest of the vocabulary}:
    each KL and the total variation below is exact on that partition and, by the
    data-processing inequality, a lower bound of its full-vocabulary value.

    logprobs: ``[..., k]`` the trainer's log-probs of the engine's ids (0.0 at unused slots and
        ignored positions; ``-inf`` at an id outside the trainer's kept set under replay).
    kl_rollout_trainer: ``[...]`` KL(r‖t) on the partition.
    kl_trainer_rollout: ``[...]`` KL(t‖r) on the partition.
    total_variation: ``[...]`` ``½ Σ |r - t|`` on the partition.
    topk_mass: ``[...]`` the trainer's probability of the engine's ids, ``Σ_K t``.
    rollout_mass: ``[...]`` the engine's own, ``Σ_K r``.
    top1_agree: ``[...]`` bool: a token is both the engine's most likely among its ids (the
        largest log-prob given; ties count) and one of the trainer's most likely tokens (its
        logit equals the trainer's maximum over the vocabulary, or the kept set: the same
        computed values, so ties count exactly).
    compared: ``[...]`` bool: the position has a label and at least one id; every other output
        is 0 (False) where it is False.

    fp32 tensors (float64 for a float64 head); no gradient.
    """

    logprobs: torch.Tensor
    kl_rollout_trainer: torch.Tensor
    kl_trainer_rollout: torch.Tensor
    total_variation: torch.Tensor
    topk_mass: torch.Tensor
    rollout_mass: torch.Tensor
    top1_agree: torch.Tensor
    compared: torch.Tensor


class RolloutLogProbs(LogProbs):
    """:class:`LogProbs` of a call given ``rollout_topk=`` (without sampling replay), with its
    ``mismatch`` (a :class:`RolloutMismatch`): an attribute, not a tuple item, so
    ``logp, ent = out`` still unpacks two values."""

    def __new__(
        cls,
        logprobs: torch.Tensor,
        entropy: torch.Tensor | None,
        mismatch: RolloutMismatch | None = None,
    ) -> RolloutLogProbs:
        self = super().__new__(cls, logprobs, entropy)
        self.mismatch = mismatch
        return self

    def _replace(self, **changes) -> RolloutLogProbs:
        fields = {"logprobs": self.logprobs, "entropy": self.entropy, "mismatch": self.mismatch}
        return RolloutLogProbs(**(fields | changes))

    def __repr__(self) -> str:
        return (
            f"RolloutLogProbs(logprobs={self.logprobs!r}, entropy={self.entropy!r}, "
            f"mismatch={self.mismatch!r})"
        )


class ReplayLogProbs(LogProbs):
    """:class:`LogProbs` of a call with sampling replay: log-probs and entropy over each row's
    kept set ``K`` (the label always counted in it), and what the kept sets were.

    label_added: ``[...]`` bool, True where the label was not in the sampler's kept set and was
        added to it (a rounding at the top-k / top-p boundary, or a mask that lacks the
        sampled token); False at ignored rows. ``label_added.sum()`` counts them.
    kept_size: ``[...]`` int64 ``|K|`` with the label counted (the vocabulary size where the
        row was not truncated, 0 at ignored rows).
    log_kept_mass: ``[...]`` fp32 ``log Σ_{j∈K} softmax(z)_j`` under the full softmax (0 where
        not truncated or ignored): the bias an unreplayed log-prob would carry. None unless
        ``with_kept_mass=True``.
    mismatch: a :class:`RolloutMismatch` against the kept-set distribution, with
        ``rollout_topk=``; else None.
    """

    def __new__(
        cls,
        logprobs: torch.Tensor,
        entropy: torch.Tensor | None,
        label_added: torch.Tensor | None = None,
        kept_size: torch.Tensor | None = None,
        log_kept_mass: torch.Tensor | None = None,
        mismatch: RolloutMismatch | None = None,
    ) -> ReplayLogProbs:
        self = super().__new__(cls, logprobs, entropy)
        self.label_added = label_added
        self.kept_size = kept_size
        self.log_kept_mass = log_kept_mass
        self.mismatch = mismatch
        return self

    def _replace(self, **changes) -> ReplayLogProbs:
        fields = {k: getattr(self, k) for k in ("logprobs", "entropy", *_REPLAY_FIELDS)}
        return ReplayLogProbs(**(fields | changes))

    def __repr__(self) -> str:
        extra = ", ".join(f"{k}={getattr(self, k)!r}" for k in _REPLAY_FIELDS)
        return f"ReplayLogProbs(logprobs={self.logprobs!r}, entropy={self.entropy!r}, {extra})"


_REPLAY_FIELDS = ("label_added", "kept_size", "log_kept_mass", "mismatch")


class Divergence(NamedTuple):
    """Result of :func:`logitless.linear_divergence`.

    divergence: ``[...]`` fp32 per-token divergence between the teacher's and the student's
    next-token distributions (the TRL ``beta`` convention); 0.0 where the label is ignored.
    logprobs: ``[...]`` fp32 student log-probability of each label (0.0 where ignored), or
    ``None`` unless ``with_logprobs=True``.
    entropy: ``[...]`` fp32 entropy of the student's distribution (0.0 where ignored), or
    ``None`` unless ``with_entropy=True``.
    """

    divergence: torch.Tensor
    logprobs: torch.Tensor | None
    entropy: torch.Tensor | None


class TeacherHead(NamedTuple):
    """A teacher's final hidden states and LM head: the ``teacher=`` of
    :func:`logitless.fused_policy_loss` (the distillation term, docs/distillation.md).

    hidden: ``[..., H_t]`` the teacher's hidden states at the student's positions (its width
    may differ; no gradient). weight: ``[V_t, H_t]``; bias: ``[V_t]`` or None. logit_scale,
    softcap: the teacher head's transform. vocab_size: the common vocabulary when the two
    heads differ by padding rows (see :func:`logitless.linear_divergence`).
    """

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None = None
    logit_scale: float | None = None
    softcap: float | None = None
    vocab_size: int | None = None
