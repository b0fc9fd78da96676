"""Fast-LLM's language-model head with its logits replaced by logitless.

Part of :mod:`logitless.integrations.fast_llm`. :class:`LogitlessHead` is Fast-LLM's
``LanguageModelHead`` (its final norm, its output weight, its loss layers, its loss
registration, its multi-token-prediction plumbing) with the one method that builds the logits
and hands them to the losses, ``_logits_loss_forward_backward``, done from the hidden states
and the weight instead. Fast-LLM's head computes its gradients inside its forward (the loss's
``grad_output`` is known then); so does this one: each loss's backward runs at once, the hidden
gradient is returned to Fast-LLM's final norm, and the weight gradient is added into the
weight's ``grad_buffer`` as Fast-LLM's own linear backward adds it.

**Before the backbone.** Fast-LLM calls each layer's ``preprocess(kwargs)`` when the batch is
prepared, before the model's forward; the head's checks every loss's inputs there
(:func:`seam.prepare`: label range, per-token inputs, options; on every rank of the
tensor-parallel group together) and keeps the checked calls in ``kwargs``.

**Parallelism.** Fast-LLM's tensor-parallel group is a standalone gloo/NCCL backend (built over
its store, without ``init_process_group``); it is the vocabulary group of a
:class:`~logitless.VocabParallel` over the ranks' even shards ``[r·V/tp, (r+1)·V/tp)``. The
hidden gradient is left unsummed by logitless and reduced with Fast-LLM's own ops, as its
``output_parallel_linear_backward`` does: all-reduced, or reduce-scattered under sequence
parallelism, where the hidden states are first gathered with Fast-LLM's ``gather_op``.
Sequence parallelism without a vocabulary split (``vocab_parallel: false``): each rank scores its
own tokens with the whole weight, as Fast-LLM's head does.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import torch
from fast_llm.core.ops import gather_op, reduce_op, reduce_scatter_op
from fast_llm.layers.block.config import BlockKwargs
from fast_llm.layers.language_model.config import LanguageModelHeadConfig
from fast_llm.layers.language_model.head import LanguageModelHead
from fast_llm.layers.language_model.multi_token_prediction import MultiTokenPrediction
from fast_llm.tensor import accumulate_gradient, param_get_and_unset_is_zero

from ...contract.options import HeadOptions, WeightGradInto
from ...contract.vocab import VocabParallel
from ...transform import compute_dtype
from .. import seam
from .losses import HeadParts, TeacherOutput, kind_of, prepare_loss, run_loss

__all__ = ["LogitlessHead", "LogitlessMultiTokenPrediction"]

_PREPARED = "logitless_prepared"  # kwargs[_PREPARED][head name]: the checked calls

# Fast-LLM's configurable classes name their config class as the bound of a type parameter
# called ConfigType (PEP 695 there; a TypeVar here, for Python 3.11's parser). Its config is
# LogitlessHeadConfig (.config), which imports this module to build the head.
ConfigType = TypeVar("ConfigType", bound=LanguageModelHeadConfig)


class LogitlessHead(LanguageModelHead[ConfigType]):
    """Fast-LLM's ``LanguageModelHead`` whose losses never see logits (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # logitless tiles the vocabulary from its own memory budget: the losses read the
        # whole micro-batch (cross_entropy_splits changes nothing but Fast-LLM's chunking).
        for loss in self.losses:
            loss._num_splits = 1
            _check_documents(loss)
        self._vp: VocabParallel | None = None

    # --- phase 1: before the backbone ---------------------------------------------------

    def preprocess(self, kwargs: dict[str, Any]) -> None:
        super().preprocess(kwargs)
        if self.output_weights.device.type == "meta":
            return  # a pipeline stage that does not hold the head: its own rank checks
        if self.training and BlockKwargs.grad_output in kwargs:
            kwargs.setdefault(_PREPARED, {})[self.module_name] = self._prepare(kwargs)

    def _prepare(self, kwargs: dict[str, Any]) -> list:
        parts = self._parts(self.output_weights)
        register = True  # Fast-LLM passes a losses dict to every training step
        return [prepare_loss(loss, parts, kwargs, register) for loss in self.losses]

    def _parts(self, weight: torch.Tensor) -> HeadParts:
        """The head as :func:`~.losses.prepare_loss` needs it. The fused losses add the
        weight's gradient straight into Fast-LLM's ``grad_buffer`` when it has the head's
        compute dtype (``WeightGradInto``); else, and for the divergence, it reaches the
        weight's stand-in through autograd and is added by Fast-LLM's ``accumulate_gradient``."""
        buffer = getattr(weight, "grad_buffer", None)
        into = None
        if (
            weight.requires_grad
            and buffer is not None
            and buffer.dtype == compute_dtype(weight.dtype)
            and buffer.shape == weight.shape
        ):
            into = WeightGradInto(buffer)
        options = HeadOptions(head_dtype=weight.dtype, weight_grad_into=into)
        softcap = self._config.final_logit_softcap
        return HeadParts(weight.detach(), softcap, options, self._parallelism(), self._gather)

    def _parallelism(self) -> seam.Parallelism:
        if not self._vocab_parallel:
            return seam.Parallelism()
        if self._vp is None:  # a collective of the group, once
            group = self._parallel_dim.group
            rows = self.output_weights.shape[0]
            rank = group.rank()
            self._vp = VocabParallel(
                group, rank * rows, (rank + 1) * rows, reduce_hidden_grad=False
            )
        return seam.Parallelism(vocab=self._vp)

    @property
    def _gathers(self) -> int:
        """How many sequence shards the head gathers (vocabulary and sequence parallel)."""
        return self._parallel_dim.size if self._sequence_parallel and self._vocab_parallel else 1

    # --- phase 2: the head, after the backbone ------------------------------------------

    def _logits_loss_forward_backward(
        self, input_: torch.Tensor, kwargs: dict, losses: dict | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if not self.training:
            if self._hands_hidden_states(input_, kwargs):
                return None, None
            return super()._logits_loss_forward_backward(input_, kwargs, losses)
        prepared = kwargs.get(_PREPARED, {}).get(self.module_name)
        if prepared is None:  # a caller that skipped preprocess: checked here instead
            prepared = self._prepare(kwargs)
        input_ = input_.flatten(0, -2)
        hidden = self._gather(input_)
        leaf = hidden.detach().requires_grad_(self.training)
        weight = self._weight_leaf()
        total = None
        for loss, call in zip(self.losses, prepared, strict=True):
            with torch.enable_grad():  # Fast-LLM runs its stages without autograd
                tokens = call.tokens(leaf)
            head = dataclasses.replace(call.head, weight=weight)
            value = run_loss(loss, call, tokens, head, kwargs, losses)
            total = value if total is None else total + value
        self._weight_done(weight)
        if self._sequence_parallel_logits:
            reduce_op(total, group=self._parallel_dim.group)
        if losses is not None:
            losses[self._total_loss_name].append(total.detach())
        return total, self._hidden_grad(leaf, input_)

    def _gather(self, input_: torch.Tensor) -> torch.Tensor:
        """The hidden states of every token the head scores: this rank's, or under vocabulary
        and sequence parallelism the group's sequence shards gathered (Fast-LLM's
        ``gather_op``, as its ``output_parallel_linear_forward``)."""
        if self._gathers == 1:
            return input_
        return gather_op(input_, self._parallel_dim.group, dim=0)

    def _hidden_grad(self, leaf: torch.Tensor, input_: torch.Tensor) -> torch.Tensor | None:
        """The gradient of this rank's hidden states, reduced over the vocabulary group as
        Fast-LLM's ``output_parallel_linear_backward`` reduces it."""
        grad = leaf.grad
        if grad is None:
            return None
        if self._vocab_parallel:
            group = self._parallel_dim.group
            grad = reduce_scatter_op(grad, group) if self._gathers > 1 else reduce_op(grad, group)
        return grad.to(input_.dtype)

    def _weight_leaf(self) -> torch.Tensor:
        """The weight as the losses see it (a leaf: a gradient that does not go straight into
        the buffer lands on it). A buffer Fast-LLM marks as holding no gradient yet is zeroed
        first, so every loss adds into it."""
        param = self.output_weights
        if not param.requires_grad:
            return param.detach()
        if getattr(param, "grad_buffer", None) is not None and param_get_and_unset_is_zero(param):
            param.grad_buffer.zero_()
        return param.detach().requires_grad_()

    def _weight_done(self, weight: torch.Tensor) -> None:
        if weight.grad is not None:
            accumulate_gradient(self.output_weights, weight.grad)

    # --- as a distillation teacher ------------------------------------------------------

    def _hands_hidden_states(self, input_: torch.Tensor, kwargs: dict) -> bool:
        """As a logitless student's teacher (``teacher_hidden_states``), store the final
        hidden states and the weight where Fast-LLM stores the logits it was asked for."""
        name = f"{self.module_name}.logits"
        patterns = kwargs.get(BlockKwargs.output_hidden_states) or ()
        hands = getattr(self._config, "teacher_hidden_states", False)  # LogitlessHeadConfig's
        if not hands or not any(p.match(name) for p in patterns):
            return False
        out = TeacherOutput(
            input_.detach().flatten(0, -2), self.output_weights.detach(),
            self._config.final_logit_softcap,
        )  # fmt: skip
        kwargs[BlockKwargs.hidden_states][name] = (None, out)
        return True


def _check_documents(loss) -> None:
    """GSPO's documents must be whole on each rank: Fast-LLM all-reduces their sums over its
    sequence-data and sequence-parallel groups, which logitless's context-parallel statistics
    cannot take (they need a ``torch.distributed`` process group; Fast-LLM's are standalone)."""
    if kind_of(loss) != "gspo":
        return
    if loss._sequence_data_active:
        raise ValueError(
            f"head.losses.{loss.name} (gspo) with head type logitless needs "
            "distributed.sequence_data_parallel=1 (a document's ratio would need sums across "
            f"the sequence-data ranks), got {loss._sequence_data_dim.size}"
        )
    if loss._sequence_parallel:
        raise ValueError(
            f"head.losses.{loss.name} (gspo) with head type logitless and "
            "distributed.sequence_tensor_parallel=true needs embeddings.vocab_parallel=true "
            "(each rank would score part of a document), got vocab_parallel=false"
        )


class LogitlessMultiTokenPrediction(MultiTokenPrediction[ConfigType]):
    """Fast-LLM's multi-token prediction with its heads (distance 2, 3, ...) logitless heads,
    prepared with the main head's ``preprocess``."""

    def __init__(self, config, distributed_config, embeddings_config, **kwargs: Any) -> None:
        super().__init__(config, distributed_config, embeddings_config, **kwargs)
        if not self._enabled:
            return
        self.heads = torch.nn.ModuleList(
            [
                LogitlessHead(
                    config,
                    distributed_config,
                    embeddings_config,
                    hidden_dim=kwargs["hidden_dim"],
                    lr_scale=kwargs["lr_scale"],
                    peft=kwargs["peft"],
                    prediction_distance=distance,
                )  # fmt: skip
                for distance in range(2, config.prediction_heads + 1)
            ]
        )

    def preprocess(self, kwargs: dict[str, Any]) -> None:
        super().preprocess(kwargs)
        for head in self.heads:
            head.preprocess(kwargs)
