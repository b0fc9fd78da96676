"""logitless under FSDP1 (``strategy=fsdp``): verl's engine forward on a model wrapped by hand.

verl's own FSDP1 build (``FSDPEngine._build_fsdp_module``) passes ``sync_module_states=True``,
which FSDP1 only accepts with the parameters on an accelerator, so it cannot run on CPU. Here
each of 2 gloo ranks wraps the tiny Qwen2, after verl's ``apply_monkey_patch``, with
``torch.distributed.fsdp.FullyShardedDataParallel`` the way that build does otherwise: verl's
``get_fsdp_wrap_policy`` (one unit per decoder layer), its sharding strategy for a 1-D mesh
(``FULL_SHARD``), ``use_orig_params=False`` (verl's default), and either no mixed precision
(fp32) or verl's default ``MixedPrecision(param_dtype=bf16, reduce_dtype=fp32,
buffer_dtype=fp32)`` with the engine's bf16 autocast; ``device_id`` is the CPU and
``sync_module_states`` off (every rank builds the same weights from one seed).

Each rank runs verl's ``forward_step`` on a micro-batch of its own (data parallelism) and
backward; FSDP1 averages the gradients over the ranks. Checked against one process running the
unwrapped model on both micro-batches: the outputs of each rank and the averaged gradient of
every parameter (gathered through FSDP1's full state dict), within 4x the error of the naive
(unfused) path in the same precision against float64 (tests/_tolerance.py). ``lm_head`` as an
FSDP1 unit of its own (a wrap policy that wraps it, e.g. verl's size-based one) is refused by
name: the head must be a plain ``nn.Linear``, and FSDP1 puts a ``FullyShardedDataParallel`` in
its place.
"""

from __future__ import annotations

import pytest
import torch
from _dist import spawn
from _engine import cpu_devices, engine, forward_step, micro_batch, patched, tiny_model
from _tolerance import assert_no_worse_than_reference

RANK_SEQS = [
    [[5, 6, 7, 8, 9, 3, 2], [10, 11, 12], [40, 41]],
    [[13, 14, 15, 16, 1], [50, 51, 52, 53, 54, 55], [60, 61, 62]],
]
CASES = ("logitless", "torch", "unfused")
PRECISIONS = ("fp32", "bf16")


@pytest.fixture(autouse=True)
def _cpu(monkeypatch):
    cpu_devices(monkeypatch)


def _upstream(seqs, rank):
    gen = torch.Generator().manual_seed(10 + rank)
    n = sum(map(len, seqs))
    return torch.randn(n, generator=gen), torch.randn(n, generator=gen)


