"""The rollout engine's top-k log-probs in TRL's GRPO trainer (``rollout_topk=k``).

Package-internal: :class:`~logitless.integrations.trl.LogitlessGRPOMixin` records them. TRL
1.16 builds its ``VLLMGeneration`` with ``logprobs=0`` (only the sampled token's log-prob,
``trl/trainer/grpo_trainer.py``: "we only need the generated token logprobs for the importance
sampling correction") and keeps ``lp[0]`` of each position; ``VLLMGeneration.generate``
itself returns, for ``logprobs=k``, up to ``k + 1`` log-probs per position (the top ``k`` and
the sampled token, sorted, vLLM's ``processed_logprobs`` in colocate mode) and their token ids.
So with ``rollout_topk=k`` the trainer sets that ``logprobs`` (TRL's own attribute of its
generation) and records what ``generate`` returns for the call TRL makes (:func:`recording`),
without changing what TRL keeps; :func:`topk_tensors` lays the lists out like TRL's padded
``completion_ids``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["recording", "topk_tensors"]


@contextlib.contextmanager
def recording(generation: Any, k: int) -> Iterator[list[tuple[list, list]]]:
    """Within the block, ``generation`` (TRL's ``VLLMGeneration``) returns ``k`` top log-probs
    per position and each ``generate`` call's ``(logprobs, logprob_token_ids)`` lists are
    appended to the yielded list; its ``logprobs`` setting and ``generate`` are put back
    after. What TRL keeps of the result, the sampled token's log-prob (``lp[0]``), stays
    that: each position's log-probs are handed on with the sampled token's first
    (:func:`sampled_first`)."""
    seen: list[tuple[list, list]] = []
    own_logprobs = generation.logprobs
    own = vars(generation).get("generate")
    real = generation.generate

    def generate(*args: Any, **kwargs: Any):
        prompt_ids, completion_ids, logprobs, token_ids = real(*args, **kwargs)
        seen.append((logprobs, token_ids))
        return (
            prompt_ids,
            completion_ids,
            sampled_first(logprobs, token_ids, completion_ids),
            token_ids,
        )

    generation.logprobs = max(k, own_logprobs or 0)
    generation.generate = generate
    try:
        yield seen
    finally:
        generation.logprobs = own_logprobs
        if own is None:
            vars(generation).pop("generate", None)
        else:
            generation.generate = own


def sampled_first(logprobs: list, token_ids: list, completion_ids: list) -> list:
    """Each position's log-probs with the sampled token's first: TRL keeps ``lp[0]``, which
    vLLM's ``logprobs=0`` makes the sampled token's (its only entry), but its top-1's once
    ``logprobs=k``."""
    out = []
    for seq_lps, seq_ids, seq_tokens in zip(logprobs, token_ids, completion_ids, strict=True):
        rows = []
        for lps, ids, token in zip(seq_lps, seq_ids, seq_tokens, strict=False):
            j = ids.index(token) if token in ids else 0
            rows.append([lps[j], *lps[:j], *lps[j + 1 :]])
        out.append(rows)
    return out


def topk_tensors(
    logprobs: list, token_ids: list, shape: torch.Size, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``([B, C, k + 1] int64 ids, -1 unused; [B, C, k + 1] fp32 log-probs)`` of the recorded
    lists laid out like TRL's right-padded ``completion_ids`` ``[B, C]``; a log-prob vLLM could
    not compute (None, NaN) leaves its slot unused."""
    rows, cols = shape
    if len(logprobs) != rows:
        raise ValueError(
            f"rollout_topk: the generation returned {len(logprobs)} sequences of top-k "
            f"log-probs for {rows} completions"
        )
    width = max((len(p) for seq in logprobs for p in seq), default=0)
    ids = torch.full((rows, cols, width), -1, dtype=torch.int64)
    lps = torch.zeros(rows, cols, width)
    for b, (seq_lps, seq_ids) in enumerate(zip(logprobs, token_ids, strict=True)):
        for t, (p, i) in enumerate(zip(seq_lps[:cols], seq_ids[:cols], strict=True)):
            good = [
                (tok, lp)
                for tok, lp in zip(i, p, strict=True)
                if lp is not None and not math.isnan(lp)
            ]
            if good:
                ids[b, t, : len(good)] = torch.tensor([tok for tok, _ in good])
                lps[b, t, : len(good)] = torch.tensor([lp for _, lp in good])
    return ids.to(device), lps.to(device)
