"""What logitless reads of a megatron-core ``GPTModel``: its head, its groups, its weight.

Package-internal (:mod:`logitless.integrations.megatron` re-exports :class:`MegatronHead` and
:func:`megatron_head`). :func:`megatron_head` reads a model (or one of Megatron's wrappers
around it, or the arguments an ``output_processor`` gets: :class:`ProcessorStage`) into a
:class:`MegatronHead`: the module to call, the ``GPTModel``, the seam's
:class:`~logitless.integrations.seam.Parallelism` (its vocabulary split built once per output
layer, sequence parallelism, the context-parallel group), and whether the head can run
without logits (multi-token prediction, a gathered output layer and a stage without the head
are refused). :func:`agree` is the fail-together rule over the tensor- and context-parallel
groups; :func:`head_weight`, :func:`logit_scale` and :func:`check_hidden` say what the head
gets and check it.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...contract.collectives import exchange, other_rank_failed
from ...contract.vocab import VocabParallel
from ..seam import ContextParallel, Parallelism, SequenceParallel

__all__ = [
    "MegatronHead",
    "ProcessorStage",
    "agree",
    "check_hidden",
    "check_weight",
    "gpt_model",
    "head_weight",
    "logit_scale",
    "megatron_head",
    "stage",
    "takes_output_processor",
]


@dataclass(frozen=True)
class MegatronHead:
    """What logitless reads from a ``GPTModel`` (see :func:`megatron_head`).

    outer: the module to call (the model as given: Megatron's DDP or ``Float16Module`` around
    it, or the model). model: the ``GPTModel``. parallel: the vocabulary group (Megatron's
    tensor-parallel group), sequence parallelism, the context-parallel group. tp_size,
    cp_rank, cp_size: the group sizes and this rank's place.
    """

    outer: nn.Module
    model: nn.Module
    parallel: Parallelism
    tp_size: int
    cp_rank: int
    cp_size: int

    @property
    def groups(self) -> list[Any]:
        """The groups whose ranks must fail together (tensor-, then context-parallel)."""
        return [
            g
            for g, size in (
                (self.model.tp_group, self.tp_size),
                (self.model.cp_group, self.cp_size),
            )
            if size > 1
        ]


_VOCAB: weakref.WeakKeyDictionary[nn.Module, VocabParallel] = weakref.WeakKeyDictionary()


def megatron_head(model: nn.Module) -> MegatronHead:
    """Read the head of a ``GPTModel`` (or a Megatron wrapper around one: its DDP,
    ``Float16Module``): its groups, and whether it can be run without logits.

    The first call for a model builds its :class:`~logitless.VocabParallel` (a collective call
    over the tensor-parallel group: every rank makes it); later calls reuse it.
    """
    outer, inner = model, model if isinstance(model, ProcessorStage) else gpt_model(model)
    if inner is None:
        raise ValueError(
            f"model must be a megatron.core GPTModel (or a Megatron DDP / Float16Module around "
            f"one), got {type(model).__name__}"
        )
    config = inner.config
    if getattr(inner, "mtp_process", False) or config.mtp_num_layers:
        raise ValueError(
            f"multi-token prediction (mtp_num_layers={config.mtp_num_layers}) is not supported: "
            "GPTModel computes the MTP heads' losses from their logits inside its forward; "
            "build the model without mtp_block_spec / mtp_num_layers"
        )
    if not inner.post_process:
        raise ValueError(
            "the head runs on the last pipeline stage (post_process=True); this stage has no "
            "output_layer. In forward_step, return the model's output on the other stages"
        )
    layer = inner.output_layer
    if layer.gather_output:
        raise ValueError(
            "output_layer gathers its output (GPTModel(parallel_output=False)): build the "
            "model with parallel_output=True, the vocabulary split over the tensor-parallel "
            "group"
        )
    tp_group = layer.tp_group
    rows = layer.output_size_per_partition
    vp = None
    if tp_group.size() > 1:
        vp = _VOCAB.get(layer)
        if vp is None or vp.group is not tp_group:
            rank = tp_group.rank()
            size = tp_group.size()
            vp = VocabParallel(tp_group, rank * rows, (rank + 1) * rows, vocab_size=rows * size)
            _VOCAB[layer] = vp
    return stage(outer, inner, tp_group, layer.sequence_parallel, vp)


def stage(outer, inner, tp_group, sequence_parallel: bool, vp) -> MegatronHead:
    """A pipeline stage's groups as a :class:`MegatronHead` (``vp``: the vocabulary split of
    its head; None on a stage without one)."""
    tp_size = tp_group.size()
    sp = SequenceParallel(tp_group, dim=0) if sequence_parallel and tp_size > 1 else None
    cp_group = inner.cp_group
    cp_size = cp_group.size() if cp_group is not None else 1
    cp = ContextParallel(cp_group, "zigzag") if cp_size > 1 else None
    return MegatronHead(
        outer=outer,
        model=inner,
        parallel=Parallelism(vocab=vp, sequence=sp, context=cp),
        tp_size=tp_size,
        cp_rank=cp_group.rank() if cp_size > 1 else 0,
        cp_size=cp_size,
    )


def gpt_model(model: nn.Module) -> nn.Module | None:
    """The GPTModel inside Megatron's wrappers (DDP, Float16Module: ``.module``), or None."""
    from megatron.core.models.gpt import GPTModel

    inner = model
    while not isinstance(inner, GPTModel) and isinstance(getattr(inner, "module", None), nn.Module):
        inner = inner.module
    return inner if isinstance(inner, GPTModel) else None


