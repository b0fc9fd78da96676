"""One Megatron micro-batch as every entry point runs it: read, prepared, run as
``output_layer``'s forward.

Part of :mod:`logitless.integrations.megatron`. :meth:`Batch.read` reads the model's head and
the batch's layout once (:func:`~logitless.integrations.megatron.layout.token_layout`);
:meth:`Batch.prepare` checks the head call before the model runs (the seam's first phase,
:func:`logitless.integrations.seam.prepare`, on every rank of the tensor- and
context-parallel groups together); :meth:`Batch.run` runs the model's own forward and, where
it calls ``output_layer(hidden_states, weight=...)``, runs the head instead
(:func:`logitless.integrations.seam.run_head`): ``output_layer``'s forward pre-hooks (the
distributed optimizer's ``overlap_param_gather``) fire as they would for the logits. From
megatron-core 0.19 that call is made from the ``output_processor`` handed to
``GPTModel.forward`` (:func:`in_output_processor`), so nothing of the logits path runs after it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...contract.options import IGNORE_INDEX, HeadOptions, SamplerOptions
from .. import seam
from ..seam import Head, Prepared, Tokens
from .gradients import with_grad_into
from .layout import token_layout
from .model import (
    MegatronHead,
    agree,
    check_hidden,
    check_weight,
    head_weight,
    logit_scale,
    megatron_head,
    takes_output_processor,
)

__all__ = ["Batch", "in_output_processor"]

_WHERE = "logitless.integrations.megatron"


@dataclass(frozen=True)
class Batch:
    """One micro-batch, checked: the model's head, the arguments of ``GPTModel.forward``, the
    labels masked to the tokens trained on (``target``) and the layout :func:`token_layout`
    read (``mask``, ``document_ids``)."""

    head: MegatronHead
    args: tuple
    kwargs: dict[str, Any]
    target: torch.Tensor
    mask: torch.Tensor
    document_ids: torch.Tensor | None

    @classmethod
    def read(cls, model, inputs: tuple, labels, loss_mask, packed_seq_params, model_kwargs):
        """``inputs``: ``(input_ids, position_ids, attention_mask)``; the rest as
        ``GPTModel.forward`` and :func:`token_layout` take them."""
        head = megatron_head(model)
        input_ids = inputs[0] if inputs else None
        mask, doc = token_layout(head, labels, loss_mask, packed_seq_params, input_ids=input_ids)
        for name in ("labels", "runtime_gather_output", "output_processor"):
            if name in model_kwargs:
                raise TypeError(f"{name}= is logitless's to set, not a model argument here")
        kwargs = {"packed_seq_params": packed_seq_params, **model_kwargs}
        return cls(head, tuple(inputs), kwargs, torch.where(mask, labels, IGNORE_INDEX), mask, doc)

    @classmethod
    def of(cls, given: Mapping[str, Any]) -> Batch:
        """:meth:`read` of an entry point's arguments by name (``model``, ``input_ids``,
        ``position_ids``, ``attention_mask``, ``labels``, ``loss_mask``, ``packed_seq_params``,
        ``model_kwargs``: the signature every Megatron entry point shares)."""
        inputs = (given["input_ids"], given["position_ids"], given["attention_mask"])
        return cls.read(
            given["model"], inputs, given["labels"], given["loss_mask"],
            given["packed_seq_params"], given["model_kwargs"],
        )  # fmt: skip

    def prepare(
        self,
        options: HeadOptions,
        fusion: bool | None = False,
        *,
        shared: bool = False,
        weight: torch.Tensor | None = None,
        sampler: SamplerOptions | None = None,
    ) -> Prepared:
        """The head call checked before the model runs (labels, temperature, chunk size,
        dtypes, the vocabulary split), with the weight gradient's destination under
        gradient-accumulation ``fusion`` (:func:`~.gradients.with_grad_into`; ``shared``:
        the weight gets another gradient too). ``weight``: the weight the model will hand
        ``output_layer`` when it is not its own (an ``output_processor``'s tied weight).
        ``sampler``: the call's sampler options (the rollout sampler's kept sets to replay,
        top-k / top-p; the rollout engine's top-k for the diagnostics), or None.
        Raises ``ValueError`` on every rank of the tensor- and context-parallel groups."""
        head = self.head
        weight = head_weight(head) if weight is None else weight
        error = None
        try:  # in Megatron's terms first (the vocabulary split's own check is collective)
            check_weight(head, weight, head.model.config.hidden_size)
        except ValueError as e:
            error = e
        agree(head, error, _WHERE)
        options = with_grad_into(head, fusion, options, shared=shared)
        prepared = None
        try:
            stand_in = Head(weight, head.model.output_layer.bias, logit_scale(head.model))
            prepared = seam.prepare(self.target, stand_in, options, sampler, parallel=head.parallel)
        except ValueError as e:
            error = e
        agree(head, error, _WHERE)
        return prepared

    def run(self, fn: Callable[[Tokens, Head], Any], call: Callable[[], Any] | None = None):
        """Run the model (or ``call``); where it calls ``output_layer``, run
        ``fn(tokens, head)`` instead and return its result."""
        head, labels = self.head, self.target
        layer = head.model.output_layer

        def in_output_layer(hidden, weight=None, runtime_gather_output=None, **_):
            error = None
            w = layer.weight if weight is None else weight
            try:
                check_hidden(head, hidden, w, labels)
            except ValueError as e:
                error = e
            agree(head, error, _WHERE)
            tokens = Tokens(hidden, labels, sequence_first=True)
            out = fn(tokens, Head(w, layer.bias, logit_scale(head.model)))
            # What GPTModel receives as its logits: it only transposes them; never read.
            result.append(out)
            return hidden.new_zeros(hidden.shape[0], hidden.shape[1], 0), None

        if call is None:
            kwargs = self.kwargs
            if takes_output_processor(type(head.model)):
                kwargs = {**kwargs, "output_processor": in_output_processor}
            call = lambda: head.outer(*self.args, **kwargs)  # noqa: E731
        result: list[Any] = []
        seam.run_head(layer, in_output_layer, reach=call, caller="GPTModel.forward")
        return result[-1]

    def teacher(self, teacher: nn.Module) -> tuple[Tokens, Head]:
        """The teacher GPTModel's hidden states and head on this batch, from its own forward,
        without gradient: ``(Tokens, Head)`` in its layout."""
        t_head = megatron_head(teacher)
        head = self.head
        if t_head.tp_size != head.tp_size or t_head.cp_size != head.cp_size:
            raise ValueError(
                "the teacher must have the student's tensor_model_parallel_size and "
                f"context_parallel_size, got {t_head.tp_size}/{t_head.cp_size} vs "
                f"{head.tp_size}/{head.cp_size}"
            )
        with torch.no_grad():
            return dataclasses.replace(self, head=t_head).run(lambda t, w: (t, w))


def in_output_processor(*, hidden_states, output_layer, output_weight=None,
                        runtime_gather_output=None, **_: Any) -> torch.Tensor:  # fmt: skip
    """The ``output_processor`` logitless hands ``GPTModel.forward``: it calls
    ``output_layer`` (whose forward :meth:`Batch.run` has replaced for the call) and returns
    its placeholder, so nothing of Megatron's logits path (MuP scaling of the logits, the
    language-model loss) runs after it."""
    out, _ = output_layer(
        hidden_states, weight=output_weight, runtime_gather_output=runtime_gather_output
    )
    return out
