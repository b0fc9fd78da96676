"""megatron-core: the head of a ``GPTModel`` without its logits.

For the last pipeline stage of a megatron-core ``GPTModel`` (tested with 0.16 and 0.19), per-token
log-probs, entropy, the fused policy loss and the divergence to a teacher ``GPTModel``, from
the decoder's final hidden states and ``output_layer``'s weight shard; the ``[S, B, V/tp]``
logits never exist. The model runs its own forward (embedding, decoder, final norm) and, where
it would call ``output_layer(hidden_states, weight=...)``, the head runs *as* that call
(:func:`logitless.integrations.seam.run_as_forward`): ``output_layer``'s forward pre-hooks
(the distributed optimizer's ``overlap_param_gather``) fire as they would for the logits. From
megatron-core 0.19 that call is made from the ``output_processor`` logitless hands
``GPTModel.forward``, so nothing of the logits path runs after it.

What the model hands the head, in Megatron's terms (DESIGN.md, "Integrations: one seam"):

- hidden states sequence-first ``[S, B, H]``; with ``sequence_parallel`` each
  tensor-parallel rank holds ``[S/tp, B, H]``: gathered along S inside the head, their gradient
  reduce-scattered back;
- ``output_layer``'s weight, this rank's ``[V/tp, H]`` rows (a ``ColumnParallelLinear`` with
  ``gather_output=False``), or the input embedding's shard when
  ``share_embeddings_and_output_weights``; the vocabulary is split over the tensor-parallel
  group (:class:`logitless.VocabParallel`);
- labels and ``loss_mask`` batch-first ``[B, S]``, as ``GPTModel.forward(labels=...)`` takes
  them (already next-token aligned; position ``s`` is scored on ``labels[:, s]``); outputs
  come back ``[B, S]``, 0 where the mask is 0;
- packed sequences: ``packed_seq_params`` (``qkv_format="thd"``, ``B = 1``) with
  ``cu_seqlens_q`` and the per-sequence padded ``cu_seqlens_q_padded``: padding tokens are
  never scored and each document gets its own id for the loss;
- context parallelism: each document's padded tokens are cut into ``2·cp`` chunks and rank
  ``r`` holds chunks ``r`` and ``2·cp−1−r`` (Megatron's ``get_batch_on_this_cp_rank`` split);
  the losses sum their per-document statistics over the context-parallel group.

Under Megatron's DDP the head's weight gradient is added straight into the weight's
``main_grad`` (``gradient_accumulation_fusion``, on by default there: :func:`main_grad_into`).

Multi-token-prediction heads (``mtp_num_layers``) are refused: their losses are computed from
the logits inside ``GPTModel``. Bad input raises ``ValueError`` on every rank of the
tensor- and context-parallel groups together.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..contract.collectives import exchange, other_rank_failed
from ..contract.options import WeightGradInto
from ..contract.vocab import VocabParallel
from ..losses import LossNormalizer, PolicyLossConfig, loss_normalizer
from ..types import Divergence, LogProbs
from . import seam
from .seam import ContextParallel, Head, LossInputs, Parallelism, SequenceParallel, Tokens

__all__ = [
    "MegatronHead",
    "divergence",
    "logprobs",
    "main_grad_into",
    "megatron_head",
    "output_processor_logprobs",
    "policy_loss",
    "policy_loss_step",
    "step_normalizer",
    "token_layout",
]

IGNORE_INDEX = -100


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
    outer, inner = model, model if isinstance(model, _ProcessorStage) else _gpt_model(model)
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
    return _stage(outer, inner, tp_group, layer.sequence_parallel, vp)


def _stage(outer, inner, tp_group, sequence_parallel: bool, vp) -> MegatronHead:
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


def _layout_head(model: MegatronHead | nn.Module) -> MegatronHead:
    """What :func:`token_layout` reads, on any pipeline stage: :func:`megatron_head` where
    the stage has the head, else the stage's groups."""
    if isinstance(model, MegatronHead):
        return model
    inner = _gpt_model(model)
    if inner is None or inner.post_process:
        return megatron_head(model)
    return _stage(model, inner, inner.tp_group, inner.config.sequence_parallel, None)


