"""HF transformers causal LMs: per-token log-probs and policy losses, never the logits path.

``model(input_ids, ...).logits`` projects *every* position of the batch through the LM head,
``[B, T, V]`` in the model's dtype, before anything selects the tokens you train on. The
functions here run the model's backbone instead (``model.model``: embeddings, decoder layers
and the final norm), then hand the final hidden states and the head's own parameters to
:func:`logitless.linear_logprobs` / :func:`logitless.fused_policy_loss`. No model code is
patched and ``lm_head`` is never called; gradients reach every parameter of the model,
including an input embedding tied to the head (its two gradients sum into one ``.grad``).

**Which models.** Only classes whose ``forward`` has been read and whose results the tests
compare with ``model(...).logits`` (see :data:`SUPPORTED_MODELS`): the logits are
``lm_head(final hidden states)``, plus Gemma-2/3's final-logit soft-capping (passed to the op
as ``softcap``) or Cohere's / Granite's constant logit scale (passed as ``logit_scale``); the
mixture-of-experts models (Qwen2-MoE, Qwen3-MoE, Mixtral) add their router's load-balancing
loss to :func:`causal_lm_policy_loss` as their forward does. The vision-language classes
(Qwen2-VL, Qwen2.5-VL, Qwen3-VL and its MoE, Gemma-3, LLaVA:
:mod:`~logitless.integrations.hf.vlm`) take their image inputs by their own names in
``**model_kwargs`` and Qwen's multimodal ``[3, B, T]`` position ids; their head is the same.
Anything else, including a subclass that overrides ``forward`` and a head that is not a
plain ``nn.Linear`` (LoRA on ``lm_head``, quantized heads), is refused with ``ValueError``
rather than risk different numbers.

**Wrapped models.** ``DistributedDataParallel``, FSDP2 (``fully_shard``) and PEFT LoRA models
are accepted as they are: the backbone and the head run inside the outermost wrapper's
forward (:func:`run_in_forward`), so gradients are reduced as for ``model(...)``; so are
DeepSpeed engines (under ZeRO-3 the head gathers its own weight:
:mod:`logitless.integrations.deepspeed`). FSDP1 and DeepSpeed offload are refused
(:mod:`logitless.integrations.wrappers`).

**Alignment.** Results have ``input_ids``' shape ``[B, T]`` and are aligned like HF's logits:
position ``t`` holds ``log p(target_ids[:, t] | input_ids[:, :t + 1])``, with the default
targets ``target_ids[:, t] = input_ids[:, t + 1]`` (:func:`causal_lm_labels`). Positions
without a target are 0.0 and cost nothing: they are dropped before the head projection. The
targets are named ``target_ids``, not ``labels``: transformers' ``labels`` are *unshifted*
(``model(input_ids, labels=input_ids)`` shifts them itself), so ``labels=`` is refused with
that explanation; ``causal_lm_labels(hf_labels)`` turns HF-style labels into targets.

**Keyword arguments.** logitless's options are named parameters of each function;
``**model_kwargs`` are the backbone's own arguments and nothing else (transformers' backbones
drop names they do not know). A name that logitless knows (a parameter of any of its public
functions or classes: ``top_k``, ``capturable``, ``teacher_softcap``, ``distill_beta``, ...)
and the called function does not take raises ``TypeError`` naming it.

**Padding and packing.** Labels never cross a padding token (``attention_mask == 0``) or a
document boundary (``position_ids`` restarting at 0, or ``cu_seqlens``). Whether *attention*
keeps the documents of a packed row apart is the model's business, not logitless': in
transformers 5, sdpa / eager / flash attention do when a row's ``position_ids`` restart at 0,
no ``attention_mask`` is given and no KV cache is used (the backbone runs with
``use_cache=False`` here, as training does); with an ``attention_mask`` they do not. Either
way the head gives exactly what ``model(..., use_cache=False).logits`` would for the same
arguments.

**How it is built** (docs/development.md, "One seam for every integration"): the package's
:mod:`~logitless.integrations.hf.functions` holds the public entry points (re-exported here),
which check their arguments and run the work as the outermost wrapper's forward;
:mod:`~logitless.integrations.hf.model` says what an audited model hands the head (its
:class:`~logitless.integrations.seam.Head`, the backbone call, the MoE router loss),
:mod:`~logitless.integrations.hf.batch` builds the targets, and
:mod:`~logitless.integrations.hf.forward` runs the head on them through the seam
(:mod:`~logitless.integrations.seam`), and :mod:`~logitless.integrations.hf.vlm` audits the
vision-language classes.
"""

from . import functions
from .functions import *  # noqa: F403  (the public entry points, listed in functions.__all__)

__all__ = list(functions.__all__)
