"""The demo's verifiable toy task: prompts of random digits, the answer that echoes the last one,
its reward; the toy tokenizer's ids and the response labels."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...contract.options import IGNORE_INDEX

IGNORE = IGNORE_INDEX  # the label of the tokens not trained on
PAD, BOS, DIGIT0 = 0, 1, 2  # toy tokenizer: <pad> <bos> 0 1 … 9  ->  ids 0 1 2 3 … 11


@dataclass(frozen=True)
class ToyTask:
    """Prompts ``<bos> d1 … dL`` (random digits) and the reward of an ``L``-token answer.

    The right answer repeats the last prompt digit ``L`` times (``<bos> 3 1 4`` ->
    ``4 4 4``). The reward is the fraction of answer tokens equal to ``dL``; a policy guessing
    digits at random scores 0.1. It cannot be gamed by a fixed answer (that also scores 0.1 on
    average): the policy has to read the prompt.
    """

    digits: int = 3

    def __post_init__(self) -> None:
        if isinstance(self.digits, bool) or not isinstance(self.digits, int) or self.digits < 1:
            raise ValueError(f"ToyTask.digits must be an int >= 1, got {self.digits!r}")

    @property
    def prompt_len(self) -> int:
        """Tokens per prompt: ``<bos>`` and the digits."""
        return self.digits + 1

    def prompts(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """``[n, L]`` random digit values 0-9 (int64, CPU)."""
        return torch.randint(0, 10, (n, self.digits), generator=generator)

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        """Digit values ``[n, L]`` -> prompt ids ``[n, L + 1]``."""
        bos = torch.full((values.shape[0], 1), BOS, dtype=torch.long)
        return torch.cat([bos, values + DIGIT0], dim=1)

    def correct(self, values: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """``[n, L]`` bool: which answer tokens are right."""
        if responses.shape != values.shape:
            raise ValueError(
                f"responses must have the prompts' shape {list(values.shape)}, "
                f"got {list(responses.shape)}"
            )
        return responses.cpu() == values[:, -1:] + DIGIT0

    def reward(self, values: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """``[n]`` fraction of answer tokens that are right (fp32)."""
        return self.correct(values, responses).float().mean(dim=1)


def response_labels(ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Next-token labels of the response tokens only: ``[B, S]``, ``IGNORE`` elsewhere.

    Aligned like HF logits: position ``t`` predicts token ``t + 1``; positions
    ``prompt_len - 1 … S - 2`` predict the response, the prompt and the last position get
    ``IGNORE``.
    """
    labels = torch.full_like(ids, IGNORE)
    labels[:, prompt_len - 1 : -1] = ids[:, prompt_len:]
    return labels
