"""The fused forward logitless gives NeMo RL's ``GPTModel``: log-probs from the hidden states
and ``output_layer``'s shard, never the logits.

Part of :mod:`logitless.integrations.nemo_rl`. NeMo RL's ``use_fused_linear_logprobs`` path
replaces ``GPTModel.forward`` for the whole class with
``model_utils._gpt_forward_with_linear_ce_fusion`` (its ``patch_gpt_model_forward_for_linear_ce_
fusion``); logitless puts :func:`fused_forward` there. Called with
``return_logprobs_for_linear_ce_fusion=True`` inside a step that NeMo RL's config sends to
logitless (:class:`Step`, set by :mod:`~.hooks` around NeMo RL's forward step), it:

1. builds each token's next-token label from the whole sequence (:mod:`~.layout`);
2. checks the head call before the decoder runs (:meth:`logitless.integrations.megatron.batch
   .Batch.prepare`: the labels, the temperature, top-k / top-p, the vocabulary split; a
   ``ValueError`` in NeMo RL's terms on every rank of the tensor- and context-parallel groups);
3. runs NeMo RL's original ``GPTModel.forward`` with the head as ``output_layer``'s forward
   (megatron-core 0.19's ``output_processor``), so ``output_layer``'s forward pre-hooks (the
   distributed optimizer's ``overlap_param_gather``) fire, and the weight gradient goes into
   ``main_grad`` under Megatron's DDP;
4. returns next-token log-probs ``[B, S−1]`` fp32 in the unpacked layout, the same on every
   tensor- and context-parallel rank, marked as logitless's (:class:`Extras`: NeMo RL's
   temperature scaling leaves them alone, its loss preparation reads the unfiltered log-probs
   and the entropy from them).

Anything else (no step, the flag unset: NeMo RL's generation, its other post-processors) runs
NeMo RL's own function unchanged.
"""

from __future__ import annotations

import contextvars
import dataclasses
import inspect
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ...contract.options import HeadOptions, SamplerOptions
from .. import seam
from ..megatron.batch import Batch, in_output_processor
from ..megatron.model import agree, megatron_head
from .layout import Packing, next_token_labels, unpack

__all__ = [
    "NEMO",
    "STEP",
    "Extras",
    "Recorder",
    "Step",
    "fused_forward",
    "logitless_output",
    "options_of",
]

_WHERE = "NeMo RL with policy.megatron_cfg.fused_linear_logprobs_backend=logitless"


@dataclass(frozen=True)
class Step:
    """What one NeMo RL forward step asks of the head: the sampler's settings (NeMo RL's
    ``TrainingSamplingParams``), whether the unfiltered log-probs are needed too (its reference
    KL under top-k / top-p), whether the entropy is, and the micro-batch being run (for its
    unpacked width)."""

    sampling: Any
    unfiltered: bool
    entropy: bool
    batches: Recorder


class Recorder:
    """NeMo RL's micro-batch iterator, remembering the micro-batch last drawn."""

    def __init__(self, iterator: Iterator[Any]) -> None:
        self.iterator, self.current = iterator, None

    def __iter__(self) -> Recorder:
        return self

    def __next__(self) -> Any:
        self.current = next(self.iterator)
        return self.current

    def width(self) -> int | None:
        data = getattr(self.current, "data_dict", None)
        return None if data is None else int(data["input_ids"].shape[1])


STEP: contextvars.ContextVar[Step | None] = contextvars.ContextVar("logitless_step", default=None)


@dataclass(frozen=True)
class Extras:
    """What rides on the log-probs logitless hands NeMo RL (the tensor's ``logitless``
    attribute): whether they were filtered (top-k / top-p; -inf where the sampled token fell
    outside the replayed kept set, as NeMo RL's own filtered log-probs), the unfiltered
    log-probs (its reference KL), the entropy (``[B, S−1]``, differentiable)."""

    filtered: bool
    unfiltered: torch.Tensor | None = None
    entropy: torch.Tensor | None = None


def logitless_output(tensor: Any) -> Extras | None:
    """The :class:`Extras` of a tensor logitless returned, or None for any other."""
    return getattr(tensor, "logitless", None) if isinstance(tensor, torch.Tensor) else None


