"""The HF integration's public entry points (re-exported by :mod:`logitless.integrations.hf`,
whose docstring describes them): each checks its arguments, then runs the backbone and the head
as the outermost wrapper's forward (:mod:`~logitless.integrations.hf.forward`)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ...contract.divergence import DivergenceOptions
from ...contract.options import IGNORE_INDEX, Backend, HeadOptions, SamplerOptions, given_arguments
from ...contract.rollout import RolloutTopK
from ...losses import LossNormalizer, PolicyLossConfig
from ...sampling import SamplingMask
from ...types import Divergence, LogProbs
from ..seam import LossInputs
from ..wrappers import run_in_forward, unwrap
from . import forward
from .batch import (
    MASK_DTYPES,
    ModelBatch,
    batch_labels,
    check_input_ids,
    check_like_ids,
    check_position_ids,
)
from .model import (
    SUPPORTED_MODELS,
    CausalLMHead,
    causal_lm_head,
    causal_lm_router_aux_coef,
    check_model,
    run_backbone,
)
from .vlm import BackboneInputs

__all__ = [
    "SUPPORTED_MODELS",
    "CausalLMHead",
    "causal_lm_divergence",
    "causal_lm_head",
    "causal_lm_hidden_states",
    "causal_lm_labels",
    "causal_lm_logprobs",
    "causal_lm_policy_loss",
    "causal_lm_router_aux_coef",
    "check_model",
    "run_in_forward",
]


# Backbone arguments the functions set themselves (or that would change which hidden states
# come out): refused in ``**model_kwargs``.
_RESERVED_KWARGS = frozenset(
    {
        "input_ids",
        "attention_mask",
        "position_ids",
        "inputs_embeds",
        "past_key_values",
        "use_cache",
        "labels",
        "logits_to_keep",
        "output_hidden_states",
        "return_dict",
        "cache_position",
        "cache",
        "mm_encoder_outputs",
    }
)


# --------------------------------------------------------------------------------------------
# model inspection


def causal_lm_labels(
    input_ids: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    response_mask: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Next-token labels of a ``[B, T]`` batch, aligned like HF logits (the default labels).

    ``labels[:, t] = input_ids[:, t + 1]`` when tokens ``t`` and ``t + 1`` are real tokens of
    the same document and token ``t + 1`` is a response token; ``ignore_index`` otherwise
    (the last position of every row always). Built with :func:`logitless.next_token_labels`.

    Args:
        input_ids: ``[B, T]`` token ids.
        attention_mask: ``[B, T]`` 0/1 (or bool); 0 marks padding, anywhere (left, right).
        position_ids: ``[B, T]``; a row's documents restart at 0 (packed rows). Where
            ``attention_mask`` is 0 the position is ignored, so HF-style padding positions
            are fine; without a mask, a negative position marks padding.
        cu_seqlens: ``[D + 1]`` cumulative document lengths of a single packed row
            (``B == 1``); tokens after ``cu_seqlens[-1]`` are padding. Not with position_ids.
        response_mask: ``[B, T]`` bool over ``input_ids``: True at the tokens whose log-prob
            is wanted (the generated response). Position ``t`` keeps its label only if
            ``response_mask[:, t + 1]``.
        ignore_index: the value of positions without a label.

    Returns:
        int64 ``[B, T]`` labels on ``input_ids``' device.

    >>> ids = torch.tensor([[0, 0, 5, 6, 7, 8]])                   # left padding, 2 tokens
    >>> causal_lm_labels(ids, attention_mask=torch.tensor([[0, 0, 1, 1, 1, 1]]),
    ...                  response_mask=torch.tensor([[0, 0, 0, 0, 1, 1]]).bool())
    tensor([[-100, -100, -100,    7,    8, -100]])
    """
    batch = ModelBatch(input_ids, attention_mask, position_ids, cu_seqlens, None, response_mask)
    return batch_labels(batch, ignore_index, capturable=False)


