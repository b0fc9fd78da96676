"""What the two tests of verl's Megatron engine share (test_verl_megatron.py: its legacy mode on
megatron-core < 0.18; test_verl_megatron_hook.py: its hook mode on 0.18+): the packed batch, one
rank's run of verl's unfused path on the model and on a float64 copy and of verl's fused path
after verl's own ``patch_fused_forward``, and the three-way comparison of a case."""

from __future__ import annotations

import torch
from _dist import spawn

V = 130  # a multiple of the tensor-parallel size
SEQS = [[5, 6, 7, 8, 9, 3, 2], [10, 11, 12], [13, 14, 15, 16, 1], [40, 41], [50, 51, 52, 53]]
CASES = {
    "1 rank": (1, False, False, 1.0),
    "TP2 + sequence parallel, T=0.7": (2, True, False, 0.7),
    "TP2, tied embedding": (2, False, True, 1.0),
}


def _nested(seqs):
    return torch.nested.nested_tensor([torch.tensor(s) for s in seqs], layout=torch.jagged)


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _worker(rank, world, tp, sp, tied, temperature, patched):
    """verl's unfused path on the model and on its float64 copy, then ``patched(model, run)``:
    the mode's checks around ``run()``, which patches nothing itself and runs verl's fused
    path (``fused_forward_model_engine``) on the model."""
    import _megatron_shim as shim
    from verl.models.mcore.model_forward import gptmodel_forward_model_engine
    from verl.models.mcore.model_forward_fused import fused_forward_model_engine
    from verl.utils.megatron.tensor_parallel import (
        vocab_parallel_entropy,
        vocab_parallel_log_probs_from_logits,
    )

    import logitless.integrations.verl  # noqa: F401  (what external_lib does in each worker)

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

    return {
        "truth": step(truth_model, unfused, torch.float64),
        "unfused": step(model, unfused, torch.float32),
        "logitless": patched(model, lambda: step(model, fused, torch.float32)),
    }


def check_case(case: str, patched) -> None:
    """``CASES[case]`` on its ranks: logitless's log-probs, entropy and every parameter's
    gradient (this rank's shards) within the tolerance of verl's unfused path against float64
    (tests/_tolerance.py). ``patched``: see :func:`_worker` (a module-level function: it goes
    to the spawned ranks)."""
    from _tolerance import assert_no_worse_than_reference

    tp, sp, tied, temperature = CASES[case]
    for rank, r in enumerate(spawn(_worker, tp, tp, sp, tied, temperature, patched)):
        truth, ref, ours = r["truth"], r["unfused"], r["logitless"]
        assert ours[0].dtype == torch.float32 and ours[1].dtype == torch.float32
        for i, what in enumerate(("log_probs", "entropy")):
            assert_no_worse_than_reference(ours[i], ref[i], truth[i], f"{what}, rank {rank}")
        assert ours[2].keys() == truth[2].keys()
        for name in truth[2]:
            assert_no_worse_than_reference(
                ours[2][name], ref[2][name], truth[2][name], f"grad {name}, rank {rank}"
            )
