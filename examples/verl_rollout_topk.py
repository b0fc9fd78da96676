"""verl (0.9, ``impl_backend=logitless``): a recipe's engine that passes the rollout's top-k
log-probs to logitless's forward and keeps the rollout-mismatch diagnostics it returns
(docs/rollout-mismatch.md, "verl"). verl's own vLLM rollout asks for the sampled token's
log-prob only; a rollout of your own that keeps the engine's top-k stores it per sequence as
``rollout_topk_ids`` / ``rollout_topk_logprobs`` (nested ``[T_i, k]``, row ``t`` the engine's
top-k of the distribution token ``t`` was sampled from, -1 where there is none).

Use this class where your recipe builds verl's FSDP engine (``FSDPEngineWithLMHead``); its
micro-batches' ``model_output["rollout_mismatch"]`` then hold a
:class:`logitless.types.RolloutMismatch` (as a dict) over the packed row, for
:func:`logitless.losses.rollout_mismatch_metrics`. Tested through verl's ``forward_step`` in
``tests/verl_backend/test_rollout_diagnostics_verl.py`` (remove-padding micro-batches).
"""

# [recipe]
import verl.workers.engine.fsdp.transformer_impl as impl

import logitless


class RolloutTopKEngine(impl.FSDPEngineWithLMHead):
    def prepare_model_inputs(self, micro_batch):
        model_inputs, output_args = super().prepare_model_inputs(micro_batch)
        if "rollout_topk_ids" in micro_batch.keys():  # noqa: SIM118 (a TensorDict)
            # the remove-padding layout, rolled by one like verl's shift_labels
            ids = micro_batch["rollout_topk_ids"].values().roll(-1, 0)[None]
            lps = micro_batch["rollout_topk_logprobs"].values().roll(-1, 0)[None]
            model_inputs["rollout_topk"] = logitless.RolloutTopK(ids, lps)
        return model_inputs, output_args

    def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func):
        out = super().prepare_model_outputs(output, output_args, micro_batch, logits_processor_func)
        found = getattr(output, "rollout_mismatch", None)
        if found is not None:  # a dict: verl's engine maps the output's dicts and tensors
            out["rollout_mismatch"] = found._asdict()
        return out


# [/recipe]
