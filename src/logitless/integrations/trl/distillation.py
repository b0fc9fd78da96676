"""TRL's ``DistillationTrainer`` on logitless: the same on-policy distillation, exact, without
either model's ``[tokens, vocab]`` logits or TRL's chunked tiles.

Switching is one line::

    from logitless.integrations.trl import LogitlessDistillationTrainer as DistillationTrainer

``LogitlessDistillationTrainer`` is a ``trl.DistillationTrainer`` whose loss runs on
:func:`logitless.integrations.hf.causal_lm_divergence`: the student's backbone inside the
student wrapper's forward (DDP / FSDP2 as for ``model(...)``), the teacher's under
``torch.no_grad()`` inside its own, then :func:`logitless.linear_divergence` with TRL's
``beta`` (0: forward KL, 1: reverse KL, else the generalized JSD) and ``temperature``, each
model's own soft-capping and logit scale. The loss is TRL's: the divergence summed over the
completion tokens (``completion_mask``, times ``tool_mask`` when present) and divided by
``num_items_in_batch / processes`` in training (TRL's count over the generated completions),
else by the local token count; the logged ``entropy`` is the student's mean per-token entropy
over the processes. Generation, logging and the optimizer loop stay TRL's. (A subclass of your
own gets the same from :class:`LogitlessDistillationMixin`.)

Mixed precision: with ``bf16=True`` (TRL's default) stock TRL computes this loss outside the
accelerator's autocast (its forward redirection replaces the forward accelerate wraps in
autocast), so both models and heads run in their own dtype; so does this trainer.

Vision-language models (the classes :mod:`logitless.integrations.hf` audits) run with the
micro-batch's image inputs passed to both backbones by their own names, as TRL passes them;
each model's head follows its own class's forward (Gemma-3's ``Gemma3ForConditionalGeneration``
applies no soft-capping, where TRL's chunked loss reads ``final_logit_softcapping`` from the
text config and would apply it).

Refused before training (``ValueError`` naming the reason): models outside
:data:`logitless.integrations.hf.SUPPORTED_MODELS` (student or teacher), image inputs of
classes logitless does not audit, FSDP1, DeepSpeed's offload and ZeRO++ partitions (ZeRO
stages 0-3 run). Tested with TRL 1.16
(tests/test_trl_distill.py, tests/test_trl_vlm.py).
"""

from __future__ import annotations

from typing import Any

import torch

from ...contract.checks import check_flag
from .. import hf
from .common import CompletionLayout, completion_batch, distributed_problem

try:
    from trl import DistillationTrainer
except ImportError as e:  # pragma: no cover - exercised only without TRL
    raise ImportError(
        "logitless.integrations.trl needs TRL: pip install -e '.[trl]' in a logitless checkout"
    ) from e

__all__ = ["LogitlessDistillationMixin", "LogitlessDistillationTrainer", "check_distillation"]


# The multimodal fields of a micro-batch TRL 1.16's DistillationTrainer passes to both models
_MULTIMODAL = (
    "pixel_values", "image_grid_thw", "pixel_attention_mask", "spatial_shapes", "image_sizes",
    "token_type_ids", "mm_token_type_ids", "image_position_ids",
)  # fmt: skip


def _unsupported(what: str, reason: str) -> ValueError:
    return ValueError(
        f"LogitlessDistillationTrainer cannot honour {what}: {reason}. Use "
        "trl.DistillationTrainer for this run, or change it."
    )


def check_distillation(trainer: DistillationTrainer) -> None:
    """Every check of a distillation trainer's setup; ``ValueError`` naming the first problem.

    :class:`LogitlessDistillationMixin` calls it at the end of ``__init__`` and at each loss.
    """
    if trainer.teacher_model is None:
        raise _unsupported("a run without a teacher model", "the divergence needs its head")
    problem = distributed_problem(trainer.accelerator)  # the GRPO trainer's rule too
    if problem is not None:
        raise _unsupported("this distributed setup", problem)
    for name, model in (("model", trainer.model), ("teacher_model", trainer.teacher_model)):
        try:
            hf.check_model(model)
        except ValueError as e:
            raise _unsupported(f"this {name}", str(e)) from None
    if not 0.0 <= float(trainer.beta) <= 1.0:
        raise _unsupported(f"beta={trainer.beta}", "the generalized JSD needs 0 <= beta <= 1")


class LogitlessDistillationMixin:
    """Put before ``trl.DistillationTrainer`` (or your subclass of it) in the bases to run its
    loss on logitless::

        class MyTrainer(LogitlessDistillationMixin, MyDistillationTrainer): ...

    It overrides ``compute_loss``; generation and everything else stay the trainer's own.
    ``batch_invariant=True`` (its one keyword of its own) runs the divergence in logitless's
    batch-invariant mode (docs/head.md#batch-invariance).
    """

    def __init__(self, *args: Any, batch_invariant: bool = False, **kwargs: Any) -> None:
        self.logitless_batch_invariant = check_flag("batch_invariant", batch_invariant)
        super().__init__(*args, **kwargs)
        check_distillation(self)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        check_distillation(self)
        if self.model.training and inputs.get("num_items_in_batch") is not None:
            # TRL's count over the generated completions, per process (DDP averages)
            num_items_in_batch = inputs["num_items_in_batch"].clamp(min=1.0)
            num_items_in_batch = num_items_in_batch / self.accelerator.num_processes
        input_ids, attention_mask, mask = completion_batch(inputs)
        layout = CompletionLayout(inputs["prompt_ids"].shape[1], inputs["completion_ids"].shape[1])
        response = layout.response_mask(mask)  # the tokens whose prediction counts
        self.teacher_model.eval()
        # No accelerator.autocast() here: stock TRL runs its whole loss through its forward
        # redirection, which swaps out the forward accelerate wraps in autocast, so under
        # bf16=True both backbones and heads run in the models' own dtype. So does this call
        # (run_in_forward borrows the forward the same way).
        # A vision-language micro-batch's image inputs (TRL splits them to it), to both
        # backbones; hf refuses those of a class it does not audit.
        images = {k: inputs[k] for k in _MULTIMODAL if inputs.get(k) is not None}
        out = hf.causal_lm_divergence(
            model, self.teacher_model, input_ids, attention_mask=attention_mask,
            response_mask=response, beta=float(self.beta),
            temperature=float(self.temperature), with_entropy=True,
            batch_invariant=self.logitless_batch_invariant, **images,
        )  # fmt: skip
        valid = mask.sum()  # TRL's count of the loss's tokens
        loss = out.divergence.sum()
        if num_items_in_batch is None:
            loss = loss / valid.clamp(min=1)
        else:
            loss = loss / torch.as_tensor(num_items_in_batch, device=loss.device)
        self._logitless_log(out.entropy.detach().sum(), valid)
        return (loss, None) if return_outputs else loss

    def _logitless_log(self, entropy_sum: torch.Tensor, valid: torch.Tensor) -> None:
        """TRL's ``entropy`` metric: the student's mean per-token entropy over the processes."""
        mode = "train" if self.model.training else "eval"
        tokens = self.accelerator.gather_for_metrics(valid).sum()
        entropy_sum = self.accelerator.gather_for_metrics(entropy_sum).sum()
        entropy = (entropy_sum / tokens).item() if tokens > 0 else 0.0
        self._metrics[mode]["entropy"].append(entropy)


class LogitlessDistillationTrainer(LogitlessDistillationMixin, DistillationTrainer):
    """``trl.DistillationTrainer`` with its loss computed by logitless (see the module doc)."""
