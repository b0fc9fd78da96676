"""megatron-core: the head of a ``GPTModel`` without its logits.

For the last pipeline stage of a megatron-core ``GPTModel`` (tested with 0.16 and 0.19), per-token
log-probs, entropy, the fused policy loss and the divergence to a teacher ``GPTModel``, from
the decoder's final hidden states and ``output_layer``'s weight shard; the ``[S, B, V/tp]``
logits never exist. The model runs its own forward (embedding, decoder, final norm) and, where
it would call ``output_layer(hidden_states, weight=...)``, the head runs *as* that call
(:func:`logitless.integrations.seam.run_head`): ``output_layer``'s forward pre-hooks
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
tensor- and context-parallel groups together, before the model runs (the head call and the
loss's contract are checked first: :meth:`~.batch.Batch.prepare`).

The package, by concern: :mod:`~.model` (what logitless reads of a ``GPTModel``: its head,
groups and weight), :mod:`~.layout` (the batch's tokens and documents), :mod:`~.gradients`
(the weight gradient into ``main_grad``), :mod:`~.batch` (one micro-batch read, prepared and
run as ``output_layer``'s forward), :mod:`~.head` (the entry points) and :mod:`~.schedule`
(Megatron's pipeline schedule).
"""

from .gradients import main_grad_into
from .head import divergence, logprobs, output_processor_logprobs, policy_loss
from .layout import token_layout
from .model import MegatronHead, megatron_head
from .schedule import policy_loss_step, step_normalizer

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