def _full_grads(module, grads):
    """Every original parameter's averaged gradient, whole, by name: FSDP1 with
    ``use_orig_params=False`` keeps each unit's gradient as a shard of its flat parameter;
    the shards are written into the flat parameters and read back through the full state dict
    (which gathers them under the original names)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    with torch.no_grad():
        for n, p in module.named_parameters():
            p.copy_(grads[n])
    with FSDP.state_dict_type(module, StateDictType.FULL_STATE_DICT):
        return {n: t.clone() for n, t in module.state_dict().items()}


def _fsdp1_worker(rank, world):
    return {p: _fsdp1_rank(rank, world, p) for p in PRECISIONS}


def _fsdp1_rank(rank, world, precision):
    import verl.workers.engine.fsdp.transformer_impl as impl
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision
    from torch.distributed.fsdp.wrap import CustomPolicy
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer
    from verl.utils.fsdp_utils import get_fsdp_wrap_policy
    from verl.workers.engine.fsdp.utils import get_sharding_strategy

    impl.get_device_id = lambda: "cpu"
    impl.get_device_name = lambda: "cpu"
    mesh = init_device_mesh("cpu", (world,))
    bf16 = precision == "bf16"
    mixed = MixedPrecision(torch.bfloat16, torch.float32, torch.float32) if bf16 else None
    model = tiny_model()
    seqs = RANK_SEQS[rank]
    g, e = _upstream(seqs, rank)
    out = {}

    def wrap(mod, policy):
        return FSDP(
            mod, auto_wrap_policy=policy, device_id=torch.device("cpu"),
            sharding_strategy=get_sharding_strategy(mesh), mixed_precision=mixed,
            device_mesh=mesh, use_orig_params=False,
        )  # fmt: skip

    for case in CASES:
        backend = None if case == "unfused" else case
        mod = patched(model, backend)
        mod = wrap(mod, get_fsdp_wrap_policy(mod))  # verl's policy: a unit per decoder layer
        eng = engine(mod, dtype=torch.bfloat16 if bf16 else torch.float32)
        batch = micro_batch(seqs, fused=backend is not None)
        lp, ent, grads = forward_step(eng, batch, g, e)
        out[case] = (lp, ent, _full_grads(mod, grads))
    # lm_head an FSDP1 unit of its own: FSDP1 replaces the module, refused at the forward
    mod = patched(model, "logitless")
    lm_head = mod.lm_head
    mod = wrap(mod, CustomPolicy(lambda m: m is lm_head or isinstance(m, Qwen2DecoderLayer)))
    assert isinstance(mod.lm_head, FSDP)
    try:
        forward_step(engine(mod), micro_batch(seqs))
    except ValueError as err:
        out["lm_head unit"] = str(err)
    return out


def _reference(dtype):
    """One process, the unwrapped model: each rank's outputs, the gradients averaged over the
    ranks (what FSDP1's reduce-scatter computes)."""
    import copy

    model = copy.deepcopy(tiny_model()).to(dtype)
    outs, grads = [], {}
    for rank, seqs in enumerate(RANK_SEQS):
        g, e = (t.to(dtype) for t in _upstream(seqs, rank))
        mod = patched(model, None)
        lp, ent, gr = forward_step(engine(mod), micro_batch(seqs, fused=False), g, e)
        outs.append((lp, ent))
        for n, t in gr.items():
            grads[n] = grads.get(n, 0) + t / len(RANK_SEQS)
    return outs, grads


def test_fsdp1_two_ranks_equal_the_unwrapped_model():
    ranks = spawn(_fsdp1_worker, 2)  # both precisions in one spawn: verl's import is slow
    truth, truth_grads = _reference(torch.float64)
    for precision in PRECISIONS:
        _check(precision, [r[precision] for r in ranks], truth, truth_grads)


def _check(precision, ranks, truth, truth_grads):
    one = None
    if precision == "fp32":  # the unwrapped model in one process, logitless's forward
        model = tiny_model()
        one = []
        for rank, seqs in enumerate(RANK_SEQS):
            g, e = _upstream(seqs, rank)
            mod = engine(patched(model, "logitless"))
            one.append(forward_step(mod, micro_batch(seqs), g, e)[:2])
    for rank, r in enumerate(ranks):
        ours = r["logitless"]
        for i, name in enumerate(("log_probs", "entropy")):
            assert ours[i].dtype == torch.float32, f"{name}: {ours[i].dtype}"
            refs = {"unfused under FSDP1": r["unfused"][i], "verl torch": r["torch"][i]}
            for ref_name, ref in refs.items():
                assert_no_worse_than_reference(
                    ours[i], ref, truth[rank][i], f"rank {rank} {name} ({ref_name})"
                )
            if one is not None:  # fp32: the wrapped forward is the unwrapped one, bit for bit
                torch.testing.assert_close(ours[i], one[rank][i], rtol=0, atol=0)
        # verl's torch backend sees the weights FSDP1 hands the forward: bf16 under its
        # default mixed precision, so its entropy is bf16 there (logitless's: fp32)
        want = torch.bfloat16 if precision == "bf16" else torch.float32
        assert r["torch"][1].dtype == want
        assert set(ours[2]) == set(truth_grads)
        for n, t in truth_grads.items():
            for ref_name in ("unfused", "torch"):
                ref = r[ref_name][2][n]
                assert_no_worse_than_reference(
                    ours[2][n], ref, t, f"rank {rank} grad {n} (reference: {ref_name})"
                )
        assert "model.lm_head must be a plain torch.nn.Linear" in r["lm_head unit"]
        assert "got FullyShardedDataParallel" in r["lm_head unit"]