def agree(head: MegatronHead, error: ValueError | None, what: str) -> None:
    """Raise ``error`` here and a ``ValueError`` on every other rank of the tensor- and
    context-parallel groups when any of them had one (two exchanges reach the whole grid)."""
    failed = error is not None
    for group in head.groups:
        failed, _ = exchange(group, failed, [])
    if error is not None:
        raise error
    if failed:
        raise other_rank_failed(what, "the tensor- or context-parallel group")


@dataclass(frozen=True)
class ProcessorStage:
    """What :func:`megatron_head` reads of a ``GPTModel``, from the arguments
    ``GPTModel.forward`` hands an ``output_processor`` (the model itself is not among them)."""

    output_layer: nn.Module
    config: Any
    tp_group: Any
    cp_group: Any
    post_process: bool = True
    mtp_process: bool = False
    share_embeddings_and_output_weights: bool = False


@functools.cache
def takes_output_processor(model_class: type) -> bool:
    """Whether ``GPTModel.forward`` takes an ``output_processor`` (megatron-core 0.19 and
    later): the seam Megatron offers for what follows the decoder. Where it does, the head
    runs from it; elsewhere ``GPTModel`` calls ``output_layer`` itself. Either way the head
    runs *as* ``output_layer``'s forward, so that module's hooks fire."""
    return "output_processor" in inspect.signature(model_class.forward).parameters


def logit_scale(model: nn.Module) -> float | None:
    """The factor ``GPTModel`` multiplies its logits by: MuP's ``mup_output_mult`` where the
    config has ``use_mup`` (megatron-core 0.19+, ``LanguageModule._scale_logits``), else none."""
    config = model.config
    if getattr(config, "use_mup", False) and config.mup_output_mult != 1.0:
        return float(config.mup_output_mult)
    return None


def check_hidden(head: MegatronHead, hidden, weight, labels) -> None:
    if hidden.dim() != 3:
        raise ValueError(
            f"the decoder's hidden states must be [S, B, H], got {tuple(hidden.shape)}"
        )
    s_local, b, h = hidden.shape
    s = s_local * (head.tp_size if head.parallel.sequence is not None else 1)
    if (b, s) != tuple(labels.shape):
        sp = " (sequence_parallel: [S/tp, B, H] on each rank)" if head.parallel.sequence else ""
        raise ValueError(
            f"labels must be [batch, seq_length] = [{b}, {s}] to match the decoder's hidden "
            f"states {list(hidden.shape)}{sp}, got {list(labels.shape)}"
        )
    check_weight(head, weight, h)


def check_weight(head: MegatronHead, weight: torch.Tensor, hidden_size: int) -> None:
    """``weight`` is this tensor-parallel rank's ``[V/tp, hidden_size]`` rows of the head."""
    rows = head.model.output_layer.output_size_per_partition
    if weight.dim() != 2 or tuple(weight.shape) != (rows, hidden_size):
        raise ValueError(
            f"output_layer's weight must be this tensor-parallel rank's [vocab_size / "
            f"tensor_model_parallel_size, hidden_size] = [{rows}, {hidden_size}] rows "
            f"(tensor_model_parallel_size={head.tp_size}), got {list(weight.shape)}"
        )


def head_weight(head: MegatronHead) -> torch.Tensor:
    """The weight ``GPTModel`` hands ``output_layer``: the input embedding's shard when the
    two are shared on this stage, else ``output_layer.weight``."""
    model = head.model
    if model.share_embeddings_and_output_weights:
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight
