"""torchtitan: :class:`LogitlessLoss`, a ``ChunkedLossWrapper`` whose chunks never build logits.

torchtitan (0.3.x) computes its loss after the model's forward: with ``ChunkedLossWrapper`` as
``loss`` in a model's config, the trainer calls ``set_lm_head(model.lm_head)`` and sets the
model's ``_skip_lm_head``, so the model returns its final hidden states and the wrapper applies
``lm_head`` chunk by chunk, each chunk's ``[B, L/n, V/tp]`` logits handed to its inner loss
(``CrossEntropyLoss``, or the RL losses ``DAPOLoss`` / ``GRPOLoss``). :class:`LogitlessLoss` is a
``ChunkedLossWrapper`` (the trainer's ``isinstance`` check wires it the same way) whose
``__call__`` computes the same loss from the hidden states and the head's weight::

    from logitless.integrations.torchtitan import LogitlessLoss

    loss=LogitlessLoss.Config(loss_fn=CrossEntropyLoss.Config())    # was ChunkedLossWrapper.Config
    loss=LogitlessLoss.Config(loss_fn=GRPOLoss.Config(clip_eps=0.2))

What the inner losses compute, in torchtitan's terms (its ``labels``, ``IGNORE_INDEX``,
``global_valid_tokens``, ``generator_logprobs``, ``advantages``, ``loss_mask``):

- ``CrossEntropyLoss``: ``Σ −log p(label) / global_valid_tokens`` (the sum without it);
- ``DAPOLoss`` (and ``GRPOLoss``, its symmetric case): ``Σ −min(r A, clip(r, 1 − low, 1 + high)
  A) / max(global_valid_tokens, 1)`` over the ``loss_mask`` tokens with a finite generator
  log-prob, ``r = exp(log p − generator_logprobs)`` with DAPO's cap of the log-ratio at 10 where
  it matters (a negative advantage: the PPO dual clip at ``e^10``), and DAPO's metrics.

**Parallelism.** The head runs as ``lm_head``'s forward (:func:`seam.run_head`): an FSDP2
``lm_head`` gathers its weight around it and reduce-scatters its gradient as usual. Under
tensor parallelism with loss parallel the weight is a vocabulary shard: a DTensor ``Shard(0)``
(the ``partial_dtensor`` / ``full_dtensor`` backends) or a plain local shard (the default
``spmd_types`` backend, the tensor-parallel group of its current mesh); logitless takes the local
shard with a :class:`~logitless.VocabParallel` over that group (the ranks' row counts exchanged
once). The hidden gradient is left as each rank's share, as the wrapper's chunked backward leaves
it: a DTensor ``Partial`` on the tensor-parallel axis, or the plain partial gradient.

Bad input raises ``ValueError`` naming the option (``loss.loss_fn``, a missing loss input,
``debug.spmd_typechecking``) before the head runs.
"""

from __future__ import annotations

import functools
import math
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torchtitan.components.loss import IGNORE_INDEX, ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.config import CompileConfig

from ..contract.collectives import rank_and_size
from ..contract.options import HeadOptions
from ..contract.vocab import VocabParallel
from ..losses import PolicyLossConfig
from . import seam

__all__ = ["LogitlessLoss"]

# DAPO caps the log-ratio at ±10 before exp (torchtitan's _MAX_LOG_RATIO); where the cap changes
# the PPO loss (a negative advantage, r > e^10) it is the dual clip at e^10.
_DAPO_MAX_LOG_RATIO = 10.0
_DAPO = "torchtitan.experiments.rl.losses.dapo"

# The negative log-likelihood as a policy loss: CISPO's weight sg(clip(r, 1 - 0, 1 + 0)) is
# exactly 1, so with advantages 1 and old log-probs 0 the per-token loss is -log p (token-local:
# the fused path, three head matmuls).
_NLL = PolicyLossConfig(surrogate="cispo", clip_low=0.0, clip_high=0.0, aggregation="token_sum")


