"""``head: {type: logitless}`` under Fast-LLM's tensor parallelism, on 2 gloo ranks.

Fast-LLM builds its process groups itself, as gloo backends over its own store, without
``torch.distributed.init_process_group`` (its ``ProcessGroupPool``); the ranks here are set up
exactly so (a ``file://`` rendezvous), and every model's ``Distributed`` takes its groups from
that pool. One launch runs every case, each with Fast-LLM's own head and the logitless head on
the same parameters (each rank holding its vocabulary shard, or its sequence shard):

- vocabulary parallel (``tensor_parallel: 2``): GRPO (basic metrics) and the label loss
  together, fp32 and bf16;
- vocabulary and sequence parallel (``sequence_tensor_parallel: true``; the head gathers the
  hidden states and reduce-scatters their gradient): GSPO, and distillation (reverse KL, a
  loss mask), the teacher handing its sequence shard;
- sequence parallel without a vocabulary split (``vocab_parallel: false``: each rank scores its
  own tokens with the whole weight; Fast-LLM all-reduces the head's loss): the label loss.

The parent compares each rank's results with a single-process float64 truth
(tests/fast_llm_backend/_fast_llm.py), within 4x Fast-LLM's own error (tests/_tolerance.py): the
head's loss and registered losses (the same on both ranks), this rank's input gradient (its
sequence shard under sequence parallelism), the final norm's weight gradient (summed over the
ranks where each holds a share) and the output weight's gradient (this rank's vocabulary rows,
or summed over the ranks without a vocabulary split). The metrics must match Fast-LLM's.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.multiprocessing as mp

pytest.importorskip(
    "fast_llm", reason="the Fast-LLM peer (../shared/peers/fast-llm) is not in this checkout"
)

from _fast_llm import Case, V, batch, build, run, truth  # noqa: E402
from _tolerance import assert_no_worse_than_reference  # noqa: E402
from test_fast_llm import GRPO, _close_metrics  # noqa: E402

TP = 2
KD = {"type": "distillation", "reference_model": "teacher", "loss_type": "reverse_kl"}
CASES = [
    (Case("vp-grpo+label", {"grpo": GRPO, "ce": {"type": "label", "weight": 0.5}}, scale=1.3), {}),
    (Case("vp-grpo-bf16", {"grpo": GRPO}, dtype=torch.bfloat16), {}),
    (Case("vp-sp-gspo", {"gspo": {"type": "gspo", "metrics": "basic"}}, softcap=5.0), {"sp": True}),
    (Case("vp-sp-distill", {"kd": KD}, loss_mask=True, teacher_softcap=3.0), {"sp": True}),
    (Case("sp-label", {"ce": {"type": "label"}}, scale=0.7), {"sp": True, "vp": False}),
]


def _layout(rank: int, case: Case, opts: dict):
    """This rank's vocabulary rows (None: all) and sequence shard (None: all)."""
    vp, sp = opts.get("vp", True), opts.get("sp", False)
    rows = slice(rank * V // TP, (rank + 1) * V // TP) if vp else None
    n = case.tokens // TP
    seq = slice(rank * n, (rank + 1) * n) if sp else None
    return rows, seq


def _rank_main(rank: int, tmp: str) -> None:
    from fast_llm.engine.distributed.config import DistributedBackend
    from fast_llm.engine.distributed.distributed import ProcessGroupPool

    torch.set_num_threads(1)
    pool = ProcessGroupPool(
        rank, TP, TP, timeout=120, init_method=f"file://{tmp}/init",
        backend=DistributedBackend.gloo, device=torch.device("cpu"),
    )  # fmt: skip
    results = []
    with pool:
        assert not torch.distributed.is_initialized()  # Fast-LLM's way: standalone groups
        for case, opts in CASES:
            dist = {
                "world_size": TP, "local_world_size": TP, "rank": rank, "tensor_parallel": TP,
                "backend": "gloo",
                "sequence_tensor_parallel": opts.get("sp", False),
            }  # fmt: skip
            rows, seq = _layout(rank, case, opts)
            b = batch(case)
            out = {}
            for logitless in (True, False):
                built = _build(case, logitless, dist, opts)
                out[logitless] = run(built, case, b, logitless, case.dtype, rows, seq)
            results.append(out)
    torch.save(results, os.path.join(tmp, f"rank{rank}.pt"))


def _build(case: Case, logitless: bool, dist: dict, opts: dict):
    if opts.get("vp", True):
        return build(case, logitless, case.dtype, dist)
    from _fast_llm import model_config  # vocab_parallel: false is an embeddings option

    config = model_config(case, logitless, case.dtype, dist)
    config = type(config).from_dict(
        config.to_dict(), {("base_model", "embeddings", "vocab_parallel"): False}
    )
    return _built_from(config)


def _built_from(config):
    from _fast_llm import Built
    from fast_llm.engine.distributed.distributed import Distributed
    from fast_llm.engine.multi_stage.config import StageConfig
    from fast_llm.engine.multi_stage.stage import Stage

    model_class = config.get_base_model_config_class()
    base = model_class.get_base_model(config.base_model, config.distributed)
    dist = Distributed(config.distributed)
    base.setup(dist)
    stage = Stage(
        config=StageConfig(), layers=[base.head], distributed_config=dist.config, index=0,
        tied_parameter_duplicates=(),
    )  # fmt: skip
    stage.setup(distributed=dist, tied_parameter_duplicate_buffers={})
    stage.initialize_weights()
    stage.restore_parameters()
    stage.reset_gradients()
    return Built([base.head], [stage], dist)


@pytest.fixture(scope="module")
def ranks():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank_main, args=(tmp,), nprocs=TP, join=True)
        return [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(TP)]


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c.name for c, _ in CASES])
def test_tensor_parallel_matches_fast_llm_and_float64(ranks, index):
    case, opts = CASES[index]
    b = batch(case)
    t = truth(case, b, 0, 1e-5)
    per_rank = [r[index] for r in ranks]
    for rank, out in enumerate(per_rank):
        rows, seq = _layout(rank, case, opts)
        mine, ref = out[True]["heads"][0], out[False]["heads"][0]
        _close_metrics(mine["losses"], ref["losses"], case.dtype)
        for name in ref["losses"]:
            want = t["loss"] if name == "lm_head_loss" else t["values"].get(name)
            if want is not None:
                assert_no_worse_than_reference(
                    mine["losses"][name], ref["losses"][name], want, f"rank {rank} {name}"
                )
        want = t["input"] if seq is None else t["input"][seq]
        assert_no_worse_than_reference(mine["input"], ref["input"], want, f"rank {rank} dx")
        if rows is not None:
            want = t["weight"][rows]
            assert_no_worse_than_reference(mine["weight"], ref["weight"], want, f"rank {rank} dW")
    for what in ("norm",) + (("weight",) if opts.get("vp", True) is False else ()):
        # each rank's share of a gradient over its own tokens: summed over the ranks
        shared = opts.get("sp", False)
        mine = [out[True]["heads"][0][what] for out in per_rank]
        ref = [out[False]["heads"][0][what] for out in per_rank]
        mine, ref = (sum(mine), sum(ref)) if shared else (mine[0], ref[0])
        assert_no_worse_than_reference(mine, ref, t[what], f"{what} grad")