def _check_model_kwargs(function: str, model_kwargs: dict[str, Any]) -> None:
    """What ``**model_kwargs`` may hold: arguments of the model's backbone only. ``labels`` and
    the backbone arguments the functions set (``_RESERVED_KWARGS``) raise ``ValueError``; a
    name logitless itself knows (:data:`_LOGITLESS_NAMES`), which ``function`` does not take,
    raises ``TypeError`` as Python would, instead of reaching the backbone, which would drop it
    and return a result computed without it. Called first by every public function here."""
    if "labels" in model_kwargs:
        raise ValueError(
            "labels= is not accepted, because it would mean something else than in "
            "transformers: model(input_ids, labels=...) takes labels *unshifted* (labels[:, t] "
            "is the token at position t, and the model shifts them), while logitless aligns "
            "its targets like the logits (position t scores the next token). Pass "
            "target_ids= aligned like the logits instead: the default is "
            "causal_lm_labels(input_ids, ...); HF-style labels (-100 at the tokens not to "
            "train on) become target_ids=causal_lm_labels(labels, attention_mask=...)."
        )
    reserved = sorted(_RESERVED_KWARGS.intersection(model_kwargs))
    if reserved:
        raise ValueError(
            f"model_kwargs must not set {', '.join(reserved)}: these are set by logitless or "
            "would change which hidden states the backbone returns"
        )
    for name in model_kwargs:
        if name in _LOGITLESS_NAMES:
            raise _not_an_option_here(function, name)


def _not_an_option_here(function: str, name: str) -> TypeError:
    owners = _LOGITLESS_NAMES[name]
    shown = ", ".join(owners[:3]) + (f" and {len(owners) - 3} more" if len(owners) > 3 else "")
    hint = ""
    if "logitless.PolicyLossConfig" in owners and function == "causal_lm_policy_loss":
        hint = f" Set it on the loss's config: config=PolicyLossConfig({name}=...)."
    elif name == "distill_beta" and function == "causal_lm_divergence":
        hint = " This function's own interpolation is beta= (TRL's convention)."
    elif name.startswith("teacher_") and function == "causal_lm_divergence":
        hint = " The teacher's head and its transform come from the teacher model itself."
    return TypeError(
        f"{function}() got an unexpected keyword argument {name!r}: it is an argument of "
        f"{shown}, not of {function}, and **model_kwargs only go to the model's backbone "
        f"(which would silently drop it).{hint}"
    )


def causal_lm_hidden_states(
    model: nn.Module,
    input_ids: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    **model_kwargs: Any,
) -> torch.Tensor:
    """Final hidden states ``[B, T, H]`` of a supported causal LM (after the final norm).

    Runs ``model.model(input_ids, attention_mask=..., position_ids=..., use_cache=False,
    **model_kwargs).last_hidden_state``: what ``model(...)`` feeds to ``lm_head``.
    ``model_kwargs`` go to the backbone (e.g. flash-attention varlen arguments); a logitless
    option name raises ``TypeError``, as in :func:`causal_lm_logprobs`.

    >>> import transformers
    >>> cfg = transformers.LlamaConfig(vocab_size=100, hidden_size=16, intermediate_size=32,
    ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    >>> causal_lm_hidden_states(transformers.LlamaForCausalLM(cfg), torch.ones(2, 5).long()).shape
    torch.Size([2, 5, 16])
    """
    _check_model_kwargs("causal_lm_hidden_states", model_kwargs)
    input_ids = check_input_ids(input_ids)
    if attention_mask is not None:
        check_like_ids("attention_mask", attention_mask, input_ids, MASK_DTYPES)
    if position_ids is not None:
        check_position_ids(position_ids, input_ids)
    inputs = BackboneInputs(input_ids, attention_mask, position_ids, model_kwargs)
    return run_in_forward(model, lambda lm: run_backbone(lm, inputs).hidden)