def _gpt_model(model: nn.Module) -> nn.Module | None:
    """The GPTModel inside Megatron's wrappers (DDP, Float16Module: ``.module``), or None."""
    from megatron.core.models.gpt import GPTModel

    inner = model
    while not isinstance(inner, GPTModel) and isinstance(getattr(inner, "module", None), nn.Module):
        inner = inner.module
    return inner if isinstance(inner, GPTModel) else None


def _agree(head: MegatronHead, error: ValueError | None, what: str) -> None:
    """Raise ``error`` here and a ``ValueError`` on every other rank of the tensor- and
    context-parallel groups when any of them had one (two exchanges reach the whole grid)."""
    failed = error is not None
    for group in head.groups:
        failed, _ = exchange(group, failed, [])
    if error is not None:
        raise error
    if failed:
        raise other_rank_failed(what, "the tensor- or context-parallel group")


# --- the batch's tokens in Megatron's layout ----------------------------------------------


def token_layout(
    head: MegatronHead | nn.Module,
    labels: torch.Tensor,
    loss_mask: torch.Tensor | None = None,
    packed_seq_params: Any = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The tokens a batch trains on and its documents, ``[B, S]`` like the labels.

    Returns ``(mask, document_ids)``: ``mask`` (bool) is ``loss_mask != 0`` (all True without
    one) and, for a packed batch, False at each sequence's padding; ``document_ids`` (int64)
    is, for a packed batch, each token's sequence index in ``packed_seq_params`` (the same on
    every context-parallel rank for a split sequence; -1 at padding), else None. Pass them to
    :func:`step_normalizer`; the loss functions here build the same themselves. ``head``:
    :func:`megatron_head`'s, or the model itself (a ``GPTModel`` or a wrapper around one) on
    any pipeline stage: a stage without the head reads the layout the last stage scores, so
    one ``forward_step`` runs unchanged on every stage.
    """
    head = _layout_head(head)
    error: ValueError | None = None
    try:
        result = _token_layout(head, labels, loss_mask, packed_seq_params)
    except ValueError as e:
        error = e
    _agree(head, error, "logitless.integrations.megatron")
    return result


def _token_layout(head, labels, loss_mask, packed_seq_params):
    if not isinstance(labels, torch.Tensor) or labels.dim() != 2 or labels.is_floating_point():
        got = tuple(labels.shape) if isinstance(labels, torch.Tensor) else type(labels).__name__
        raise ValueError(f"labels must be an integer tensor [batch, seq_length], got {got}")
    if loss_mask is not None and (
        not isinstance(loss_mask, torch.Tensor) or loss_mask.shape != labels.shape
    ):
        got = tuple(loss_mask.shape) if isinstance(loss_mask, torch.Tensor) else loss_mask
        raise ValueError(
            f"loss_mask must have the labels' shape {tuple(labels.shape)} [batch, seq_length], "
            f"got {got}"
        )
    mask = torch.ones_like(labels, dtype=torch.bool) if loss_mask is None else loss_mask != 0
    if head.parallel.sequence is not None and labels.shape[1] % head.tp_size:
        raise ValueError(
            f"with sequence_parallel=True the sequence length must be a multiple of "
            f"tensor_model_parallel_size={head.tp_size}, got seq_length={labels.shape[1]}"
        )
    if packed_seq_params is None:
        if head.cp_size > 1:
            raise ValueError(
                f"context_parallel_size={head.cp_size} needs packed_seq_params "
                "(qkv_format='thd', with cu_seqlens_q_padded): logitless reads each "
                "sequence's split from it"
            )
        return mask, None
    if getattr(packed_seq_params, "qkv_format", None) != "thd":
        raise ValueError(
            f"packed_seq_params.qkv_format must be 'thd', got "
            f"{getattr(packed_seq_params, 'qkv_format', None)!r}"
        )
    if labels.shape[0] != 1:
        raise ValueError(
            f"a packed (thd) batch has batch size 1, got labels of shape {tuple(labels.shape)}"
        )
    doc, valid = _packed_tokens(packed_seq_params, head.cp_rank, head.cp_size, labels.shape[1])
    doc, valid = doc.to(labels.device)[None], valid.to(labels.device)[None]
    return mask & valid, doc


def _packed_tokens(params: Any, cp_rank: int, cp_size: int, length: int):
    """Per local token: its sequence index (-1 at padding) and whether it is a real token."""
    true = params.cu_seqlens_q
    padded = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else true
    if true is None:
        raise ValueError("packed_seq_params.cu_seqlens_q is None")
    true, padded = true.tolist(), padded.tolist()  # one host read each
    if len(true) != len(padded):
        raise ValueError(
            f"packed_seq_params.cu_seqlens_q and cu_seqlens_q_padded must describe the same "
            f"sequences, got {len(true) - 1} and {len(padded) - 1}"
        )
    chunks = 2 * cp_size if cp_size > 1 else 1
    docs, positions, lengths = [], [], []
    for i in range(len(true) - 1):
        n, n_pad = true[i + 1] - true[i], padded[i + 1] - padded[i]
        if n < 0 or n_pad < n or n_pad % chunks:
            raise ValueError(
                f"packed_seq_params: sequence {i} has {n} tokens padded to {n_pad}; the padded "
                f"length must be at least the length and, with context_parallel_size="
                f"{cp_size}, a multiple of 2 * context_parallel_size = {chunks}"
            )
        c = n_pad // chunks
        if cp_size > 1:
            last = chunks - 1 - cp_rank
            pos = torch.cat(
                [
                    torch.arange(cp_rank * c, (cp_rank + 1) * c),
                    torch.arange(last * c, (last + 1) * c),
                ]
            )
        else:
            pos = torch.arange(n_pad)
        docs.append(torch.full_like(pos, i))
        positions.append(pos)
        lengths.append(torch.full_like(pos, n))
    pos = torch.cat(positions) if positions else torch.zeros(0, dtype=torch.int64)
    if pos.numel() != length:
        raise ValueError(
            f"packed_seq_params describes {pos.numel()} tokens on this context-parallel rank "
            f"(cu_seqlens_q_padded[-1]={padded[-1]} / context_parallel_size={cp_size}), but "
            f"the labels have seq_length={length}"
        )
    valid = pos < torch.cat(lengths) if lengths else pos.bool()
    doc = torch.where(valid, torch.cat(docs), -1) if docs else pos
    return doc, valid


# --- running the head as output_layer's forward -------------------------------------------


@dataclass(frozen=True)
class _Batch:
    """One micro-batch, checked, as every entry point here runs it: the model's head, the
    arguments of ``GPTModel.forward``, the labels masked to the tokens trained on (``target``)
    and the layout :func:`token_layout` read (``mask``, ``document_ids``)."""

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
        mask, doc = token_layout(head, labels, loss_mask, packed_seq_params)
        for name in ("labels", "runtime_gather_output", "output_processor"):
            if name in model_kwargs:
                raise TypeError(f"{name}= is logitless's to set, not a model argument here")
        kwargs = {"packed_seq_params": packed_seq_params, **model_kwargs}
        return cls(head, tuple(inputs), kwargs, torch.where(mask, labels, IGNORE_INDEX), mask, doc)

    def run(self, fn: Callable[[Tokens, Head], Any], call: Callable[[], Any] | None = None):
        """Run the model (or ``call``); where it calls ``output_layer``, run
        ``fn(tokens, head)`` instead."""
        head, labels = self.head, self.target
        layer = head.model.output_layer

        def in_output_layer(hidden, weight=None, runtime_gather_output=None, **_):
            error = None
            try:
                w = layer.weight if weight is None else weight
                _check_hidden(head, hidden, w, labels)
            except ValueError as e:
                error = e
            _agree(head, error, "logitless.integrations.megatron")
            tokens = Tokens(hidden, labels, sequence_first=True)
            result.append(fn(tokens, Head(w, layer.bias, logit_scale=_logit_scale(head.model))))
            # What GPTModel receives as its logits: it only transposes them; never read.
            return hidden.new_zeros(hidden.shape[0], hidden.shape[1], 0), None

        if call is None:
            kwargs = self.kwargs
            if _takes_output_processor(type(head.model)):
                kwargs = {**kwargs, "output_processor": _in_output_processor}
            call = lambda: head.outer(*self.args, **kwargs)  # noqa: E731
        result: list[Any] = []
        seam.run_as_forward(layer, in_output_layer, call, caller="GPTModel.forward")
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


@functools.cache
def _takes_output_processor(model_class: type) -> bool:
    """Whether ``GPTModel.forward`` takes an ``output_processor`` (megatron-core 0.19 and
    later): the seam Megatron offers for what follows the decoder. Where it does, the head
    runs from it; elsewhere ``GPTModel`` calls ``output_layer`` itself. Either way the head
    runs *as* ``output_layer``'s forward, so that module's hooks fire."""
    return "output_processor" in inspect.signature(model_class.forward).parameters


def _in_output_processor(*, hidden_states, output_layer, output_weight=None,
                         runtime_gather_output=None, **_: Any) -> torch.Tensor:  # fmt: skip
    """The ``output_processor`` logitless hands ``GPTModel.forward``: it calls
    ``output_layer`` (whose forward :meth:`_Batch.run` has replaced for the call) and returns
    its placeholder, so nothing of Megatron's logits path (MuP scaling of the logits, the
    language-model loss) runs after it."""
    out, _ = output_layer(
        hidden_states, weight=output_weight, runtime_gather_output=runtime_gather_output
    )
    return out


@dataclass(frozen=True)
class _ProcessorStage:
    """What :func:`megatron_head` reads of a ``GPTModel``, from the arguments
    ``GPTModel.forward`` hands an ``output_processor`` (the model itself is not among them)."""

    output_layer: nn.Module
    config: Any
    tp_group: Any
    cp_group: Any
    post_process: bool = True
    mtp_process: bool = False
    share_embeddings_and_output_weights: bool = False


def output_processor_logprobs(
    *,
    hidden_states: torch.Tensor,
    output_layer: nn.Module,
    output_weight: torch.Tensor | None,
    labels: torch.Tensor,
    config: Any,
    packed_seq_params: Any = None,
    loss_mask: torch.Tensor | None = None,
    **options: Any,
) -> LogProbs:
    """:func:`logprobs` from inside an ``output_processor`` that ``GPTModel.forward`` calls
    (megatron-core 0.18+), on the arguments it hands one: the hidden states ``[S, B, H]``
    (this rank's sequence shard under sequence parallelism), ``output_layer``, the tied
    weight (``output_weight``), the labels ``[B, S]``, the config, ``packed_seq_params``.
    The head runs as ``output_layer``'s forward, so its forward pre-hooks (the distributed
    optimizer's parameter all-gather) fire. ``options``: :func:`logprobs`'s
    (``with_entropy``, ``temperature``, ``gradient_accumulation_fusion``, ...); a tied weight's
    gradient goes to ``.grad`` (the processor cannot tell whether the embedding it is tied to
    lives on this stage). Returns ``[B, S]`` fp32, 0 at masked and padding tokens."""
    from megatron.core import parallel_state as ps

    cp = ps.get_context_parallel_group() if config.context_parallel_size > 1 else None
    stage = _ProcessorStage(output_layer, config, output_layer.tp_group, cp)
    batch = _Batch.read(stage, (), labels, loss_mask, packed_seq_params, {})
    head = batch.head
    fusion = options.pop("gradient_accumulation_fusion", None)
    options = _with_grad_into(head, False if output_weight is not None else fusion, options)
    return batch.run(
        lambda tokens, w: seam.logprobs(tokens, w, head.parallel, **options),
        lambda: output_layer(hidden_states, weight=output_weight),
    )


def _logit_scale(model: nn.Module) -> float | None:
    """The factor ``GPTModel`` multiplies its logits by: MuP's ``mup_output_mult`` where the
    config has ``use_mup`` (megatron-core 0.19+, ``LanguageModule._scale_logits``), else none."""
    config = model.config
    if getattr(config, "use_mup", False) and config.mup_output_mult != 1.0:
        return float(config.mup_output_mult)
    return None


def _check_hidden(head: MegatronHead, hidden, weight, labels) -> None:
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
    layer = head.model.output_layer
    if weight.dim() != 2 or tuple(weight.shape) != (layer.output_size_per_partition, h):
        raise ValueError(
            f"output_layer's weight must be this tensor-parallel rank's [vocab_size / "
            f"tensor_model_parallel_size, hidden_size] = [{layer.output_size_per_partition}, "
            f"{h}] rows (tensor_model_parallel_size={head.tp_size}), got {list(weight.shape)}"
        )


def logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    labels: torch.Tensor,
    *,
    loss_mask: torch.Tensor | None = None,
    packed_seq_params: Any = None,
    with_entropy: bool = False,
    temperature: float | torch.Tensor = 1.0,
    chunk_size: int | None = None,
    head_dtype: torch.dtype | None = None,
    batch_invariant: bool = False,
    gradient_accumulation_fusion: bool | None = None,
    **model_kwargs: Any,
) -> LogProbs:
    """Per-token log-probs (and entropy) of ``labels`` under ``model``: ``[B, S]`` fp32.

    What Megatron's own path gives, without the logits::

        logits = model(input_ids, position_ids, attention_mask, ...)   # [S, B, V/tp] per rank
        logp = -vocab_parallel_cross_entropy(logits / temperature, labels.T).T  # [B, S]

    with 0 where ``loss_mask`` is 0 and at a packed batch's padding; entropy is that of the
    (tensor-parallel-gathered) softmax. Arguments as ``GPTModel.forward`` takes them;
    ``model_kwargs`` go to it unchanged. Gradients reach ``output_layer``'s weight (or the
    tied embedding) and every decoder parameter. ``batch_invariant``: as in
    :func:`logitless.linear_logprobs` (for a fixed tensor-parallel size).
    ``gradient_accumulation_fusion``: add the weight's gradient straight into the
    ``main_grad`` Megatron's DDP gave it, tile by tile, instead of returning a
    ``[V/tp, H]`` gradient (:func:`main_grad_into`; None: wherever DDP gave it an fp32
    ``main_grad``).
    """
    batch = _Batch.read(
        model, (input_ids, position_ids, attention_mask), labels, loss_mask, packed_seq_params,
        model_kwargs,
    )  # fmt: skip
    options = _with_grad_into(
        batch.head,
        gradient_accumulation_fusion,
        dict(
            with_entropy=with_entropy,
            temperature=temperature,
            chunk_size=chunk_size,
            head_dtype=head_dtype,
            batch_invariant=batch_invariant,
        ),
    )
    return batch.run(lambda tokens, w: seam.logprobs(tokens, w, batch.head.parallel, **options))


def policy_loss(
    model: nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    labels: torch.Tensor,
    inputs: LossInputs,
    *,
    config: PolicyLossConfig | None = None,
    normalizer: LossNormalizer | None = None,
    teacher: nn.Module | None = None,
    loss_mask: torch.Tensor | None = None,
    packed_seq_params: Any = None,
    temperature: float | torch.Tensor = 1.0,
    chunk_size: int | None = None,
    head_dtype: torch.dtype | None = None,
    batch_invariant: bool = False,
    gradient_accumulation_fusion: bool | None = None,
    **model_kwargs: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The fused policy loss of ``model`` on one micro-batch: ``(loss, metrics)`` of
    :func:`logitless.fused_policy_loss`, equal to :func:`logitless.policy_loss` on
    :func:`logprobs`'s output.

    ``inputs``: the per-token loss inputs ``[B, S]`` like the labels (advantages per token, or
    per sequence with a packed batch's ``document_ids``, which default to the sequences of
    ``packed_seq_params``). Under context parallelism the per-document statistics are summed
    over the context-parallel group and the loss is this rank's share. ``teacher``: a
    teacher ``GPTModel`` (the student's tensor-parallel split) for the distillation term
    (``config.distill_coef``, ``distill_beta``), run first without gradient inside its own
    ``output_layer``'s forward; or pass ``inputs.teacher`` yourself. ``batch_invariant``:
    the log-probs inside the loss are :func:`logprobs`'s with it, bit for bit.
    ``gradient_accumulation_fusion``: as in :func:`logprobs`; the loss's weight gradient,
    taken in the forward pass, waits in an fp32 scratch until ``backward()`` adds it into
    ``main_grad`` (docs/megatron.md).
    """
    batch = _Batch.read(
        model, (input_ids, position_ids, attention_mask), labels, loss_mask, packed_seq_params,
        model_kwargs,
    )  # fmt: skip
    options = dict(
        config=config,
        normalizer=normalizer,
        temperature=temperature,
        chunk_size=chunk_size,
        head_dtype=head_dtype,
        batch_invariant=batch_invariant,
    )
    return _policy_loss(batch, inputs, teacher, gradient_accumulation_fusion, options)


