"""``LogitlessLoss`` under torchtitan's parallelisms, on 2 gloo ranks, against torchtitan's own
``ChunkedLossWrapper`` on the same ``lm_head`` and a float64 truth (tests/_tolerance.py).

One launch runs every case:

- tensor parallel with loss parallel, DTensor (torchtitan's ``partial_dtensor`` backend):
  ``lm_head`` parallelized ``ColwiseParallel(Replicate() -> Shard(-1))``, its weight a DTensor
  ``Shard(0)`` over an uneven vocabulary (49 + 48 rows), the hidden states a replicated DTensor:
  cross-entropy and GRPO. Each rank's gradient of the hidden states (after DTensor reduced the
  ``Partial`` the head returns) and of its weight shard.
- tensor parallel, ``spmd_types`` backend (torchtitan's default): plain local shards, the
  tensor-parallel group from the current SPMD mesh, ``CrossEntropyLoss.Config(global_vocab_size)``.
  Each rank's share of the hidden gradient (left unsummed, as the wrapper leaves it).
- FSDP2: ``fully_shard(lm_head)`` and the root, each rank its own batch (``global_valid_tokens``
  over both): the gradients of a decoder layer and of ``lm_head`` after FSDP's reduce-scatter.
"""

from __future__ import annotations

import pytest
import torch
from _dist import spawn
from _tolerance import assert_no_worse_than_reference
from _torchtitan import Case, CrossEntropyLoss, GRPOLoss, H, V, data, losses, run_loss, truth

TP = 2
ROWS = [slice(0, 49), slice(49, V)]  # torch's and torchtitan's split of 97 rows over 2 ranks
CE = Case("cross-entropy", CrossEntropyLoss.Config())
GRPO = Case("grpo", GRPOLoss.Config(clip_eps=0.2))


def _tp_dtensor(rank: int, case: Case) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    from torchtitan.distributed.utils import set_spmd_backend

    set_spmd_backend("partial_dtensor")
    mesh = init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",))
    d = data(case)
    out = {}
    for which, loss_fn in zip(("chunked", "logitless"), losses(case), strict=True):
        lm_head = torch.nn.Linear(H, V, bias=False)
        with torch.no_grad():
            lm_head.weight.copy_(d["weight"])
        plan = ColwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=False
        )
        parallelize_module(lm_head, mesh, plan)
        h = d["hidden"].float().requires_grad_()
        hidden = DTensor.from_local(h, mesh, [Replicate()])
        res = run_loss(loss_fn, lm_head, hidden, d["labels"], d["gvt"], d.get("inputs", {}), 1.0)
        res.update(hidden=h.grad, weight=lm_head.weight.grad.to_local())
        out[which] = res
    return out


def _tp_spmd_types(rank: int, case: Case) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed.spmd_types import set_current_spmd_mesh
    from torchtitan.distributed.utils import set_spmd_backend

    set_spmd_backend("spmd_types")
    mesh = init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",))
    d = data(case)
    inner = CrossEntropyLoss.Config(global_vocab_size=V)
    case = Case(case.name, inner)
    out = {}
    with set_current_spmd_mesh(mesh):
        for which, loss_fn in zip(("chunked", "logitless"), losses(case), strict=True):
            rows = ROWS[rank]
            lm_head = torch.nn.Linear(H, rows.stop - rows.start, bias=False)
            with torch.no_grad():
                lm_head.weight.copy_(d["weight"][rows])
            h = d["hidden"].float().requires_grad_()
            res = run_loss(loss_fn, lm_head, h, d["labels"], d["gvt"], {}, 1.0)
            out[which] = res | {"hidden": h.grad, "weight": lm_head.weight.grad}
    return out


