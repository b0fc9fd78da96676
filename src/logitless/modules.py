"""Module forms of the head that hold the head weight itself: for FSDP2 and tied embeddings.

:class:`LogprobHead` and :class:`PolicyLossHead` take the module that owns the ``[V, H]`` head
weight (an ``nn.Linear`` LM head, or the ``nn.Embedding`` of a model with tied embeddings) and
register its ``weight`` (and ``bias``) as their own parameters: the *same* ``Parameter``
objects, the way a tied ``lm_head`` shares the embedding's weight. They read the weight inside
their own ``forward``, so FSDP2 sees an ordinary module: ``fully_shard(head)`` all-gathers the
weight in the head's forward pre-hook and reduce-scatters its gradient after the head's
backward. A tied weight goes in one group with the embedding, ``fully_shard([embed, head])``;
FSDP2 then swaps the shared parameter in both modules and the gradients of the lookup and of
the head sum into it before the reduce-scatter.

FSDP2 mixed precision: ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)`` casts every
floating tensor argument of a sharded module's forward to bf16 by default, old log-probs,
advantages and the counts inside a ``LossNormalizer`` included. Shard the head (and any module
whose forward passes loss inputs on to it) with ``cast_forward_inputs=False``; the heads raise
``ValueError`` on 16-bit loss inputs rather than compute with them.

The heads keep weak references to the source module and its original parameters, and raise
``ValueError`` in forward if the source has been given a new weight since (``fully_shard`` on
the source alone, ``load_state_dict(assign=True)``, ...), rather than train a stale copy.

Why the weight and not the module: if the head held the embedding as a child module, the
embedding would sit inside the head's subtree, and ``fully_shard([embed, head])`` would keep
only ``head`` as a root of the group (torch drops a listed module that is a descendant of
another), so the embedding lookup would get no unshard hook.
"""

from __future__ import annotations

import weakref
from typing import Unpack

import torch
from torch import nn

from .contract.checks import check_full_precision, is_dtensor
from .contract.divergence import DivergenceOptions, TeacherTopK, check_divergence_call
from .contract.options import (
    HeadKwargs,
    HeadOptions,
    SamplerCallKwargs,
    SamplerOptions,
    stored_options,
)
from .losses import LossNormalizer, PolicyLossConfig
from .losses.checks import check_config
from .ops.divergence.op import divergence_of_call
from .ops.fused_loss.op import fused_loss_of
from .ops.logprobs.op import logprobs_of
from .types import Divergence, LogProbs

__all__ = [
    "DivergenceHead",
    "HeadOptions",
    "LinearLogprobs",
    "LogprobHead",
    "PolicyLossHead",
    "SamplerOptions",
]


class LinearLogprobs(nn.Module):
    """Thin module form of :func:`~logitless.linear_logprobs`: stores the options (a
    :class:`~logitless.contract.options.HeadOptions` and a
    :class:`~logitless.contract.options.SamplerOptions`, ``.options`` / ``.sampler``), owns no
    weight. ``LinearLogprobs(with_entropy=True)(hidden, weight, labels)`` equals
    ``linear_logprobs(hidden, weight, labels, with_entropy=True)``; a per-call ``temperature``
    (e.g. a per-token tensor) overrides the stored one. The sampler settings (``top_k``,
    ``top_p``, ``min_p``, ``with_kept_mass``) turn on sampling replay for every call; a
    per-call ``sampling_mask`` replaces them, a per-call ``top_k`` / ``top_p`` / ``min_p``
    overrides its own.
    """

    def __init__(self, **options: Unpack[HeadKwargs]) -> None:
        super().__init__()
        self.options, self.sampler = stored_options(type(self).__name__, options)

    def forward(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        bias: torch.Tensor | None = None,
        temperature: float | torch.Tensor | None = None,
        **sampler: Unpack[SamplerCallKwargs],
    ) -> LogProbs:
        """Log-probs (and entropy) of ``labels`` ``[...]`` from ``hidden`` ``[..., H]``."""
        return logprobs_of(
            hidden,
            weight,
            labels,
            bias,
            self.options.replace(temperature=temperature),
            self.sampler.for_call(type(self).__name__, sampler),
        )

    @property
    def with_entropy(self) -> bool:
        return self.options.with_entropy

    def extra_repr(self) -> str:
        return f"{self.options.describe()}{self.sampler.describe()}"