def _policy_loss(batch: _Batch, inputs: LossInputs, teacher, fusion, options: dict):
    """:func:`policy_loss` of a checked batch; ``options``: the fused loss's, the weight's
    gradient destination added here (``fusion``: ``gradient_accumulation_fusion``)."""
    head = batch.head
    if inputs.document_ids is None and batch.document_ids is not None:
        inputs = inputs.replace(document_ids=batch.document_ids)
    distills = teacher is not None or inputs.teacher is not None
    options = _with_grad_into(head, fusion, options, shared=distills)
    if teacher is not None:
        t_tokens, t_head = batch.teacher(teacher)
        with torch.no_grad():
            inputs = inputs.replace(teacher=t_head.as_teacher(t_tokens.aligned(head.parallel)))
    return batch.run(
        lambda tokens, w: seam.policy_loss(tokens, w, inputs, head.parallel, **options)
    )


def divergence(
    model: nn.Module,
    teacher: nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    labels: torch.Tensor,
    *,
    beta: float = 0.0,
    temperature: float | torch.Tensor = 1.0,
    loss_mask: torch.Tensor | None = None,
    packed_seq_params: Any = None,
    with_logprobs: bool = False,
    with_entropy: bool = False,
    chunk_size: int | None = None,
    batch_invariant: bool = False,
    **model_kwargs: Any,
) -> Divergence:
    """The per-token divergence from ``teacher`` (a ``GPTModel`` with the same
    tensor-parallel vocabulary split) to ``model``, ``[B, S]`` fp32 (TRL's ``beta``
    convention, :func:`logitless.linear_divergence`). The teacher runs first, without
    gradient, inside its own ``output_layer``'s forward."""
    batch = _Batch.read(
        model, (input_ids, position_ids, attention_mask), labels, loss_mask, packed_seq_params,
        model_kwargs,
    )  # fmt: skip
    t_tokens, t_weight = batch.teacher(teacher)
    options = dict(
        beta=beta,
        temperature=temperature,
        with_logprobs=with_logprobs,
        with_entropy=with_entropy,
        chunk_size=chunk_size,
        batch_invariant=batch_invariant,
    )
    parallel = batch.head.parallel
    return batch.run(
        lambda tokens, w: seam.divergence(tokens, w, t_tokens, t_weight, parallel, **options)
    )