@given_arguments
def causal_lm_logprobs(
    given: Mapping[str, Any],
    /,
    model: nn.Module,
    input_ids: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    target_ids: torch.Tensor | None = None,
    response_mask: torch.Tensor | None = None,
    with_entropy: bool = False,
    temperature: float | torch.Tensor = 1.0,
    chunk_size: int | None = None,
    head_dtype: torch.dtype | None = None,
    ignore_index: int = IGNORE_INDEX,
    backend: Backend = "auto",
    sampling_mask: SamplingMask | torch.Tensor | None = None,
    top_k: int | torch.Tensor | None = None,
    top_p: float | torch.Tensor | None = None,
    min_p: float | torch.Tensor | None = None,
    with_kept_mass: bool = False,
    capturable: bool = False,
    row_capacity: int | None = None,
    batch_invariant: bool = False,
    rollout_topk: RolloutTopK | None = None,
    **model_kwargs: Any,
) -> LogProbs:
    """Per-token log-probs (and entropy) of a transformers causal LM, without its logits.

    Computes what this computes, without the ``[B, T, V]`` logits and only at labelled
    positions::

        logits = model(input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       use_cache=False).logits.float() / temperature
        logp = logits.log_softmax(-1)
        logprobs = logp.gather(-1, target_ids.clamp(min=0)[..., None])[..., 0]  # 0 if ignored
        entropy = -(logp.exp() * logp).sum(-1)                             # 0 where ignored

    (Soft-capping and logit scales are those of the model's forward; the head's matmul runs
    in the model's dtype, or ``head_dtype``, or the autocast dtype under autocast, as
    ``lm_head`` would.)

    Args:
        model: a causal LM of :data:`SUPPORTED_MODELS`, or one wrapped for training:
            ``DistributedDataParallel``, FSDP2 ``fully_shard``, a PEFT LoRA ``PeftModel``
            (see :mod:`logitless.integrations.wrappers`). Its ``forward`` is not called; the
            backbone and the head run inside the outermost wrapper's forward, so DDP's
            reducer and FSDP2's gathers and reduce-scatters work as for ``model(...)``.
        input_ids: ``[B, T]`` token ids.
        attention_mask, position_ids, cu_seqlens, response_mask: describe padding, packed
            documents and the response tokens, see :func:`causal_lm_labels`; attention_mask
            and position_ids also go to the backbone (with ``cu_seqlens``, the backbone gets
            position_ids restarting at each document).
        target_ids: ``[B, T]`` targets aligned like the logits (``target_ids[:, t]`` is
            scored by position ``t``); default :func:`causal_lm_labels`. Not named ``labels``:
            transformers' ``labels`` are unshifted, and ``labels=`` raises ``ValueError``
            saying so (``causal_lm_labels(hf_labels)`` converts them).
        with_entropy, temperature, chunk_size, head_dtype, ignore_index, backend: as in
            :func:`logitless.linear_logprobs` (temperature: float or ``[B, T]`` tensor).
        sampling_mask, top_k, top_p, min_p, with_kept_mass: sampling replay, as in
            :func:`logitless.linear_logprobs`, over the ``[B, T]`` label positions (a CSR mask
            has ``B * T + 1`` offsets, row-major; padded ids are ``[B, T, K]``): the log-probs
            of the model's logits masked to each position's kept set.
        capturable, row_capacity: as in :func:`logitless.linear_logprobs`; logitless's own
            part of the call (targets, checks, head) then reads nothing on the host. Whether
            the backbone does is the model's own (docs/capturable.md).
        batch_invariant: as in :func:`logitless.linear_logprobs`: each position's log-prob
            and entropy are the same bits whatever else the batch holds, given the same
            hidden state (docs/head.md#batch-invariance). The backbone's own invariance is
            the model's (attention and matmul kernels chosen by batch shape are not).
        rollout_topk: the rollout engine's top-k log-probs, a :class:`logitless.RolloutTopK`
            of ``[B, T, k]`` tensors aligned like the targets (position ``t``: the engine's
            distribution of the token ``target_ids[:, t]`` was sampled from); the result's
            ``mismatch`` then compares the model's distribution with the engine's at every
            labelled position, as in :func:`logitless.linear_logprobs`
            (docs/rollout-mismatch.md); :func:`logitless.losses.rollout_mismatch_metrics`
            reduces it per sequence and per batch.
        **model_kwargs: arguments of the model's backbone (``model.model``) and only of it,
            e.g. flash-attention's varlen ``cu_seq_lens_q`` / ``max_length_q``. transformers'
            backbones drop names they do not know, so a name of logitless's own that this
            function does not take (``teacher``, ``beta``, a ``PolicyLossConfig`` field, ...)
            raises ``TypeError`` instead; ``labels`` and the inputs set here raise
            ``ValueError``.

    Returns:
        :class:`logitless.LogProbs` of fp32 ``[B, T]`` tensors; 0.0 where there is no label.

    Raises:
        ValueError: unsupported model, or a bad shape, dtype, device or value, before the
            backbone runs.
        TypeError: a logitless option this function does not take, in ``**model_kwargs``.

    >>> import transformers
    >>> cfg = transformers.Qwen2Config(vocab_size=100, hidden_size=16, intermediate_size=32,
    ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    >>> model = transformers.Qwen2ForCausalLM(cfg)
    >>> ids = torch.randint(0, 100, (2, 6))
    >>> out = causal_lm_logprobs(model, ids, with_entropy=True)
    >>> out.logprobs.shape, bool((out.logprobs[:, -1] == 0).all())   # last position: no label
    (torch.Size([2, 6]), True)
    >>> out.logprobs.sum().backward()                # gradients reach every model parameter
    """
    _check_model_kwargs("causal_lm_logprobs", model_kwargs)
    batch = ModelBatch(
        input_ids, attention_mask, position_ids, cu_seqlens, target_ids, response_mask
    )
    options, sampler = HeadOptions.pick(given), SamplerOptions.pick(given)
    return run_in_forward(model, forward.logprobs_in_forward, batch, options, sampler, model_kwargs)