def _fsdp(module: nn.Module) -> bool:
    """Whether FSDP2 manages ``module`` (it swaps the parameters in its own hooks)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    return isinstance(module, FSDPModule)


class _SharedHeadWeight(nn.Module):
    """Registers a source module's ``weight`` ``[V, H]`` (and ``bias`` ``[V]`` or None) as the
    same Parameter objects, and checks in forward that they are still the source's."""

    weight: nn.Parameter
    bias: nn.Parameter | None

    def __init__(self, source: nn.Module) -> None:
        super().__init__()
        owner = type(self).__name__
        if not isinstance(source, nn.Module):
            raise ValueError(
                f"{owner}: source must be an nn.Module that owns the [V, H] head weight (an "
                f"nn.Linear, an nn.Embedding, ...), got {type(source).__name__}"
            )
        weight = getattr(source, "weight", None)
        if not isinstance(weight, nn.Parameter):
            raise ValueError(
                f"{owner}: source ({type(source).__name__}) must have an nn.Parameter "
                f"attribute 'weight' of shape [V, H], got {type(weight).__name__}"
            )
        if weight.dim() != 2 or not weight.is_floating_point():
            raise ValueError(
                f"{owner}: source.weight must be a floating [V, H] parameter, got dtype "
                f"{weight.dtype} and shape {list(weight.shape)}"
            )
        bias = getattr(source, "bias", None)
        if bias is not None and (
            not isinstance(bias, nn.Parameter)
            or bias.shape != weight.shape[:1]
            or not bias.is_floating_point()
        ):
            got = (
                f"dtype {bias.dtype} and shape {list(bias.shape)}"
                if isinstance(bias, torch.Tensor)
                else type(bias).__name__
            )
            raise ValueError(
                f"{owner}: source.bias must be None or a floating nn.Parameter of shape "
                f"[{weight.shape[0]}] (weight's V), got {got}"
            )
        self.register_parameter("weight", weight)
        self.register_parameter("bias", bias)
        # Weak references only: holding the source (or its original weight) would keep a full
        # copy of the weight alive after FSDP2 has sharded it.
        self._source_refs: tuple | None = (
            weakref.ref(source),
            weakref.ref(weight),
            None if bias is None else weakref.ref(bias),
        )

    def _current_parameters(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(weight, bias)`` as registered now (FSDP2 swaps them in its hooks).

        Raises ValueError if they cannot be used: still a sharded DTensor (the head was left
        out of the FSDP2 group), or no longer the source module's parameter (the source's was
        replaced after the head was built, e.g. by ``fully_shard`` on the source alone: the
        head would silently train a stale copy).
        """
        owner = type(self).__name__
        weight, bias = self.weight, self.bias
        if self._source_refs is not None:
            source_ref, *built_refs = self._source_refs
            source = source_ref()
            for name, ours, built_ref in zip(
                ("weight", "bias"), (weight, bias), built_refs, strict=True
            ):
                now = None if source is None else getattr(source, name, None)
                built = None if built_ref is None else built_ref()
                if source is not None and now is not ours and now is built and not _fsdp(self):
                    raise ValueError(
                        f"{owner}: its '{name}' is no longer the {type(source).__name__}'s "
                        f"parameter (it was replaced on the head, e.g. by load_state_dict("
                        f"..., assign=True)), so the tie is broken: the head would train a "
                        f"copy the source never sees. Load the state into the source module "
                        f"(or the whole model) and build the head after, or load without "
                        f"assign=True (copies into the shared parameter)."
                    )
                if source is not None and now is not ours and now is not built:
                    raise ValueError(
                        f"{owner}: the {type(source).__name__} it was built from holds a new "
                        f"'{name}' parameter, so this head no longer shares it and would train "
                        f"a stale copy. Typical cause: fully_shard applied to that module "
                        f"without the head; put every module holding the weight in one group, "
                        f"e.g. `fully_shard([model.embed_tokens, head])` or "
                        f"`fully_shard([lm_head, head])`. Otherwise (load_state_dict("
                        f"assign=True), to_empty, re-tying) build the head after that step."
                    )
        if is_dtensor(weight) or (bias is not None and is_dtensor(bias)):
            raise ValueError(
                f"{owner}: the head weight is a DTensor in forward (still sharded). FSDP2 "
                f"gathers parameters in the forward hooks of the modules it was applied to: "
                f"put this {owner} in the group that holds the weight, `fully_shard(head)`, "
                f"or with a weight tied to the input embedding one group for all its users, "
                f"`fully_shard([model.embed_tokens, head])`. For a tensor-parallel head, build "
                f"the {owner} from a module holding this rank's plain [V/tp, H] shard and pass "
                f"vocab_parallel=."
            )
        return weight, bias

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_source_refs"] = None  # weak references do not pickle; the copy has no source
        return state

    def _describe(self) -> str:
        """What a subclass adds to the repr between the head's shape and its options."""
        return ""

    def extra_repr(self) -> str:
        vocab, dim = self.weight.shape
        sampler = getattr(self, "sampler", None)
        return (
            f"vocab={vocab}, hidden={dim}, {self._describe()}{self.options.describe()}"
            f"{sampler.describe() if sampler is not None else ''}"
        )