# --- gradient-accumulation fusion: the weight gradient into DDP's main_grad --------------


def _head_weight(head: MegatronHead) -> torch.Tensor:
    """The weight ``GPTModel`` hands ``output_layer``: the input embedding's shard when the
    two are shared on this stage, else ``output_layer.weight``."""
    model = head.model
    if model.share_embeddings_and_output_weights:
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight


def main_grad_into(
    weight: torch.Tensor, *, shared: bool = False, dtype: torch.dtype = torch.float32
) -> WeightGradInto | None:
    """The weight's Megatron DDP ``main_grad`` as a :class:`WeightGradInto` (None when DDP
    gave it none of ``dtype``).

    Megatron's protocol, as ``ColumnParallelLinear`` follows it under
    ``gradient_accumulation_fusion``: after the gradient is added into ``main_grad``, the
    parameter is marked ``grad_added_to_main_grad`` and carries a placeholder ``.grad``, so
    DDP's backward hook (which asserts a gradient under ``overlap_grad_reduce``) marks it
    ready without adding anything. The placeholder is one zero seen as ``[V/tp, H]``
    (``expand``), set on the parameter after the add: Megatron's own is a full
    ``torch.empty`` of that shape. ``shared``: the weight gets another gradient in the same
    backward (the input embedding it is tied to, a distillation term): then neither the flag
    nor the placeholder is set, and that gradient arrives as ``.grad`` for the hook to add.
    """
    main = getattr(weight, "main_grad", None)
    if not isinstance(main, torch.Tensor) or not hasattr(weight, "grad_added_to_main_grad"):
        return None
    if main.dtype != dtype or main.shape != weight.shape or main.device != weight.device:
        return None
    return WeightGradInto(main, None if shared else lambda: _mark_added(weight))


