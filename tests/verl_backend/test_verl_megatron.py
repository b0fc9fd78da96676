"""logitless as the head of verl's Megatron engine (megatron-core 0.16, verl 0.9), on CPU gloo.

verl's Megatron engine, with ``use_fused_kernels=True``, gives each ``GPTModel`` its
``_fused_GPTModel_forward`` (``patch_fused_forward``) and calls verl's
``fused_forward_model_engine`` (pack the nested micro-batch into THD, roll the labels per
sequence, split for context parallelism, call the model, unpack). Importing
``logitless.integrations.verl`` puts :func:`megatron_forward` in that function's place. Each case
runs verl's own ``fused_forward_model_engine`` on a tiny ``GPTModel`` patched by verl's own
``patch_fused_forward``, against verl's unfused Megatron path (``gptmodel_forward_model_engine``
with the logits processor of its engine: ``vocab_parallel_log_probs_from_logits`` and
``vocab_parallel_entropy`` of the logits over the temperature) on the same model and on a
float64 copy (the truth): log-probs, entropy and every parameter's gradient (this rank's shards)
within 4x the fp32 path's error against float64 (tests/_tolerance.py). verl's own fused forward
needs its Triton kernel, which has no CPU path, so it is not run here.

The model is tests/_megatron_shim.py's (token-local attention, plain LayerNorm: Megatron's local
layer spec has no CPU attention for packed batches); verl's engine ``__init__`` (which builds the
model from a Hugging Face checkpoint) is not run.
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core", reason="verl's Megatron engine needs megatron-core")

from _verl_megatron import CASES, check_case  # noqa: E402


def _legacy_mode(model, run):
    """verl's own patch installs logitless's forward on the model; the fused run keeps it."""
    from verl.models.mcore.model_forward_fused import patch_fused_forward

    import logitless.integrations.verl as lv

    assert lv.megatron_installed()
    patch_fused_forward(model)  # verl's own patch: the function it installs is logitless's
    assert model.forward.__func__ is lv.megatron_forward
    result = run()
    assert model.forward.__func__ is lv.megatron_forward  # still verl's instance patch
    return result


@pytest.mark.parametrize("case", list(CASES))
def test_megatron_engine_fused_forward_matches_verl_unfused(case):
    check_case(case, _legacy_mode)


def test_megatron_switch_is_undone_and_refuses_by_name():
    import verl.models.mcore.model_forward_fused as fused

    import logitless.integrations.verl as lv

    assert lv.megatron_installed()
    lv.uninstall_megatron()
    try:
        assert not lv.megatron_installed()
        assert fused._fused_GPTModel_forward.__module__ == fused.__name__
        assert fused.fused_output_processor.__module__ == fused.__name__
    finally:
        lv.install_megatron()
    lv.install_megatron()  # idempotent: verl's functions are still what uninstall restores
    assert lv.megatron_installed()
    assert fused.fused_output_processor is lv.megatron_output_processor  # the hook mode's
    with pytest.raises(ValueError, match="inference_context.*use_fused_kernels=False"):
        fused.fused_output_processor(
            hidden_states=None, output_layer=None, labels=None, context=None, config=None,
            inference_context=object(),
        )  # fmt: skip
    model = type("Stage", (), {"config": object(), "post_process": True})()
    with pytest.raises(ValueError, match="inference_context.*use_fused_kernels=False"):
        lv.megatron_forward(model, None, None, None, inference_context=object())
