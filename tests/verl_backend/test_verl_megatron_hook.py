"""logitless as the head of verl's Megatron engine in its hook mode (verl 0.9, megatron-core 0.18+
on Python 3.12: .ci/verl312.sh), on CPU gloo.

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
import torch
from _dist import spawn

pytest.importorskip("megatron.core", reason="verl's Megatron engine needs megatron-core")

from megatron.core.models.gpt import GPTModel  # noqa: E402

if "output_processor" not in inspect.signature(GPTModel.forward).parameters:
    pytest.skip(
        "megatron-core < 0.18: verl runs its legacy mode (tests/verl_backend/"
        "test_verl_megatron.py); the hook mode runs in .ci/verl312.sh",
        allow_module_level=True,
    )

from test_verl_megatron import SEQS, V, _grads, _nested  # noqa: E402


def _worker(rank, world, tp, sp, tied, temperature):
    import _megatron_shim as shim
    import verl.models.mcore.model_forward_fused as fused_module
    from verl.models.mcore.model_forward import gptmodel_forward_model_engine
    from verl.models.mcore.model_forward_fused import (
        fused_forward_model_engine,
        patch_fused_forward,
    )
    from verl.utils.megatron.tensor_parallel import (
        vocab_parallel_entropy,
        vocab_parallel_log_probs_from_logits,
    )

    import logitless.integrations.verl as lv  # what external_lib does in each worker

    shim.init_parallel(tp=tp)
    kw = dict(tp=tp, sequence_parallel=sp, vocab=V, hidden=32, tied=tied)
    model = shim.gpt_model(**kw)
    truth_model = shim.gpt_model(**kw, dtype=torch.float64)
    with torch.no_grad():
        for p64, p in zip(truth_model.parameters(), model.parameters(), strict=True):
            p64.copy_(p)
    for m in (model, truth_model):  # verl's engine passes position_ids=None (rope models)
        m.embedding.add_position_embedding = False
    n = sum(map(len, SEQS))
    gen = torch.Generator().manual_seed(1)
    g, e = torch.randn(n, generator=gen), torch.randn(n, generator=gen)

    def processor(logits, label, temperature):  # verl's _lm_head_logits_processor, in short
        temperature = temperature.clamp(min=1e-8)
        logits = logits / temperature.unsqueeze(-1).to(logits.dtype)
        logits_bak = logits.clone()
        entropy = vocab_parallel_entropy(logits)
        return {
            "log_probs": vocab_parallel_log_probs_from_logits(logits_bak, label),
            "entropy": entropy,
        }

    def unfused(m):
        ids = _nested(SEQS)
        temp = torch.nested.nested_tensor(
            [torch.full((len(s),), temperature) for s in SEQS], layout=torch.jagged
        )
        out = gptmodel_forward_model_engine(
            m, ids, {}, logits_processor=processor,
            logits_processor_args={"label": ids.clone(), "temperature": temp},
            pad_token_id=0, data_format="thd",
        )  # fmt: skip
        return out["log_probs"].values(), out["entropy"].values()

    seen = []  # output_layer's forward pre-hook (the distributed optimizer's gather) fires

    def fused(m):
        ids = _nested(SEQS)
        out = fused_forward_model_engine(False)(
            model=m, input_ids=ids, labels=ids.clone(), multi_modal_inputs={},
            temperature=temperature, calculate_entropy=True, pad_token_id=0,
        )  # fmt: skip
        return out["log_probs"].values(), out["entropy"].values()

    def step(m, run, dtype):
        m.zero_grad(set_to_none=True)
        lp, ent = run(m)
        ((lp * g.to(dtype)).sum() + (ent * e.to(dtype)).sum()).backward()
        return lp.detach(), ent.detach(), _grads(m)

    result = {
        "truth": step(truth_model, unfused, torch.float64),
        "unfused": step(model, unfused, torch.float32),
    }
    assert lv.megatron_installed()
    assert fused_module.fused_output_processor is lv.megatron_output_processor
    forward = model.forward
    patch_fused_forward(model)  # verl's own: hook mode, the forward is left alone
    assert model.forward == forward
    handle = model.output_layer.register_forward_pre_hook(lambda mod, args: seen.append(1))
    result["logitless"] = step(model, fused, torch.float32)
    handle.remove()
    assert seen == [1], seen
    return result


CASES = {
    "1 rank": (1, False, False, 1.0),
    "TP2 + sequence parallel, T=0.7": (2, True, False, 0.7),
    "TP2, tied embedding": (2, False, True, 1.0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_megatron_engine_hook_mode_matches_verl_unfused(case):
    from _tolerance import assert_no_worse_than_reference

    tp, sp, tied, temperature = CASES[case]
    for rank, r in enumerate(spawn(_worker, tp, tp, sp, tied, temperature)):
        truth, ref, ours = r["truth"], r["unfused"], r["logitless"]
        assert ours[0].dtype == torch.float32 and ours[1].dtype == torch.float32
        for i, what in enumerate(("log_probs", "entropy")):
            assert_no_worse_than_reference(ours[i], ref[i], truth[i], f"{what}, rank {rank}")
        assert ours[2].keys() == truth[2].keys()
        for name in truth[2]:
            assert_no_worse_than_reference(
                ours[2][name], ref[2][name], truth[2][name], f"grad {name}, rank {rank}"
            )


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
