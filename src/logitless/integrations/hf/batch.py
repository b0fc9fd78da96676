"""The HF integration's batch side: the model inputs, checked, and the targets built from them.

Package-internal (the public entry points are in :mod:`logitless.integrations.hf`; the verl
backend builds a :class:`ModelBatch` too). It answers the seam's first question for a
transformers batch (:mod:`logitless.integrations.seam`): the labels in the logits' alignment
(:meth:`ModelBatch.targets`: given, or the next token of the same document, never from or to a
padding token), the position ids the backbone gets (:func:`model_position_ids`), the loss's
documents (:func:`document_ids_of`) and the ``[B, T]`` to ``[B * T]`` view of the loss's inputs
(:class:`Flattener`). Every check here reads no model parameter and runs before the backbone.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from ...contract.checks import fmt_shape as _shape
from ...packing import (
    cu_seqlens_to_position_ids,
    labels_within_documents,
    next_token_labels,
    position_documents,
)
from .model import Backbone, run_backbone
from .vlm import BackboneInputs, check_backbone_inputs, text_positions

__all__ = [
    "MASK_DTYPES",
    "POS_DTYPES",
    "Flattener",
    "ModelBatch",
    "batch_labels",
    "check_input_ids",
    "check_token_range",
    "check_like_ids",
    "check_model_inputs",
    "check_position_ids",
    "document_ids_of",
    "model_position_ids",
]


# --------------------------------------------------------------------------------------------
# input checks


def check_input_ids(input_ids: object) -> torch.Tensor:
    if not isinstance(input_ids, torch.Tensor):
        raise ValueError(f"input_ids must be a torch.Tensor, got {type(input_ids).__name__}")
    if input_ids.dim() != 2 or input_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"input_ids must be an int64 (or int32) tensor of shape [B, T], got dtype "
            f"{input_ids.dtype} and shape {_shape(input_ids)}"
        )
    return input_ids


def check_token_range(input_ids: torch.Tensor, lm: nn.Module, capturable: bool) -> None:
    """Every id of ``input_ids`` is a row of ``lm``'s input embedding, ``[0, V)``: named here,
    before the backbone (whose embedding lookup would fail) and before the targets built from
    them are checked as labels. One host read (``capturable``: a device-side assertion)."""
    embedding = lm.get_input_embeddings() if hasattr(lm, "get_input_embeddings") else None
    vocab = getattr(embedding, "num_embeddings", None)
    if not isinstance(vocab, int) or not input_ids.numel():
        return
    message = f"input_ids must be token ids in [0, {vocab}) (the model's input embedding)"
    if capturable:
        bad = ((input_ids < 0) | (input_ids >= vocab)).any()
        torch._assert_async(~bad, message)
        return
    low, high = torch.stack([input_ids.min(), input_ids.max()]).tolist()
    if low < 0 or high >= vocab:
        raise ValueError(f"{message}, got ids in [{low}, {high}]")


def check_like_ids(
    name: str, t: object, input_ids: torch.Tensor, dtypes: tuple[torch.dtype, ...]
) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.shape != input_ids.shape:
        raise ValueError(
            f"{name} must have input_ids' shape {_shape(input_ids)}, got {_shape(t)}"
            + (" (4-D attention masks are not supported)" if name == "attention_mask" else "")
        )
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must have a dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if t.device != input_ids.device:
        raise ValueError(f"{name} must be on input_ids' device {input_ids.device}, got {t.device}")
    return t


MASK_DTYPES = (
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
)
POS_DTYPES = (torch.int32, torch.int64)


def check_position_ids(position_ids: object, input_ids: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` position ids, or multimodal rotary ones ``[3, B, T]`` / ``[4, B, T]`` (text
    positions first) as the Qwen vision-language models take them; which rank a model takes is
    checked with the model (:func:`~logitless.integrations.hf.vlm.check_backbone_inputs`)."""
    if isinstance(position_ids, torch.Tensor) and position_ids.dim() == 3:
        if position_ids.shape[0] not in (3, 4) or position_ids.shape[1:] != input_ids.shape:
            raise ValueError(
                f"position_ids must have input_ids' shape {_shape(input_ids)}, or [3, B, T] / "
                f"[4, B, T] (multimodal rotary positions), got {_shape(position_ids)}"
            )
        if position_ids.dtype not in POS_DTYPES:
            raise ValueError(
                f"position_ids must have a dtype in {[str(d) for d in POS_DTYPES]}, got "
                f"{position_ids.dtype}"
            )
        if position_ids.device != input_ids.device:
            raise ValueError(
                f"position_ids must be on input_ids' device {input_ids.device}, got "
                f"{position_ids.device}"
            )
        return position_ids
    return check_like_ids("position_ids", position_ids, input_ids, POS_DTYPES)