def _mark_added(weight: torch.Tensor) -> None:
    weight.grad_added_to_main_grad = True
    if weight.grad is None:  # a zero, so a hook that adds it anyway (zero_out_wgrad) adds 0
        weight.grad = weight.new_zeros(()).expand(weight.shape)


def _with_grad_into(head: MegatronHead, mode: bool | None, options: dict, *, shared=False):
    """``options`` with ``weight_grad_into``: the destination of the head's weight gradient
    under ``gradient_accumulation_fusion`` ``mode`` (None: wherever Megatron DDP gave the
    weight a ``main_grad`` of the call's compute dtype, read from ``options``; True:
    required; False: off). Raises on every rank together."""
    return {**options, "weight_grad_into": _grad_into(head, mode, options, shared)}


def _grad_into(head: MegatronHead, mode, options: dict, shared: bool) -> WeightGradInto | None:
    if mode is not None and not isinstance(mode, bool):
        raise ValueError(f"gradient_accumulation_fusion must be None, True or False, got {mode!r}")
    weight = _head_weight(head)
    if mode is False or not torch.is_grad_enabled() or not weight.requires_grad:
        return None
    from ..transform import compute_dtype

    dtype = compute_dtype(options.get("head_dtype") or weight.dtype)
    model = head.model
    tied = model.share_embeddings_and_output_weights and model.pre_process
    into = main_grad_into(weight, shared=shared or tied, dtype=dtype)
    if mode:  # the one case that can fail: every rank asked for it, so all of them agree here
        error = None
        if into is None:
            main = getattr(weight, "main_grad", None)
            got = "none" if main is None else f"{main.dtype} {list(main.shape)}"
            error = ValueError(
                f"gradient_accumulation_fusion=True needs output_layer's weight to carry "
                f"Megatron DDP's main_grad ({dtype}, {list(weight.shape)}: wrap the model in "
                f"megatron.core.distributed.DistributedDataParallel, with grad_reduce_in_fp32 "
                f"for 16-bit weights), got {got}"
            )
        _agree(head, error, "logitless.integrations.megatron")
    return into