class _Tiny(torch.nn.Module):
    """A decoder layer and an ``lm_head`` the forward skips (torchtitan's ``_skip_lm_head``)."""

    def __init__(self, d: dict) -> None:
        super().__init__()
        self.decoder = torch.nn.Linear(H, H, bias=False)
        self.lm_head = torch.nn.Linear(H, V, bias=False)
        with torch.no_grad():
            self.decoder.weight.copy_(torch.eye(H) + 0.1 * d["weight"][:H])
            self.lm_head.weight.copy_(d["weight"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(x)


def _fsdp(rank: int, case: Case) -> dict:
    from torch.distributed.fsdp import fully_shard
    from torchtitan.distributed.utils import set_spmd_backend

    set_spmd_backend("partial_dtensor")
    d = data(case, seed=rank)  # each rank its own batch
    gvt = sum(data(case, seed=r)["gvt"] for r in range(TP))
    out = {}
    for which, loss_fn in zip(("chunked", "logitless"), losses(case), strict=True):
        model = _Tiny(data(case))  # the same parameters on every rank
        fully_shard(model.lm_head)
        fully_shard(model)
        pred = model(d["hidden"].float())
        res = run_loss(loss_fn, model.lm_head, pred, d["labels"], gvt, {}, 1.0)
        res["decoder"] = model.decoder.weight.grad.full_tensor()
        res["weight"] = model.lm_head.weight.grad.full_tensor()
        out[which] = res
    return out


def _worker(rank: int, world: int) -> dict:
    return {
        "tp-dtensor-ce": _tp_dtensor(rank, CE),
        "tp-dtensor-grpo": _tp_dtensor(rank, GRPO),
        "tp-spmd-types-ce": _tp_spmd_types(rank, CE),
        "fsdp-ce": _fsdp(rank, CE),
    }


@pytest.fixture(scope="module")
def ranks():
    return spawn(_worker, TP)


@pytest.mark.parametrize("case", [CE, GRPO], ids=lambda c: c.name)
def test_tensor_parallel_dtensor(ranks, case):
    want = truth(case, data(case))
    for rank, out in enumerate(ranks):
        mine, ref = out[_key(case)]["logitless"], out[_key(case)]["chunked"]
        assert_no_worse_than_reference(mine["loss"], ref["loss"], want["loss"], "loss")
        assert_no_worse_than_reference(mine["hidden"], ref["hidden"], want["hidden"], "dh")
        w = want["weight"][ROWS[rank]]
        assert_no_worse_than_reference(mine["weight"], ref["weight"], w, f"rank {rank} dW")


def _key(case: Case) -> str:
    return "tp-dtensor-ce" if case is CE else "tp-dtensor-grpo"


def test_tensor_parallel_spmd_types(ranks):
    want = truth(CE, data(CE))
    per = [out["tp-spmd-types-ce"] for out in ranks]
    for rank, out in enumerate(per):
        mine, ref = out["logitless"], out["chunked"]
        assert_no_worse_than_reference(mine["loss"], ref["loss"], want["loss"], "loss")
        w = want["weight"][ROWS[rank]]
        assert_no_worse_than_reference(mine["weight"], ref["weight"], w, f"rank {rank} dW")
        torch.testing.assert_close(mine["hidden"], ref["hidden"], rtol=1e-4, atol=1e-6)
    summed = [sum(out[k]["hidden"] for out in per) for k in ("logitless", "chunked")]
    assert_no_worse_than_reference(*summed, want["hidden"], "dh summed over the ranks")


def test_fsdp2(ranks):
    """FSDP averages the two ranks' gradients: the truth is the mean of each rank's float64
    gradient of its own loss (over the global valid-token count)."""
    gvt = sum(data(CE, seed=r)["gvt"] for r in range(TP))
    grads = {"decoder": 0.0, "weight": 0.0}
    for r in range(TP):
        d = data(CE, seed=r)
        d["gvt"] = gvt
        shared = data(CE)
        dec = (torch.eye(H, dtype=torch.float64) + 0.1 * shared["weight"][:H]).requires_grad_()
        x = d["hidden"].float().double()
        d["hidden"] = (x @ dec.T).detach()
        d["weight"] = shared["weight"]
        t = truth(CE, d)  # the gradient of the decoder's output; then through the decoder
        ((x @ dec.T) * t["hidden"]).sum().backward()
        grads["decoder"] = grads["decoder"] + dec.grad / TP
        grads["weight"] = grads["weight"] + t["weight"] / TP
    for rank, out in enumerate(ranks):
        mine, ref = out["fsdp-ce"]["logitless"], out["fsdp-ce"]["chunked"]
        for what in ("decoder", "weight"):
            assert_no_worse_than_reference(mine[what], ref[what], grads[what], f"{what} r{rank}")