class LogitlessLoss(ChunkedLossWrapper):
    """torchtitan's chunked LM-head loss, computed by logitless (module docstring).

    ``num_chunks`` is accepted and unused: logitless tiles the vocabulary from its own memory
    budget, and its result does not depend on the tile. ``compile`` does not apply to it.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(ChunkedLossWrapper.Config):
        chunk_size: int | None = None
        """Tokens per pass of the head (its ``[chunk_size, V / tp]`` fp32 buffer is the peak
        beyond the gradients). None: logitless's own budget (on CPU 256 MiB: 441 tokens at
        V=151936). Smaller lowers the peak and streams the weight more often; the loss does not
        depend on it."""

    def __init__(self, config: Config, *, compile_config: CompileConfig | None = None) -> None:
        super().__init__(config, compile_config=compile_config)
        self._kind = _kind_of(self.loss_fn)
        self._options = HeadOptions(chunk_size=config.chunk_size)  # refuses a bad chunk_size
        self._vocab: dict[tuple, VocabParallel] = {}

    def __call__(
        self,
        pred: torch.Tensor,
        labels: torch.Tensor,
        global_valid_tokens: torch.Tensor | float | None = None,
        **loss_inputs: Any,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss and metrics of the inner loss from ``pred`` (the model's final hidden states
        ``[B, L, D]``: its forward skipped ``lm_head``) and ``labels`` ``[B, L]``."""
        if self.lm_head is None:
            raise ValueError("LogitlessLoss needs the model's lm_head: call set_lm_head first")
        _check_inputs(self._kind, loss_inputs)
        _refuse_typechecking()
        with torch.set_grad_enabled(torch.is_grad_enabled() and pred.requires_grad):
            return seam.run_head(
                self.lm_head, self._head, pred, labels, global_valid_tokens, loss_inputs,
                caller="LogitlessLoss",
            )  # fmt: skip

    def _head(self, pred, labels, global_valid_tokens, loss_inputs):
        """As ``lm_head``'s forward: its parameters (gathered by FSDP2) as local shards."""
        weight, vp = self._local_weight(self.lm_head.weight)
        bias = getattr(self.lm_head, "bias", None)
        bias = None if bias is None else _local(bias)
        hidden = _local_hidden(pred, vp is not None)
        labels = _local(labels)
        parallel = seam.Parallelism(vocab=vp)
        head = seam.Head(weight, bias)
        prepare = functools.partial(
            seam.prepare, head=head, options=self._options, parallel=parallel
        )
        if self._kind == "ce":
            return _cross_entropy(hidden, labels, head, prepare, global_valid_tokens)
        lo, hi = self.loss_fn.ratio_clip_low, self.loss_fn.ratio_clip_high
        inputs = {k: _local(v) for k, v in loss_inputs.items()}
        return _dapo(hidden, labels, head, prepare, global_valid_tokens, inputs, (lo, hi))

    def _local_weight(self, weight: torch.Tensor) -> tuple[torch.Tensor, VocabParallel | None]:
        """The weight rows this rank holds, and its :class:`VocabParallel` (None: all rows)."""
        group = None
        if isinstance(weight, DTensor):
            dims = [i for i, p in enumerate(weight.placements) if isinstance(p, Shard)]
            if any(weight.placements[i].dim != 0 for i in dims):
                raise ValueError(
                    f"lm_head.weight: a DTensor sharded along the vocabulary (Shard(0)) or "
                    f"replicated, got placements {weight.placements}"
                )
            if dims:
                group = weight.device_mesh.get_group(dims[0])
            weight = weight.to_local()
        elif (tp := _spmd_tp_group()) is not None:
            group = tp
        if group is None:
            return weight, None
        return weight, self._vocab_parallel(group, weight.shape[0])

    def _vocab_parallel(self, group, rows: int) -> VocabParallel:
        """The ranks' contiguous row ranges, from their row counts (one exchange per group and
        shard size, then kept)."""
        key = (group, rows)
        if key not in self._vocab:
            rank, size = rank_and_size(group)
            counts = [torch.zeros((), dtype=torch.int64) for _ in range(size)]
            torch.distributed.all_gather(counts, torch.tensor(rows), group=group)
            start = int(sum(int(c) for c in counts[:rank]))
            self._vocab[key] = VocabParallel(group, start, start + rows, reduce_hidden_grad=False)
        return self._vocab[key]


def _kind_of(loss_fn) -> str:
    if type(loss_fn) is CrossEntropyLoss:
        return "ce"
    dapo = sys.modules.get(_DAPO)
    if dapo is not None and isinstance(loss_fn, dapo.DAPOLoss):
        return "dapo"
    raise ValueError(
        f"loss.loss_fn: LogitlessLoss computes CrossEntropyLoss, DAPOLoss and GRPOLoss, got "
        f"{type(loss_fn).__name__} (use ChunkedLossWrapper for it)"
    )


_DAPO_INPUTS = ("advantages", "generator_logprobs", "loss_mask")