# --- Megatron's pipeline schedule ---------------------------------------------------------


def step_normalizer(
    masks: Sequence[torch.Tensor],
    document_ids: Sequence[torch.Tensor | None] | None = None,
    *,
    calculate_per_token_loss: bool = False,
    data_parallel_group: Any = None,
    context_parallel_group: Any = None,
) -> LossNormalizer:
    """:func:`logitless.loss_normalizer` of one optimizer step, for Megatron's schedule.

    ``masks`` / ``document_ids``: every micro-batch's, from :func:`token_layout`. The groups
    default to Megatron's ``parallel_state`` (the data-parallel group without context
    parallelism; the context-parallel group). Megatron's DDP averages gradients over the
    data- and context-parallel ranks unless ``calculate_per_token_loss``; the normalizer's
    ``loss_scale`` undoes that average, so each rank's loss is its share of the step's.
    """
    from megatron.core import parallel_state as ps

    dp = ps.get_data_parallel_group() if data_parallel_group is None else data_parallel_group
    cp = (
        ps.get_context_parallel_group()
        if context_parallel_group is None
        else context_parallel_group
    )
    cp_size = cp.size() if cp is not None else 1
    scale = 1 if calculate_per_token_loss else dp.size() * cp_size
    return loss_normalizer(
        list(masks),
        None if document_ids is None else list(document_ids),
        process_group=dp if dp.size() > 1 else None,
        context_group=cp if cp_size > 1 else None,
        loss_scale=float(scale),
    )