class LogprobHead(_SharedHeadWeight):
    """:func:`~logitless.linear_logprobs` as a module holding the head weight (shared, not copied).

    ``LogprobHead(lm_head)(hidden, labels)`` equals ``linear_logprobs(hidden, lm_head.weight,
    labels, bias=lm_head.bias)`` with the stored options. ``head.weight`` *is*
    ``source.weight`` (and ``head.bias`` is ``source.bias``, or None): the same ``Parameter``,
    so optimizers, ``.grad`` and tied weights see one tensor.

    FSDP2: the weight is read inside this module's forward, so ``fully_shard(head)`` gathers it
    there. Every module that holds the weight must be in the head's group: with tied
    embeddings, ``fully_shard([model.embed_tokens, head])``; the gradients of the lookup and of
    the head then sum into the one parameter before the reduce-scatter.

    Args:
        source: module owning the head weight: ``nn.Linear(H, V)`` (its ``[V, H]`` weight and
            optional ``[V]`` bias), ``nn.Embedding(V, H)`` (tied embeddings), or any module
            with an ``nn.Parameter`` ``weight`` ``[V, H]`` (and optionally ``bias`` ``[V]``).
        temperature, softcap, logit_scale, with_entropy, ignore_index, chunk_size, head_dtype,
            vocab_parallel, backend, capturable, row_capacity, batch_invariant: as in
            :func:`~logitless.linear_logprobs`.
        top_k, top_p, min_p, with_kept_mass: the rollout sampler's settings, for sampling
            replay, as in :func:`~logitless.linear_logprobs` (None: not used).

    Forward: ``head(hidden [..., H], labels [...], temperature=None, *, sampling_mask=None,
    top_k=None, top_p=None, min_p=None) -> LogProbs`` of fp32 ``[...]`` tensors; a per-call
    ``temperature`` (e.g. a per-token tensor) or sampler setting (e.g. a per-token tensor)
    overrides the stored one; ``sampling_mask`` (the engine's kept ids) replaces the stored
    sampler settings for that call.

    Raises:
        ValueError: at construction if ``source`` has no floating ``[V, H]`` weight parameter
            (or a bias that is not ``[V]``); in forward on bad inputs, if the weight is still
            a sharded DTensor, or if ``source`` has been given a new weight since the head was
            built (e.g. ``fully_shard`` on ``source`` without the head): the head would train a
            stale copy; or if a per-token ``temperature`` tensor is 16-bit (as FSDP2's
            ``MixedPrecisionPolicy`` casts it unless ``cast_forward_inputs=False``). The messages
            say how to apply ``fully_shard``.

    Example:
        >>> import torch
        >>> from logitless.modules import LogprobHead
        >>> embed = torch.nn.Embedding(100, 16)                   # tied: [V, H] weight
        >>> head = LogprobHead(embed, with_entropy=True)
        >>> head.weight is embed.weight
        True
        >>> ids = torch.randint(0, 100, (2, 6))
        >>> hidden = torch.tanh(embed(ids))                        # a stand-in backbone
        >>> labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
        >>> out = head(hidden, labels)
        >>> out.logprobs.shape
        torch.Size([2, 6])
        >>> out.logprobs.sum().backward()                       # lookup + head gradients
        >>> embed.weight.grad.shape
        torch.Size([100, 16])
    """

    def __init__(self, source: nn.Module, **options: Unpack[HeadKwargs]) -> None:
        super().__init__(source)
        self.options, self.sampler = stored_options(type(self).__name__, options)

    def forward(
        self,
        hidden: torch.Tensor,
        labels: torch.Tensor,
        temperature: float | torch.Tensor | None = None,
        **sampler: Unpack[SamplerCallKwargs],
    ) -> LogProbs:
        """Log-probs (and entropy) of ``labels`` ``[...]`` from ``hidden`` ``[..., H]``."""
        weight, bias = self._current_parameters()
        check_full_precision(
            temperature=temperature, top_p=sampler.get("top_p"), min_p=sampler.get("min_p")
        )
        out = logprobs_of(
            hidden,
            weight,
            labels,
            bias,
            self.options.replace(temperature=temperature),
            self.sampler.for_call(type(self).__name__, sampler),
        )
        # FSDP2 registers its pre-backward hook on the module's outputs; an in-place op on an
        # output that is a view would drop it (torch warns about views). [N]-sized copies.
        # (_replace keeps a replay result's attributes.)
        return out._replace(
            **{k: t.clone() for k, t in zip(out._fields, out, strict=True) if _is_view(t)}
        )

    @property
    def with_entropy(self) -> bool:
        return self.options.with_entropy

    def _describe(self) -> str:
        return f"bias={self.bias is not None}, "