def _check_attention_mask(
    attention_mask: object, input_ids: torch.Tensor, capturable: bool
) -> torch.Tensor:
    mask = check_like_ids("attention_mask", attention_mask, input_ids, MASK_DTYPES)
    if mask.dtype != torch.bool:
        binary = ((mask == 0) | (mask == 1)).all()
        if capturable:
            torch._assert_async(binary, "attention_mask must hold only 0 and 1")
        elif not bool(binary):
            raise ValueError("attention_mask must hold only 0 and 1")
    return mask.bool()


def check_model_inputs(
    input_ids: object,
    attention_mask: object,
    position_ids: object,
    cu_seqlens: object,
    response_mask: object,
    ignore_index: object,
    capturable: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The model-input contract (types, shapes, dtypes, mask values, one packing description),
    checked without building labels; returns input_ids and the bool attention mask (or None).
    ``capturable``: value checks as device-side assertions."""
    input_ids = check_input_ids(input_ids)
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise ValueError(f"ignore_index must be an int, got {ignore_index!r}")
    mask = None
    if attention_mask is not None:
        mask = _check_attention_mask(attention_mask, input_ids, capturable)
    if position_ids is not None:
        check_position_ids(position_ids, input_ids)
    if response_mask is not None:
        check_like_ids("response_mask", response_mask, input_ids, (torch.bool,))
    if cu_seqlens is not None:
        if capturable:
            raise ValueError(
                "cu_seqlens is not supported with capturable=True (its documents are found by "
                "reading its values on the host); pass position_ids restarting at 0 for each "
                "document instead"
            )
        if position_ids is not None:
            raise ValueError("give cu_seqlens or position_ids, not both")
        if input_ids.shape[0] != 1:
            raise ValueError(
                f"cu_seqlens describes one packed row: input_ids must have shape [1, T], got "
                f"{_shape(input_ids)}; for several rows pass position_ids restarting at 0"
            )
    return input_ids, mask


def batch_labels(batch: ModelBatch, ignore_index: object, capturable: bool) -> torch.Tensor:
    """:func:`~logitless.integrations.hf.causal_lm_labels` of ``batch``; ``capturable``: no
    host read (its value checks are device-side assertions)."""
    input_ids, position_ids, cu_seqlens = batch.input_ids, batch.position_ids, batch.cu_seqlens
    response_mask = batch.response_mask
    input_ids, mask = check_model_inputs(
        input_ids, batch.attention_mask, position_ids, cu_seqlens, response_mask, ignore_index,
        capturable,
    )  # fmt: skip
    position_ids = text_positions(position_ids)  # multimodal: where documents start, or None
    if cu_seqlens is not None:
        labels = next_token_labels(input_ids, cu_seqlens=cu_seqlens, ignore_index=ignore_index)
    elif position_ids is not None:
        pos = position_ids if mask is None else position_ids.masked_fill(~mask, -1)
        doc = position_documents(pos, capturable).reshape(-1)
        labels = labels_within_documents(input_ids, doc, ignore_index)
    else:
        labels = next_token_labels(input_ids, ignore_index=ignore_index)
    keep = torch.ones_like(labels, dtype=torch.bool)
    if mask is not None:
        keep[:, :-1] &= mask[:, :-1] & mask[:, 1:]  # never from or to a padding token
    if response_mask is not None:
        keep[:, :-1] &= response_mask[:, 1:]
    return labels.masked_fill(~keep, ignore_index)


def model_position_ids(
    position_ids: torch.Tensor | None, cu_seqlens: torch.Tensor | None, total: int
) -> torch.Tensor | None:
    """What the backbone gets: position_ids as given, or restarting per cu_seqlens document
    (padding after the last document at 0, i.e. one-token documents of its own)."""
    if cu_seqlens is None:
        return position_ids
    return cu_seqlens_to_position_ids(cu_seqlens, total=total).clamp(min=0)[None]


class ModelBatch(NamedTuple):
    """The backbone's inputs and what the targets are built from (see
    :func:`~logitless.integrations.hf.causal_lm_logprobs`)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    target_ids: torch.Tensor | None = None
    response_mask: torch.Tensor | None = None

    def targets(self, ignore_index: int, capturable: bool) -> torch.Tensor:
        """``[B, T]`` targets aligned like the logits: given, or :func:`batch_labels`."""
        if self.target_ids is None:
            return batch_labels(self, ignore_index, capturable)
        if self.response_mask is not None:
            raise ValueError(
                "give target_ids or response_mask, not both: with explicit target_ids, set the "
                "positions you do not want to ignore_index"
            )
        t = self.target_ids
        if not isinstance(t, torch.Tensor) or t.shape != self.input_ids.shape:
            got = _shape(t) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(
                f"target_ids must have input_ids' shape {_shape(self.input_ids)}, got {got}"
            )
        # The model inputs the backbone will get.
        check_model_inputs(
            self.input_ids, self.attention_mask, self.position_ids, self.cu_seqlens, None,
            ignore_index, capturable,
        )  # fmt: skip
        return t

    def check_backbone(self, lm: nn.Module, model_kwargs: dict[str, Any]) -> None:
        """The checks of what the backbone of ``lm`` will get (its multimodal inputs and
        the rank of its position ids), before the targets are built from them."""
        input_ids = check_input_ids(self.input_ids)
        position_ids = self.position_ids
        if isinstance(self.cu_seqlens, torch.Tensor) and input_ids.shape[0] == 1:
            # what the backbone gets; a bad cu_seqlens is named by the input checks after this
            position_ids = model_position_ids(None, self.cu_seqlens, input_ids.shape[1])
        check_backbone_inputs(
            lm, BackboneInputs(input_ids, self.attention_mask, position_ids, model_kwargs)
        )

    def backbone(
        self, lm: nn.Module, model_kwargs: dict[str, Any], router_logits: bool = False
    ) -> Backbone:
        """The backbone's outputs (with ``cu_seqlens``, position ids restarting at each
        document); ``lm`` is the unwrapped model, called inside its wrapper's forward."""
        position_ids = model_position_ids(
            self.position_ids, self.cu_seqlens, self.input_ids.shape[1]
        )
        inputs = BackboneInputs(self.input_ids, self.attention_mask, position_ids, model_kwargs)
        return run_backbone(lm, inputs, router_logits)