def policy_loss_step(
    model: nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    labels: torch.Tensor,
    inputs: LossInputs,
    *,
    config: PolicyLossConfig | None,
    normalizer: LossNormalizer,
    num_microbatches: int,
    teacher: nn.Module | None = None,
    calculate_per_token_loss: bool = False,
    loss_mask: torch.Tensor | None = None,
    packed_seq_params: Any = None,
    temperature: float | torch.Tensor = 1.0,
    chunk_size: int | None = None,
    head_dtype: torch.dtype | None = None,
    batch_invariant: bool = False,
    gradient_accumulation_fusion: bool | None = None,
    **model_kwargs: Any,
) -> tuple[torch.Tensor, Callable[[torch.Tensor], tuple]]:
    """What a ``forward_step`` returns: ``(output_tensor, loss_func)``.

    On the last pipeline stage the output is the fused loss of this micro-batch (its gradients
    are already computed) and ``loss_func(output)`` returns ``(loss, num_tokens, metrics)`` in
    the shape ``get_forward_backward_func()`` expects; the loss is scaled so that after the
    schedule's own normalization (a division by ``num_tokens`` and ``num_microbatches``, or,
    with ``calculate_per_token_loss``, ``finalize_model_grads`` dividing by the step's tokens)
    the gradients are those of ``normalizer``'s step loss. On other stages it returns the
    model's output and a ``loss_func`` the schedule never calls. The other arguments are
    :func:`policy_loss`'s.
    """
    inner = _gpt_model(model)
    if inner is not None and not inner.post_process:
        out = model(
            input_ids,
            position_ids,
            attention_mask,
            packed_seq_params=packed_seq_params,
            **model_kwargs,
        )
        return out, _never_called
    loss, metrics = policy_loss(
        model, input_ids, position_ids, attention_mask, labels, inputs, config=config,
        normalizer=normalizer, teacher=teacher, loss_mask=loss_mask,
        packed_seq_params=packed_seq_params, temperature=temperature, chunk_size=chunk_size,
        head_dtype=head_dtype, batch_invariant=batch_invariant,
        gradient_accumulation_fusion=gradient_accumulation_fusion, **model_kwargs,
    )  # fmt: skip
    mask, _ = token_layout(model, labels, loss_mask, packed_seq_params)
    num_tokens = mask.sum().to(torch.int)
    if calculate_per_token_loss:
        scale = torch.as_tensor(normalizer.num_tokens, dtype=loss.dtype, device=loss.device)
    else:
        scale = num_tokens.clamp(min=1).to(loss.dtype) * num_microbatches

    def loss_func(output: torch.Tensor) -> tuple:
        return output * scale, num_tokens, metrics

    return loss, loss_func


def _never_called(output: torch.Tensor) -> tuple:  # pragma: no cover - not the last stage
    raise RuntimeError("the loss function runs on the last pipeline stage only")