class PolicyLossHead(_SharedHeadWeight):
    """:func:`~logitless.fused_policy_loss` as a module holding the head weight (shared).

    ``PolicyLossHead(lm_head, config=cfg)(hidden, labels, old, adv)`` equals
    ``fused_policy_loss(hidden, lm_head.weight, labels, old, adv, config=cfg,
    bias=lm_head.bias)`` with the stored options. The weight and bias are registered as in
    :class:`LogprobHead` (the same ``Parameter`` objects), and FSDP2 is applied the same way:
    ``fully_shard(head)``, or ``fully_shard([model.embed_tokens, head])`` for a tied weight.

    The head's gradients are computed in forward and handed to autograd by ``loss.backward()``
    from the node that produced the loss, so they reach the (unsharded) parameter's ``.grad``
    before FSDP2's post-backward reduce-scatter, like the gradient of any other layer.

    Args:
        source: module owning the ``[V, H]`` weight (and optional ``[V]`` bias), as in
            :class:`LogprobHead`.
        config: the :class:`~logitless.PolicyLossConfig`.
        temperature, softcap, logit_scale, head_dtype, chunk_size, ignore_index, vocab_parallel,
            backend, capturable, row_capacity, batch_invariant: as in
            :func:`~logitless.fused_policy_loss`.
        top_k, top_p, min_p, with_kept_mass: the rollout sampler's settings, for sampling
            replay, as in :func:`~logitless.fused_policy_loss` (None: not used).

    Forward: ``head(hidden, labels, old_logprobs, advantages, *, document_ids=None,
    ref_logprobs=None, rollout_logprobs=None, normalizer=None, temperature=None,
    sampling_mask=None, top_k=None, top_p=None, min_p=None) -> (loss, metrics)`` with
    ``hidden`` ``[N, H]`` or ``[B, T, H]``, the rest ``[N]`` / ``[B, T]`` (and advantages
    per sequence or per token) as in :func:`~logitless.fused_policy_loss`; a per-call
    ``temperature`` or sampler setting overrides the stored one, and a ``sampling_mask``
    replaces the stored sampler settings for that call.

    Raises:
        ValueError: as :class:`LogprobHead`, and if a loss input (old / ref / rollout
            log-probs, advantages, a temperature tensor, the normalizer's counts) is a 16-bit
            float: FSDP2's ``MixedPrecisionPolicy`` casts them unless the head is sharded with
            ``cast_forward_inputs=False``.

    Example:
        >>> import torch, logitless
        >>> from logitless.modules import PolicyLossHead
        >>> lm_head = torch.nn.Linear(16, 100, bias=False)
        >>> head = PolicyLossHead(lm_head, config=logitless.PolicyLossConfig())
        >>> hidden = torch.randn(2, 6, 16, requires_grad=True)
        >>> labels = torch.randint(0, 100, (2, 6))
        >>> labels[:, :2] = -100                                  # prompt tokens
        >>> with torch.no_grad():
        ...     old = logitless.linear_logprobs(hidden, lm_head.weight, labels).logprobs
        >>> loss, metrics = head(hidden, labels, old, torch.tensor([1.0, -1.0]))
        >>> loss.backward()
        >>> lm_head.weight.grad.shape
        torch.Size([100, 16])
    """

    def __init__(
        self,
        source: nn.Module,
        *,
        config: PolicyLossConfig | None = None,
        **options: Unpack[HeadKwargs],
    ) -> None:
        try:
            check_config(config)
        except ValueError as e:
            raise ValueError(f"PolicyLossHead: {e}") from None
        if "with_entropy" in options:
            raise TypeError(
                "PolicyLossHead() takes no with_entropy: the entropy is computed when "
                "config.entropy_coef != 0"
            )
        super().__init__(source)
        self.config = config
        self.options, self.sampler = stored_options(type(self).__name__, options)

    def forward(
        self,
        hidden: torch.Tensor,
        labels: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        *,
        document_ids: torch.Tensor | None = None,
        ref_logprobs: torch.Tensor | None = None,
        rollout_logprobs: torch.Tensor | None = None,
        normalizer: LossNormalizer | None = None,
        temperature: float | torch.Tensor | None = None,
        **sampler: Unpack[SamplerCallKwargs],
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(loss, metrics)`` of :func:`~logitless.fused_policy_loss` with this head's weight."""
        weight, bias = self._current_parameters()
        check_full_precision(top_p=sampler.get("top_p"), min_p=sampler.get("min_p"))
        return fused_loss_of(
            hidden,
            weight,
            labels,
            bias,
            self.options.replace(temperature=temperature),
            self.sampler.for_call(type(self).__name__, sampler),
            old_logprobs,
            advantages,
            config=self.config,
            document_ids=document_ids,
            ref_logprobs=ref_logprobs,
            rollout_logprobs=rollout_logprobs,
            normalizer=normalizer,
        )

    def _describe(self) -> str:
        return f"bias={self.bias is not None}, config={self.config}, "


class DivergenceHead(_SharedHeadWeight):
    """:func:`~logitless.linear_divergence` as a module holding the *student's* head weight
    (shared, not copied), for FSDP2 and tied embeddings as :class:`LogprobHead`.

    ``DivergenceHead(lm_head, beta=0.5)(hidden, labels, teacher_hidden, teacher_weight)``
    equals ``linear_divergence(hidden, lm_head.weight, labels, teacher_hidden, teacher_weight,
    bias=lm_head.bias, beta=0.5)``. The teacher is an argument of each call: it is frozen, and
    its head may be sharded and gathered by its own owner.

    Args:
        source: the module owning the student's ``[V, H]`` head weight (see
            :class:`LogprobHead`).
        beta, teacher_softcap, teacher_logit_scale, vocab_size, with_logprobs: as in
            :func:`~logitless.linear_divergence`.
        temperature, softcap, logit_scale, with_entropy, ignore_index, chunk_size, head_dtype,
            vocab_parallel, backend, batch_invariant: as in
            :func:`~logitless.linear_divergence` (the student's head options). Sampler settings
            and the capturable mode are not options of the divergence: ``TypeError`` /
            ``ValueError``.

    Forward: ``head(hidden [..., H], labels [...], teacher_hidden [..., H_t] = None,
    teacher_weight [V_t, H_t] = None, teacher_bias [V_t] = None, *, teacher_topk=None,
    temperature=None) -> Divergence`` of fp32 ``[...]`` tensors; a per-call ``temperature``
    overrides the stored one.

    Example:
        >>> import torch
        >>> from logitless.modules import DivergenceHead
        >>> lm_head = torch.nn.Linear(16, 100, bias=False)
        >>> head = DivergenceHead(lm_head, beta=0.5, with_entropy=True)
        >>> labels = torch.randint(0, 100, (2, 6))
        >>> out = head(torch.randn(2, 6, 16), labels, torch.randn(2, 6, 24), torch.randn(100, 24))
        >>> out.divergence.shape, out.entropy.shape
        (torch.Size([2, 6]), torch.Size([2, 6]))
        >>> out.divergence.sum().backward()
        >>> lm_head.weight.grad.shape
        torch.Size([100, 16])
    """

    def __init__(
        self,
        source: nn.Module,
        *,
        beta: float = 0.0,
        teacher_softcap: float | None = None,
        teacher_logit_scale: float | None = None,
        vocab_size: int | None = None,
        with_logprobs: bool = False,
        **options: Unpack[HeadKwargs],
    ) -> None:
        super().__init__(source)
        self.options, sampler = stored_options(type(self).__name__, options)
        if sampler.replaying or self.options.capturable:
            raise ValueError(
                "DivergenceHead takes no sampler settings (top_k, top_p, min_p) and no "
                "capturable mode: linear_divergence has neither"
            )
        self.divergence = DivergenceOptions(
            beta, teacher_softcap, teacher_logit_scale, vocab_size, with_logprobs
        )

    def forward(
        self,
        hidden: torch.Tensor,
        labels: torch.Tensor,
        teacher_hidden: torch.Tensor | None = None,
        teacher_weight: torch.Tensor | None = None,
        teacher_bias: torch.Tensor | None = None,
        *,
        teacher_topk: TeacherTopK | None = None,
        temperature: float | torch.Tensor | None = None,
    ) -> Divergence:
        """The divergence of each row of ``hidden`` ``[..., H]`` from the teacher's."""
        weight, bias = self._current_parameters()
        check_full_precision(temperature=temperature)
        teacher = (teacher_hidden, teacher_weight, teacher_bias)
        options = self.options.replace(temperature=temperature)
        div = self.divergence
        call = check_divergence_call(
            hidden, weight, labels, bias, teacher, teacher_topk, options, div
        )
        out = divergence_of_call(call)
        # as LogprobHead: no view among the outputs (FSDP2's pre-backward hook)
        return out._replace(
            **{k: t.clone() for k, t in zip(out._fields, out, strict=True) if _is_view(t)}
        )

    def _describe(self) -> str:
        return f"beta={self.divergence.beta}, "


def _is_view(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t._base is not None
