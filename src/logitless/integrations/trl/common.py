"""What both TRL trainers share: the accelerate setups they run under and TRL's batch layout.

Package-internal: :mod:`logitless.integrations.trl` (``LogitlessGRPOTrainer``) and
:mod:`logitless.integrations.trl_distillation` (``LogitlessDistillationTrainer``) import it;
neither imports the other's module for it (``trl`` re-exports the distillation trainer, one
way). It imports neither TRL nor transformers.

- :func:`distributed_problem`: the one rule on accelerate's distributed type (DDP, FSDP2 and
  DeepSpeed run; FSDP1 and DeepSpeed's offload / ZeRO++ partitions are refused, with the
  reason).
- :func:`completion_batch` and :class:`CompletionLayout`: a TRL micro-batch (``prompt_ids``,
  ``completion_ids`` and their masks) as the HF functions take it, and TRL's ``[B, C]``
  completion columns inside logitless' ``[B, P + C]`` logits alignment.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ..deepspeed import config_problem

__all__ = ["CompletionLayout", "completion_batch", "distributed_problem"]

# accelerate's distributed types that wrap the model in DistributedDataParallel
_DDP_TYPES = ("NO", "MULTI_CPU", "MULTI_GPU", "MULTI_NPU", "MULTI_XPU", "MULTI_MLU", "MULTI_MUSA")


def distributed_problem(accelerator: Any) -> str | None:
    """Why logitless cannot run under this accelerate setup, or None."""
    dist_type = str(accelerator.distributed_type).rsplit(".", 1)[-1]
    if dist_type in _DDP_TYPES:
        return None
    if dist_type == "FSDP":
        version = getattr(accelerator.state.fsdp_plugin, "fsdp_version", 1)
        if version == 2:
            return None
        return "FSDP1 (its flat parameters hide the head weight); set fsdp_version: 2"
    if dist_type == "DEEPSPEED":
        plugin = accelerator.state.deepspeed_plugin
        return config_problem(getattr(plugin, "deepspeed_config", None))
    return f"distributed type {dist_type} (tested: DDP, FSDP2 and DeepSpeed ZeRO stages 0-3)"


class CompletionLayout(NamedTuple):
    """TRL's ``[B, C]`` completion columns inside logitless' ``[B, P + C]`` logits alignment.

    >>> layout = CompletionLayout(prompt=2, completion=3)
    >>> layout.to_full(torch.tensor([[1.0, 2.0, 3.0]]))
    tensor([[0., 1., 2., 3., 0.]])
    >>> layout.response_mask(torch.tensor([[1, 1, 0]]))
    tensor([[False, False,  True,  True, False]])
    """

    prompt: int  # P: padded prompt length
    completion: int  # C: padded completion length

    def to_full(self, x: torch.Tensor, fill: float = 0) -> torch.Tensor:
        """[B, C, ...] -> [B, P + C, ...], column j at P - 1 + j (``fill`` elsewhere)."""
        out = x.new_full((x.shape[0], self.prompt + self.completion, *x.shape[2:]), fill)
        out[:, self.prompt - 1 : self.prompt - 1 + self.completion] = x
        return out

    def to_trl(self, x: torch.Tensor) -> torch.Tensor:
        """[B, P + C, ...] -> [B, C, ...]."""
        return x[:, self.prompt - 1 : self.prompt - 1 + self.completion]

    def response_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """[B, C] loss mask -> [B, P + C] bool over input_ids (True at scored tokens)."""
        full = torch.zeros(mask.shape[0], self.prompt + self.completion, dtype=torch.bool)
        full = full.to(mask.device)
        full[:, self.prompt :] = mask.bool()
        return full


def completion_batch(inputs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A TRL trainer's micro-batch as the HF functions take it: ``input_ids`` and
    ``attention_mask`` ``[B, P + C]`` (prompt then completion) and the ``[B, C]`` loss mask
    (``completion_mask``, times ``tool_mask`` when present)."""
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    mask = inputs["completion_mask"]
    if "tool_mask" in inputs:
        mask = mask * inputs["tool_mask"]
    return input_ids, attention_mask, mask