def document_ids_of(
    document_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    input_ids: torch.Tensor,
    capturable: bool,
) -> torch.Tensor | None:
    """The loss's sequences: as given; else the documents of cu_seqlens / position_ids
    (numbered row-major, padding -1); else None (each row one sequence)."""
    if document_ids is not None:
        return document_ids
    if cu_seqlens is not None:
        pos = cu_seqlens_to_position_ids(cu_seqlens, total=input_ids.shape[1])[None]
    elif text_positions(position_ids) is not None:
        pos = text_positions(position_ids)
        if attention_mask is not None:
            pos = pos.masked_fill(~attention_mask.bool(), -1)
    else:
        return None
    return position_documents(pos, capturable)


class Flattener:
    """``[B, T]`` per-token loss inputs -> ``[B * T]``, checking their shape on the way."""

    def __init__(self, shape: torch.Size) -> None:
        self.shape = shape

    def __call__(
        self, name: str, t: torch.Tensor | None, *, per_sequence_ok: bool = False
    ) -> torch.Tensor | None:
        if t is None:
            return None
        if isinstance(t, torch.Tensor) and t.shape == self.shape:
            return t.reshape(-1)
        if per_sequence_ok and isinstance(t, torch.Tensor) and t.dim() == 1:
            return t  # one per document id; policy_loss checks the count
        got = _shape(t) if isinstance(t, torch.Tensor) else type(t).__name__
        want = " (per token) or [num_documents] (per document)" if per_sequence_ok else ""
        raise ValueError(
            f"{name} must have input_ids' shape [{', '.join(map(str, self.shape))}]{want}, "
            f"got {got}"
        )