def options_of(sampling: Any) -> tuple[HeadOptions, SamplerOptions | None]:
    """NeMo RL's ``TrainingSamplingParams`` as logitless's options; ``ValueError`` naming the
    config key for what its logits path would turn into NaN or silently ignore."""
    t = 1.0 if sampling is None else sampling.temperature
    k = None if sampling is None else sampling.top_k
    p = 1.0 if sampling is None else sampling.top_p
    if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t <= 0:
        raise ValueError(
            f"policy.generation.temperature must be finite and > 0 (the log-probs are those of "
            f"softmax(logits / temperature)), got {t!r}"
        )
    if k is not None and (isinstance(k, bool) or not isinstance(k, int)):
        raise ValueError(f"policy.generation.top_k must be an int or null, got {k!r}")
    if p is not None and (isinstance(p, bool) or not isinstance(p, int | float) or not 0 < p <= 1):
        raise ValueError(f"policy.generation.top_p must be in (0, 1], got {p!r}")
    top_k = k if k is not None and k > 0 else None  # NeMo RL: None or <= 0 is no top-k
    top_p = p if p is not None and p != 1.0 else None
    sampler = None if top_k is None and top_p is None else SamplerOptions(top_k=top_k, top_p=top_p)
    return HeadOptions(temperature=float(t)), sampler


#: NeMo RL's own fused forward, ``{"forward": ...}`` (set by :func:`~.hooks.install`).
NEMO: dict[str, Callable[..., Any]] = {}


def fused_forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``GPTModel.forward`` under NeMo RL's fused-linear-logprobs patch (see the module)."""
    step = STEP.get()
    if step is None or not kwargs.get("return_logprobs_for_linear_ce_fusion", False):
        return NEMO["forward"](self, *args, **kwargs)
    bound = inspect.signature(NEMO["forward"]).bind(self, *args, **kwargs)
    call = dict(bound.arguments)
    call.pop("self")
    call.pop("return_logprobs_for_linear_ce_fusion")
    call.pop("labels", None)
    call.update(call.pop("kwargs", {}))
    original = self._original_forward_for_linear_ce_fusion
    if not self.post_process:  # a stage without the head: its hidden states
        return original(**call)
    return _head(self, step, original, call)


def _head(model, step: Step, original: Callable[..., Any], call: dict[str, Any]) -> torch.Tensor:
    """The log-probs of one micro-batch through logitless (steps 1-4 of the module)."""
    head = megatron_head(model)
    cp_group = head.parallel.context_group
    params = call.get("packed_seq_params")
    ids = call["input_ids"]
    packing = None
    if params is not None:
        packing = Packing(params, head.cp_rank, head.cp_size, ids.device)
    error = None
    try:
        options, sampler = options_of(step.sampling)
        _check_ids(ids, model.output_layer.output_size_per_partition * head.tp_size)
    except ValueError as e:
        error = e
    agree(head, error, _WHERE)
    labels = next_token_labels(ids, packing, cp_group)
    inputs = (ids, call.pop("position_ids", None), call.pop("attention_mask", None))
    call.pop("input_ids")
    batch = Batch.read(model, inputs, labels, None, call.pop("packed_seq_params", None), call)
    options = dataclasses.replace(options, with_entropy=step.entropy)
    prepared = (batch.prepare(options, None, sampler=sampler),)
    if sampler is not None and step.unfiltered:
        plain = dataclasses.replace(options, with_entropy=False)
        prepared += (batch.prepare(plain, None),)
    if "output_processor" in inspect.signature(original).parameters:
        batch.kwargs["output_processor"] = in_output_processor
    results = batch.run(
        lambda tokens, w: [seam.logprobs(p, tokens, w) for p in prepared],
        lambda: original(*batch.args, **batch.kwargs),
    )
    return _output(results, sampler is not None, packing, cp_group, step.batches.width())


def _check_ids(ids: torch.Tensor, vocab: int) -> None:
    """The rollout's token ids (NeMo RL hands them as the labels) in ``[0, vocab)``: one host
    read."""
    if ids.numel() == 0:
        return
    low, high = (int(v) for v in torch.stack([ids.min(), ids.max()]).tolist())
    if low < 0 or high >= vocab:
        raise ValueError(
            f"input_ids (the rollout's token ids, NeMo RL's labels for the fused path) must be "
            f"in [0, {vocab}) (the output layer's vocabulary), got ids in [{low}, {high}]"
        )


def _output(results, filtered: bool, packing, cp_group, width) -> torch.Tensor:
    """NeMo RL's ``[B, S−1]`` log-probs (and extras) from the head's results."""
    first = results[0]
    logp = first.logprobs
    if filtered:  # NeMo RL's filtered log-prob of a token outside the kept set is -inf
        logp = torch.where(first.label_added, float("-inf"), logp)
    out = unpack(logp, packing, cp_group, width)
    entropy = None
    if first.entropy is not None:
        entropy = unpack(first.entropy, packing, cp_group, width)
    unfiltered = unpack(results[1].logprobs, packing, cp_group, width) if len(results) > 1 else None
    out.logitless = Extras(filtered, unfiltered, entropy)
    return out
