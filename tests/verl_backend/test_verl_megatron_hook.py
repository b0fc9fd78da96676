"""logitless as the head of verl's Megatron engine in its hook mode (verl 0.9, megatron-core 0.18+
on Python 3.12: .ci/megatron.sh), on CPU gloo.

Where ``GPTModel.forward`` takes an ``output_processor``, verl's ``patch_fused_forward`` leaves the
model's forward alone and its ``fused_forward_model_engine`` calls the model with
``output_processor=fused_output_processor`` (looked up in its module at each call).
Importing ``logitless.integrations.verl`` puts :func:`megatron_output_processor` in that
function's place. As tests/verl_backend/test_verl_megatron.py does for the legacy mode, each case
runs verl's own ``fused_forward_model_engine`` on a tiny ``GPTModel`` against verl's unfused
Megatron path (``gptmodel_forward_model_engine`` with its logits processor) on the same model and
on a float64 copy: log-probs, entropy and every parameter's gradient within 4x the fp32 path's
error against float64 (tests/_tolerance.py). verl's own fused processor needs its Triton kernel,
which has no CPU path, so it is not run here.
"""

from __future__ import annotations

import inspect

import pytest

pytest.importorskip("megatron.core", reason="verl's Megatron engine needs megatron-core")

from megatron.core.models.gpt import GPTModel  # noqa: E402

if "output_processor" not in inspect.signature(GPTModel.forward).parameters:
    pytest.skip(
        "megatron-core < 0.18: verl runs its legacy mode (tests/verl_backend/"
        "test_verl_megatron.py); the hook mode runs in .ci/megatron.sh",
        allow_module_level=True,
    )

from _verl_megatron import CASES, check_case  # noqa: E402


def _hook_mode(model, run):
    """verl's own patch leaves the forward alone; its fused run reaches logitless's
    output_processor through output_layer's forward (its pre-hook, the distributed optimizer's
    gather, fires once)."""
    import verl.models.mcore.model_forward_fused as fused_module
    from verl.models.mcore.model_forward_fused import patch_fused_forward

    import logitless.integrations.verl as lv

    assert lv.megatron_installed()
    assert fused_module.fused_output_processor is lv.megatron_output_processor
    forward = model.forward
    patch_fused_forward(model)  # verl's own: hook mode, the forward is left alone
    assert model.forward == forward
    seen = []
    handle = model.output_layer.register_forward_pre_hook(lambda mod, args: seen.append(1))
    result = run()
    handle.remove()
    assert seen == [1], seen
    return result


@pytest.mark.parametrize("case", list(CASES))
def test_megatron_engine_hook_mode_matches_verl_unfused(case):
    check_case(case, _hook_mode)


def test_hook_mode_refuses_by_name():
    import verl.models.mcore.model_forward_fused as fused

    import logitless.integrations.verl as lv

    assert fused.fused_output_processor is lv.megatron_output_processor
    with pytest.raises(ValueError, match="inference_context.*use_fused_kernels=False"):
        fused.fused_output_processor(
            hidden_states=None, output_layer=None, labels=None, context=None, config=None,
            inference_context=object(),
        )  # fmt: skip
    lv.uninstall_megatron()
    try:
        assert fused.fused_output_processor.__module__ == fused.__name__
    finally:
        lv.install_megatron()