def _check_inputs(kind: str, loss_inputs: dict) -> None:
    expected = set(_DAPO_INPUTS) if kind == "dapo" else set()
    if set(loss_inputs) != expected:
        raise ValueError(
            f"LogitlessLoss with {'DAPOLoss/GRPOLoss' if kind == 'dapo' else 'CrossEntropyLoss'}"
            f" takes the loss inputs {sorted(expected)}, got {sorted(loss_inputs)}"
        )


def _refuse_typechecking() -> None:
    import spmd_types

    if spmd_types.is_type_checking():
        raise ValueError(
            "debug.spmd_typechecking: LogitlessLoss runs on local tensors and does not declare "
            "SPMD types; turn spmd_typechecking off (it is a debugging aid)"
        )


def _spmd_tp_group():
    """The tensor-parallel group of the ``spmd_types`` backend's current mesh, or None."""
    from torchtitan.distributed.spmd_types import current_spmd_mesh, spmd_mesh_size

    if spmd_mesh_size("tp") <= 1:
        return None
    return current_spmd_mesh().get_group("tp")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _local_hidden(pred: torch.Tensor, vocab_sharded: bool) -> torch.Tensor:
    """The hidden states as a local tensor. A DTensor replicated over the tensor-parallel axis
    gets each rank's share of the gradient back (``Partial``), as ``lm_head``'s own backward
    (ColwiseParallel) gives it."""
    if not isinstance(pred, DTensor):
        return pred
    grads = tuple(
        Partial() if vocab_sharded and isinstance(p, Replicate) else p for p in pred.placements
    )
    return pred.to_local(grad_placements=grads)


def _cross_entropy(hidden, labels, head, prepare, global_valid_tokens):
    """torchtitan's ``cross_entropy_loss`` (sum over labels != IGNORE_INDEX) over
    ``global_valid_tokens``. ``prepare(labels)``: ``seam.prepare`` with the head's options."""
    ones = torch.ones(labels.shape, device=labels.device)
    prepared = prepare(labels).with_loss(seam.LossInputs(ones * 0, ones), _NLL)
    loss, _ = seam.policy_loss(prepared, seam.Tokens(hidden, labels), head)
    if global_valid_tokens is not None:
        loss = loss / global_valid_tokens
    return loss, {}


def _dapo(hidden, labels, head, prepare, global_valid_tokens, inputs, clip):
    """DAPOLoss (GRPOLoss: ``low == high``): the token mask, the clipped surrogate, the sum over
    ``max(global_valid_tokens, 1)``, and DAPO's metrics from the pass's own log-probs."""
    gen, adv = inputs["generator_logprobs"], inputs["advantages"]
    mask = inputs["loss_mask"].bool() & torch.isfinite(gen)
    labels = torch.where(mask, labels, torch.full_like(labels, IGNORE_INDEX))
    old = torch.where(mask, gen, torch.zeros((), dtype=gen.dtype, device=gen.device)).float()
    config = PolicyLossConfig(
        clip_low=clip[0], clip_high=clip[1], dual_clip=math.exp(_DAPO_MAX_LOG_RATIO),
        aggregation="token_sum",
    )  # fmt: skip
    prepared = prepare(labels).with_loss(seam.LossInputs(old, adv.float()), config)
    prepared = prepared.with_entropy(True)
    value, _, out = seam.policy_loss_and_logprobs(prepared, seam.Tokens(hidden, labels), head)
    denom = 1 if global_valid_tokens is None else max(global_valid_tokens, 1)
    loss = value / denom
    with torch.no_grad():
        metrics = _dapo_metrics(out, old, mask, clip, denom)
    metrics["loss/mean"] = loss.detach()
    return loss, metrics


def _dapo_metrics(out, old, mask, clip, denom) -> dict[str, torch.Tensor]:
    """DAPOLoss's metrics (pre-normalized for a sum over data-parallel ranks)."""
    raw = torch.where(mask, out.logprobs - old, torch.zeros_like(old))
    ratio = raw.clamp(-_DAPO_MAX_LOG_RATIO, _DAPO_MAX_LOG_RATIO).exp()
    clipped = ratio.clamp(1 - clip[0], 1 + clip[1])
    m = mask.float()
    return {
        "loss/ratio_mean": (ratio * m).sum() / denom,
        "loss/ratio_clipped_frac": (((ratio - clipped).abs() > 1e-6).float() * m).sum() / denom,
        "bit_wise/logprob_diff/mean": raw.sum() / denom,
        "bit_wise/ratio_tokens_different/mean": ((raw.abs() > 1e-6).float() * m).sum() / denom,
        "bit_wise/logprob_diff/max": raw.abs().max(),
        "trainer/entropy/mean": (out.entropy * m).sum() / denom,
    }
