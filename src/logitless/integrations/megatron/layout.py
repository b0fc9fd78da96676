"""A Megatron batch's tokens: which of them are trained on, and their documents.

Part of :mod:`logitless.integrations.megatron` (which re-exports :func:`token_layout`): the
labels and ``loss_mask`` ``[B, S]`` as ``GPTModel.forward`` takes them, and for a packed (THD)
batch the sequences of ``packed_seq_params`` (``cu_seqlens_q`` and the per-sequence padded
``cu_seqlens_q_padded``), split over the context-parallel ranks as Megatron's
``get_batch_on_this_cp_rank`` splits them (2·cp chunks, rank r holding chunks r and
2·cp−1−r). One read of the layout per micro-batch (two host reads, one agreement over the
tensor- and context-parallel groups).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .model import MegatronHead, agree, gpt_model, megatron_head, stage

__all__ = ["layout_head", "token_layout"]


def layout_head(model: MegatronHead | nn.Module) -> MegatronHead:
    """What :func:`token_layout` reads, on any pipeline stage: :func:`megatron_head` where
    the stage has the head, else the stage's groups."""
    if isinstance(model, MegatronHead):
        return model
    inner = gpt_model(model)
    if inner is None or inner.post_process:
        return megatron_head(model)
    return stage(model, inner, inner.tp_group, inner.config.sequence_parallel, None)


def token_layout(
    head: MegatronHead | nn.Module,
    labels: torch.Tensor,
    loss_mask: torch.Tensor | None = None,
    packed_seq_params: Any = None,
    *,
    input_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The tokens a batch trains on and its documents, ``[B, S]`` like the labels.

    Returns ``(mask, document_ids)``: ``mask`` (bool) is ``loss_mask != 0`` (all True without
    one) and, for a packed batch, False at each sequence's padding; ``document_ids`` (int64)
    is, for a packed batch, each token's sequence index in ``packed_seq_params`` (the same on
    every context-parallel rank for a split sequence; -1 at padding), else None. Pass them to
    :func:`step_normalizer`; the loss functions here build the same themselves. ``head``:
    :func:`megatron_head`'s, or the model itself (a ``GPTModel`` or a wrapper around one) on
    any pipeline stage: a stage without the head reads the layout the last stage scores, so
    one ``forward_step`` runs unchanged on every stage. ``input_ids``: the model's input ids,
    whose ``[batch, seq_length]`` the labels must have (checked when given).
    """
    head = layout_head(head)
    error: ValueError | None = None
    try:
        _check_like_inputs(labels, input_ids)
        result = _token_layout(head, labels, loss_mask, packed_seq_params)
    except ValueError as e:
        error = e
    agree(head, error, "logitless.integrations.megatron")
    return result


def _check_like_inputs(labels: object, input_ids: object) -> None:
    if not isinstance(input_ids, torch.Tensor) or not isinstance(labels, torch.Tensor):
        return
    if labels.shape != input_ids.shape:
        raise ValueError(
            f"labels must be [batch, seq_length] = {list(input_ids.shape)} like input_ids, got "
            f"{list(labels.shape)}"
        )


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