@given_arguments
def causal_lm_policy_loss(
    given: Mapping[str, Any],
    /,
    model: nn.Module,
    input_ids: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    config: PolicyLossConfig | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    target_ids: torch.Tensor | None = None,
    response_mask: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    rollout_logprobs: torch.Tensor | None = None,
    normalizer: LossNormalizer | None = None,
    temperature: float | torch.Tensor = 1.0,
    chunk_size: int | None = None,
    head_dtype: torch.dtype | None = None,
    ignore_index: int = IGNORE_INDEX,
    backend: Backend = "auto",
    sampling_mask: SamplingMask | torch.Tensor | None = None,
    top_k: int | torch.Tensor | None = None,
    top_p: float | torch.Tensor | None = None,
    min_p: float | torch.Tensor | None = None,
    with_kept_mass: bool = False,
    capturable: bool = False,
    row_capacity: int | None = None,
    batch_invariant: bool = False,
    router_aux_loss_coef: float | None = None,
    teacher: nn.Module | None = None,
    **model_kwargs: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """RL policy loss of a transformers causal LM: backbone, then :func:`fused_policy_loss`.

    Same ``(loss, metrics)`` and gradients for every model parameter as::

        out = causal_lm_logprobs(model, input_ids, ..., with_entropy=config.entropy_coef != 0)
        policy_loss(out.logprobs, old_logprobs, advantages, target_ids != ignore_index,
                    config=config, entropy=out.entropy, document_ids=..., ...)

    with the head's gradients taken during the forward pass (no ``[B, T, V]`` logits; see
    :func:`fused_policy_loss` for the matmul count of each backend); ``loss.backward()`` then
    runs the backbone's backward.

    Args:
        model, input_ids, attention_mask, position_ids, cu_seqlens, target_ids,
            response_mask, temperature, chunk_size, head_dtype, ignore_index, backend,
            model_kwargs: as in :func:`causal_lm_logprobs`. The loss mask is
            ``target_ids != ignore_index``.
        old_logprobs: ``[B, T]`` fp32 log-probs of the behaviour policy, aligned like the
            targets (e.g. ``causal_lm_logprobs(...)`` under ``torch.no_grad()``).
        advantages: ``[B, T]`` per token, or one per sequence: ``[B]`` when each row is one
            sequence (no ``document_ids``, ``cu_seqlens`` or ``position_ids``), else
            ``[num_documents]``, one per document id.
        document_ids: ``[B, T]`` the loss's sequences, ``0 .. D-1`` and -1 for padding (see
            :func:`logitless.policy_loss`); default: the documents of ``cu_seqlens`` /
            ``position_ids`` numbered in row-major order (for a padded batch: one per
            non-empty row), else each row. With documents, the loss sees the flat ``[B * T]``
            token stream; loss, metrics and gradients do not depend on the layout.
        config, ref_logprobs, rollout_logprobs, normalizer: as in
            :func:`logitless.policy_loss`.
        sampling_mask, top_k, top_p, min_p, with_kept_mass: sampling replay, as in
            :func:`causal_lm_logprobs` and :func:`logitless.fused_policy_loss`.
        capturable, row_capacity: as in :func:`causal_lm_logprobs`; the loss's checks as in
            :func:`logitless.policy_loss` with ``capturable=True``.
        batch_invariant: as in :func:`causal_lm_logprobs`: the log-probs inside the loss are
            those :func:`causal_lm_logprobs` gives with it, bit for bit, so the ratio on
            unchanged weights is exactly 1.0 whatever the micro-batching.
        router_aux_loss_coef: mixture-of-experts models: the weight of the router's
            load-balancing loss added to the loss (computed from the same backbone call, as
            the model's forward computes it, and reported as ``metrics["aux_loss"]``). None:
            the model's own rule, see :func:`causal_lm_router_aux_coef`.
        teacher: a teacher causal LM for the distillation term (``config.distill_coef``,
            ``config.distill_beta``; docs/distillation.md): its backbone runs without gradient
            inside its own wrapper's forward on the same inputs, and the loss gains
            ``distill_coef · D`` as in :func:`logitless.fused_policy_loss` with ``teacher=``.

    Returns:
        ``(loss, metrics)``: a 0-dim fp32 loss and a dict of detached 0-dim metrics.

    Raises:
        ValueError: unsupported model, or bad input to the head or the loss, before the
            backbone runs.

    >>> import transformers, logitless
    >>> cfg = transformers.LlamaConfig(vocab_size=100, hidden_size=16, intermediate_size=32,
    ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    >>> model = transformers.LlamaForCausalLM(cfg)
    >>> ids = torch.randint(0, 100, (2, 8))
    >>> response = torch.zeros(2, 8, dtype=torch.bool); response[:, 3:] = True
    >>> with torch.no_grad():
    ...     old = causal_lm_logprobs(model, ids, response_mask=response).logprobs
    >>> loss, metrics = causal_lm_policy_loss(model, ids, old, torch.tensor([1.0, -1.0]),
    ...     config=logitless.PolicyLossConfig(), response_mask=response)
    >>> loss.backward()
    """
    _check_model_kwargs("causal_lm_policy_loss", model_kwargs)
    entropy = isinstance(config, PolicyLossConfig) and config.entropy_coef != 0
    options = HeadOptions.pick(given).replace(with_entropy=entropy)
    batch = ModelBatch(
        input_ids, attention_mask, position_ids, cu_seqlens, target_ids, response_mask
    )
    inputs = LossInputs(
        old_logprobs, advantages, ref_logprobs=ref_logprobs, rollout_logprobs=rollout_logprobs,
        document_ids=document_ids,
    )  # fmt: skip
    if teacher is not None:
        check_model(teacher)
        with torch.no_grad():
            t_hidden, t_head = run_in_forward(
                teacher, forward.teacher_in_forward, batch, model_kwargs
            )
        inputs = inputs.replace(teacher=t_head.as_teacher(t_hidden))
    loss_options = forward.LossOptions(config, normalizer, router_aux_loss_coef)
    return run_in_forward(
        model, forward.policy_loss_in_forward, batch, options, SamplerOptions.pick(given),
        model_kwargs, inputs, loss_options,
    )  # fmt: skip


# --------------------------------------------------------------------------------------------
# distillation: the divergence between a teacher's and the student's next-token distributions


@given_arguments
def causal_lm_divergence(
    given: Mapping[str, Any],
    /,
    model: nn.Module,
    teacher: nn.Module,
    input_ids: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    target_ids: torch.Tensor | None = None,
    response_mask: torch.Tensor | None = None,
    beta: float = 0.0,
    temperature: float | torch.Tensor = 1.0,
    with_logprobs: bool = False,
    with_entropy: bool = False,
    vocab_size: int | None = None,
    chunk_size: int | None = None,
    head_dtype: torch.dtype | None = None,
    ignore_index: int = IGNORE_INDEX,
    backend: Backend = "auto",
    batch_invariant: bool = False,
    **model_kwargs: Any,
) -> Divergence:
    """Per-token divergence between a teacher causal LM and a student causal LM, without
    either model's logits: both backbones, then :func:`logitless.linear_divergence`.

    Computes, at every labelled position, what this computes with both models' logits::

        z_s = model(input_ids, ..., use_cache=False).logits.float() / temperature
        z_t = teacher(input_ids, ..., use_cache=False).logits.float() / temperature
        divergence = D_beta(softmax(z_t) ‖ softmax(z_s))     # TRL's beta convention

    (each model's own soft-capping and logit scale; see :func:`logitless.linear_divergence`
    for ``beta``). The teacher runs under ``torch.no_grad()`` inside its own wrapper's forward
    (DDP, FSDP2: its sharded head weight is gathered without a gradient); the student's
    backbone and head run inside the student wrapper's forward, as in
    :func:`causal_lm_policy_loss`. Gradients reach the student's parameters only.

    Args:
        model: the student, a causal LM of :data:`SUPPORTED_MODELS` (wrapped or not).
        teacher: the teacher, likewise; its hidden width may differ, its vocabulary must be
            the student's (or differ by padding rows: ``vocab_size``).
        input_ids, attention_mask, position_ids, cu_seqlens, target_ids, response_mask:
            as in :func:`causal_lm_logprobs`; both models get the same inputs, and the
            positions without a target are skipped (0.0).
        beta, temperature, with_logprobs, with_entropy, vocab_size, chunk_size, head_dtype,
            ignore_index, backend, batch_invariant: as in :func:`logitless.linear_divergence`
            (the student's log-probs of the targets and entropy).
        **model_kwargs: passed to both backbones; as in :func:`causal_lm_logprobs` (a
            logitless option this function does not take, e.g. ``top_k``, ``capturable``,
            ``teacher_softcap``, raises ``TypeError``).

    Returns:
        :class:`logitless.Divergence` of fp32 ``[B, T]`` tensors, 0.0 where there is no target.

    >>> import transformers
    >>> def tiny(width):
    ...     return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(vocab_size=100,
    ...         hidden_size=width, intermediate_size=32, num_hidden_layers=1,
    ...         num_attention_heads=2, num_key_value_heads=1))
    >>> student, teacher = tiny(16), tiny(32)
    >>> ids = torch.randint(0, 100, (2, 6))
    >>> out = causal_lm_divergence(student, teacher, ids, beta=0.5, with_entropy=True)
    >>> out.divergence.shape
    torch.Size([2, 6])
    >>> out.divergence.sum().backward()          # gradients reach the student's parameters
    """
    _check_model_kwargs("causal_lm_divergence", model_kwargs)
    options, div = HeadOptions.pick(given), DivergenceOptions.pick(given)
    batch = ModelBatch(
        input_ids, attention_mask, position_ids, cu_seqlens, target_ids, response_mask
    )
    check_model(teacher)
    batch.check_backbone(unwrap(teacher).model, model_kwargs)
    # the student's call, checked before either backbone runs
    prep = forward.prepare(unwrap(model).model, batch, options, SamplerOptions(), model_kwargs)
    with torch.no_grad():
        t_out = run_in_forward(teacher, forward.teacher_in_forward, batch, model_kwargs)
    args = (batch, prep, t_out, div, model_kwargs)
    return run_in_forward(model, forward.divergence_in_forward, *args)


# --------------------------------------------------------------------------------------------
# the names logitless knows: refused in **model_kwargs (see _check_model_kwargs)


def _parameter_names(obj: object) -> list[str]:
    """The keyword-passable parameter names of a public function or class (a dataclass's or a
    NamedTuple's fields; a module's constructor and ``forward``)."""
    targets: list[object] = [obj]
    if isinstance(obj, type) and issubclass(obj, nn.Module):
        targets = [obj.__init__, obj.forward]
    names = []
    for target in targets:
        try:
            parameters = inspect.signature(target).parameters.values()
        except (TypeError, ValueError):  # a builtin without a signature
            continue
        kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        names += [p.name for p in parameters if p.kind in kinds and p.name not in ("self", "cls")]
    return names


def _logitless_names() -> dict[str, tuple[str, ...]]:
    """Every parameter name of logitless's public surface -> where it is one: the callables of
    ``logitless.__all__`` (ops, modules, loss functions, their config and input types) and of
    this module's ``__all__``, and the option types every entry point builds (so an option
    added there is known here without a line more)."""
    import logitless  # the package is fully imported before any of its submodules' code runs

    sources = [(f"logitless.{n}", getattr(logitless, n)) for n in logitless.__all__]
    sources += [(f"hf.{n}", globals()[n]) for n in __all__]
    sources += [(c.__name__, c) for c in (HeadOptions, SamplerOptions, DivergenceOptions)]
    sources.sort(key=lambda source: isinstance(source[1], type))  # functions first
    owners: dict[str, list[str]] = {}
    for label, obj in sources:
        if callable(obj):
            for name in _parameter_names(obj):
                owners.setdefault(name, []).append(label)
    return {name: tuple(dict.fromkeys(labels)) for name, labels in owners.items()}


#: Parameter name -> the public functions and classes that take it. A name of logitless's own
#: in ``**model_kwargs`` raises ``TypeError`` (transformers' backbones would drop it).
_LOGITLESS_NAMES: dict[str, tuple[str, ...]] = _logitless_names()
