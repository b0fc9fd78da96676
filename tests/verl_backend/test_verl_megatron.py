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
import torch
from _dist import spawn

pytest.importorskip("megatron.core", reason="verl's Megatron engine needs megatron-core")

V = 130  # a multiple of the tensor-parallel size
SEQS = [[5, 6, 7, 8, 9, 3, 2], [10, 11, 12], [13, 14, 15, 16, 1], [40, 41], [50, 51, 52, 53]]


def _nested(seqs):
    return torch.nested.nested_tensor([torch.tensor(s) for s in seqs], layout=torch.jagged)


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _worker(rank, world, tp, sp, tied, temperature):
    import _megatron_shim as shim
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
    for m in (model, truth_model):  # verl's engine passes position_ids=None (its models use
        m.embedding.add_position_embedding = False  # rope); the shim's attention needs none
    n = sum(map(len, SEQS))
    gen = torch.Generator().manual_seed(1)
    g, e = torch.randn(n, generator=gen), torch.randn(n, generator=gen)

    def processor(logits, label, temperature):  # verl's _lm_head_logits_processor, in short
        temperature = temperature.clamp(min=1e-8)  # verl's: the padding's temperature is 0
        logits = logits / temperature.unsqueeze(-1).to(logits.dtype)
        logits_bak = logits.clone()  # verl's order: the entropy works on the logits in place
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
    patch_fused_forward(model)  # verl's own patch: the function it installs is logitless's
    assert model.forward.__func__ is lv.megatron_forward
    result["logitless"] = step(model, fused, torch.float32)
    assert model.forward.__func__ is lv.megatron_forward  # still verl's instance patch
    return result


CASES = {
    "1 rank": (1, False, False, 1.0),
    "TP2 + sequence parallel, T=0.7": (2, True, False, 0.7),
    "TP2, tied embedding": (2, False, True, 1.0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_megatron_engine_fused_forward_matches_verl_unfused(case):
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
