"""``trainer.fused_lm_head_logprob_backend=logitless`` in SkyRL 0.4 (megatron-core 0.19, gloo).

The numbers go through SkyRL's own functions, as its Megatron model wrapper calls them in its
loss: ``fused_lm_head_output_processor`` (the sequence-parallel gather, or the copy to the
tensor-parallel region, and the batch-first transpose) on a real ``ColumnParallelLinear``
output layer, then ``from_parallel_hidden_to_logprobs`` or its packed variant (the roll of the
targets, the temperature folded into the weight, the scatter back to ``[B, S - 1]``) with
``fused_backend`` SkyRL's ``torch`` or ``logitless``. Each case runs on 2 gloo ranks (TP=2),
against SkyRL's torch backend and a float64 truth (the full logits of the float64 hidden
states and weight): the log-probs, this rank's hidden-state gradient (after SkyRL's gather
reduced it) and its weight shard's gradient, with random upstream gradients, within 4x the
torch backend's own error against float64 (tests/_tolerance.py), fp32 and bf16.

What is not run: SkyRL's ``MegatronModelWrapper`` and its workers (they build the model with
``megatron.bridge`` from a Hugging Face checkpoint, under Ray, on CUDA); so the loss function
that calls these functions is not run, only the functions.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from _dist import spawn
from _tolerance import assert_no_worse_than_reference

pytest.importorskip("megatron.core", reason="SkyRL's Megatron backend needs megatron-core")

import logitless.integrations.skyrl as lsk  # noqa: E402

H, V = 24, 130  # V: a multiple of TP
TP = 2
SRC = str(Path(__file__).resolve().parents[2] / "src")


@dataclass(frozen=True)
class Case:
    dtype: torch.dtype
    packed: bool
    sp: bool
    temperature: float = 1.0

    @property
    def name(self) -> str:
        return (
            f"{str(self.dtype)[6:]}-{'packed' if self.packed else 'padded'}-"
            f"{'sp' if self.sp else 'nosp'}-T{self.temperature}"
        )


CASES = [
    Case(torch.float32, packed=False, sp=True),
    Case(torch.float32, packed=False, sp=False, temperature=0.7),
    Case(torch.float32, packed=True, sp=True, temperature=0.7),
    Case(torch.float32, packed=True, sp=False),
    Case(torch.bfloat16, packed=False, sp=True, temperature=0.7),
    Case(torch.bfloat16, packed=True, sp=True),
]

# --- the data: the same on every rank ----------------------------------------------------

B, S = 3, 10  # padded layout: [B, S]
LENS = [7, 4, 9]  # packed layout: each sequence padded to a multiple of 2·TP
PAD_TO = 2 * TP


def _data(case: Case):
    g = torch.Generator().manual_seed(1234)
    if case.packed:
        padded = [-(-n // PAD_TO) * PAD_TO for n in LENS]
        cu = torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()], dtype=torch.int32)
        t_total = int(cu[-1])
        sequences = torch.zeros(len(LENS), max(LENS), dtype=torch.long)
        mask = torch.zeros(len(LENS), max(LENS), dtype=torch.bool)
        packed = torch.zeros(1, t_total, dtype=torch.long)
        for i, n in enumerate(LENS):
            ids = torch.randint(0, V, (n,), generator=g)
            sequences[i, :n], mask[i, :n] = ids, True
            packed[0, int(cu[i]) : int(cu[i]) + n] = ids
        hidden = torch.randn(t_total, 1, H, generator=g, dtype=torch.float64)  # [T, 1, H]
        extra = {"cu": cu, "mask": mask, "packed": packed}
        out_shape = (len(LENS), max(LENS) - 1)
    else:
        sequences = torch.randint(0, V, (B, S), generator=g)
        hidden = torch.randn(S, B, H, generator=g, dtype=torch.float64)  # [S, B, H]
        extra = {}
        out_shape = (B, S - 1)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.5
    grad = torch.randn(out_shape, generator=g, dtype=torch.float64)
    # what the model holds in case.dtype, and the truth computed from exactly those values
    return hidden.to(case.dtype), weight.to(case.dtype), sequences, grad, extra


def _truth(case: Case, rank: int):
    """Log-probs and gradients in float64 from the full logits (one process's view)."""
    hidden, weight, sequences, grad, extra = _data(case)
    h = hidden.double().requires_grad_()
    w = weight.double().requires_grad_()
    logp = torch.log_softmax((h.transpose(0, 1) @ (w / case.temperature).T), dim=-1)  # [B,S,V]
    out = torch.zeros(grad.shape, dtype=torch.float64)
    if case.packed:
        cu = extra["cu"]
        for i, n in enumerate(LENS):
            for j in range(n - 1):
                out[i, j] = logp[0, int(cu[i]) + j, sequences[i, j + 1]]
    else:
        out = logp[:, :-1].gather(-1, sequences[:, 1:, None])[..., 0]
    (out * grad).sum().backward()
    rows = h.shape[0] // TP
    dh = h.grad[rank * rows : (rank + 1) * rows] if case.sp else h.grad
    vl = V // TP
    return out.detach(), dh, w.grad[rank * vl : (rank + 1) * vl]


def _output_layer(case: Case, weight: torch.Tensor, rank: int):
    from megatron.core import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear

    config = ModelParallelConfig(
        tensor_model_parallel_size=TP,
        sequence_parallel=case.sp,
        params_dtype=case.dtype,
        use_cpu_initialization=True,
        bf16=case.dtype == torch.bfloat16,
    )
    layer = ColumnParallelLinear(
        H, V, config=config, init_method=torch.nn.init.zeros_, bias=False, gather_output=False
    )
    vl = V // TP
    with torch.no_grad():
        layer.weight.copy_(weight[rank * vl : (rank + 1) * vl])
    return layer


def _skyrl_logprobs(case: Case, backend: str, rank: int, *, inference_only: bool = False):
    """SkyRL's loss-side calls, fused path: output processor, then the log-prob function."""
    from megatron.core import parallel_state as mpu
    from skyrl.backends.skyrl_train.distributed.megatron import model_utils
    from skyrl.backends.skyrl_train.distributed.megatron.fused_lm_head import (
        fused_lm_head_output_processor,
    )

    hidden, weight, sequences, grad, extra = _data(case)
    layer = _output_layer(case, weight, rank)
    rows = hidden.shape[0] // TP
    local = hidden[rank * rows : (rank + 1) * rows] if case.sp else hidden
    local = local.clone().requires_grad_(not inference_only)
    context: dict = {}
    h = fused_lm_head_output_processor(hidden_states=local, output_layer=layer, context=context)
    w = context["lm_head_weight"]
    _v_local = int(w.shape[0])  # as SkyRL's loss computes the shard's range
    start, end = (
        mpu.get_tensor_model_parallel_rank() * _v_local,
        (mpu.get_tensor_model_parallel_rank() + 1) * _v_local,
    )
    tp_group = mpu.get_tensor_model_parallel_group()
    if case.packed:
        out = model_utils.from_parallel_hidden_to_logprobs_packed_sequences(
            h,
            w,
            extra["packed"],
            extra["cu"],
            sequences.shape[1],
            vocab_start_index=start,
            vocab_end_index=end,
            group=tp_group,
            inference_only=inference_only,
            cp_group=mpu.get_context_parallel_group(),
            chunk_size=None,
            attention_mask=extra["mask"],
            temperature=case.temperature,
            fused_backend=backend,
        )
    else:
        out = model_utils.from_parallel_hidden_to_logprobs(
            h,
            w,
            sequences,
            vocab_start_index=start,
            vocab_end_index=end,
            tp_group=tp_group,
            inference_only=inference_only,
            cp_group=None,
            chunk_size=None,
            temperature=case.temperature,
            fused_backend=backend,
        )
    if inference_only:
        return out.detach(), None, None
    (out.double() * grad).sum().backward()
    return out.detach(), local.grad, layer.weight.grad


def _parity_worker(rank: int, world: int, cases: list[Case]):
    import _megatron_shim as shim

    shim.init_parallel(tp=TP)
    import logitless.integrations.skyrl as lsk

    assert lsk.installed()
    calls = []  # SkyRL's dispatch reaches logitless's op (not its torch backend) for "logitless"
    own = lsk.logprob_apply
    lsk.logprob_apply = lambda *a: calls.append(1) or own(*a)
    results = {}
    for case in cases:
        truth = _truth(case, rank)
        torch_path = _skyrl_logprobs(case, "torch", rank)
        ours = _skyrl_logprobs(case, lsk.BACKEND, rank)
        with torch.no_grad():
            forward_only = _skyrl_logprobs(case, "logitless", rank, inference_only=True)[0]
        results[case.name] = (truth, torch_path, ours, forward_only)
    assert len(calls) == 2 * len(cases), calls
    return results


@pytest.fixture(scope="module")
def parity():
    return spawn(_parity_worker, TP, CASES, timeout_s=120.0)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_matches_skyrl_torch_backend_and_float64(parity, case):
    """Log-probs, the hidden states' gradient (this rank's shard after SkyRL's gather reduced
    it) and the weight shard's gradient: within 4x SkyRL's torch backend's error against
    float64, on both ranks; the log-probs are fp32 and the same on both ranks."""
    for rank, results in enumerate(parity):
        truth, torch_path, ours, forward_only = results[case.name]
        assert ours[0].dtype == torch.float32 and torch_path[0].dtype == torch.float32
        assert ours[1].dtype == case.dtype and ours[2].dtype == case.dtype
        for what, i in (("log-probs", 0), ("hidden grad", 1), ("weight grad", 2)):
            assert_no_worse_than_reference(
                ours[i], torch_path[i], truth[i], f"{case.name} rank {rank} {what}"
            )
        # forward-only (SkyRL's old / reference log-probs): the same numbers
        torch.testing.assert_close(forward_only, ours[0], rtol=0, atol=0)
    assert torch.equal(parity[0][case.name][2][0], parity[1][case.name][2][0])


# --- bad input: ValueError on every rank ---------------------------------------------------

BAD = {
    "target": "target: token ids must be in [0, 130)",
    "range": "does not match lm_head_weight's 65 rows",
    "tiling": "vocabulary shards of the tensor-parallel group (tp_group) must tile",
    "hidden_size": "hidden_size 25 != lm_head_weight's 24",
}


def _bad_worker(rank: int, world: int, cases: list[str]):
    import _megatron_shim as shim

    shim.init_parallel(tp=TP)
    from megatron.core import parallel_state as mpu
    from skyrl.backends.skyrl_train.distributed.megatron import model_utils

    import logitless.integrations.skyrl  # noqa: F401

    vl = V // TP
    errors = {}
    for what in cases:  # every rank raises at the same point, so the group stays in step
        hidden = torch.randn(2, 6, H)
        weight = torch.randn(vl, H)
        target = torch.randint(0, V, (2, 6))
        start, end = rank * vl, (rank + 1) * vl
        if rank == 1 and what == "target":
            target[1, 3] = V  # out of the vocabulary: SkyRL's torch backend would score it 0
        if rank == 1 and what == "range":
            end = start + vl + 1  # does not match the weight shard's rows
        if what == "tiling":
            start, end = 0, vl  # both ranks claim the same rows
        if rank == 1 and what == "hidden_size":
            hidden = torch.randn(2, 6, H + 1)
        try:
            model_utils.from_parallel_hidden_to_logprobs(
                hidden,
                weight,
                target,
                vocab_start_index=start,
                vocab_end_index=end,
                tp_group=mpu.get_tensor_model_parallel_group(),
                fused_backend="logitless",
            )
            errors[what] = None
        except ValueError as e:
            errors[what] = str(e)
    return errors


def test_bad_input_raises_on_every_rank():
    """A wrong input on one rank: ``ValueError`` on both (the other rank's names the group),
    in SkyRL's terms; the ranks stay in step for the next call."""
    per_rank = spawn(_bad_worker, TP, list(BAD))
    for what, message in BAD.items():
        errors = [r[what] for r in per_rank]
        assert all(e is not None for e in errors), (what, errors)
        assert any(message in e for e in errors), (what, errors)


# --- the switch ----------------------------------------------------------------------------


def _trainer_config(**kw):
    from skyrl.train.config.config import TrainerConfig

    return TrainerConfig(strategy="megatron", fused_lm_head_logprob=True, **kw)


def test_config_accepts_logitless_and_keeps_skyrls_checks():
    cfg = _trainer_config(fused_lm_head_logprob_backend="logitless")
    assert cfg.fused_lm_head_logprob_backend == "logitless"
    assert type(cfg.fused_lm_head_logprob_backend) is type(lsk.BACKEND)
    assert _trainer_config(fused_lm_head_logprob_backend="triton").fused_lm_head_logprob_backend
    with pytest.raises(ValueError, match="must be 'torch' or 'triton'"):
        _trainer_config(fused_lm_head_logprob_backend="cuda")
    with pytest.raises(ValueError, match="only supported with the Megatron backend"):
        from skyrl.train.config.config import TrainerConfig

        TrainerConfig(
            strategy="fsdp", fused_lm_head_logprob=True, fused_lm_head_logprob_backend="logitless"
        )


@pytest.mark.parametrize("temperature", [0.0, float("inf")])
def test_a_temperature_skyrl_divides_the_weight_by_is_refused_with_the_config(temperature):
    """SkyRL divides the head weight by ``trainer.algorithm.temperature`` before the fused
    head gets it: 0 (greedy sampling's, copied from the generator when unset) would give NaN
    log-probs. Refused by name when the config is made, before any model exists or runs."""
    from skyrl.train.config.config import (
        AlgorithmConfig,
        GeneratorConfig,
        SamplingParams,
        SkyRLTrainConfig,
    )

    with pytest.raises(ValueError, match="trainer.algorithm.temperature must be finite and > 0"):
        _trainer_config(
            fused_lm_head_logprob_backend="logitless",
            algorithm=AlgorithmConfig(temperature=temperature),
        )
    trainer = _trainer_config(fused_lm_head_logprob_backend="logitless")  # unset: checked later
    generator = GeneratorConfig(sampling_params=SamplingParams(temperature=temperature))
    with pytest.raises(ValueError, match="generator.sampling_params.temperature"):
        SkyRLTrainConfig(trainer=trainer, generator=generator)
    # SkyRL's own backends keep SkyRL's behaviour
    _trainer_config(
        fused_lm_head_logprob_backend="torch", algorithm=AlgorithmConfig(temperature=temperature)
    )


def test_uninstall_gives_skyrl_its_functions_back():
    from skyrl.backends.skyrl_train.distributed.megatron import model_utils
    from skyrl.train.config.config import TrainerConfig

    ours = model_utils._fused_lm_head_logprob_apply
    lsk.uninstall()
    try:
        assert not lsk.installed()
        assert model_utils._fused_lm_head_logprob_apply is not ours
        with pytest.raises(ValueError, match="must be 'torch' or 'triton'"):
            TrainerConfig(strategy="megatron", fused_lm_head_logprob_backend="logitless")
    finally:
        lsk.install()
    lsk.install()  # idempotent
    assert lsk.installed() and model_utils._fused_lm_head_logprob_apply is ours


def test_the_config_installs_the_backend_where_it_is_unpickled(tmp_path):
    """SkyRL hands the config object to its Ray task and worker actors (pickled): a process
    that unpickles it has the backend installed before it reads the value."""
    from skyrl.train.config.config import SkyRLTrainConfig

    cfg = SkyRLTrainConfig.from_cli_overrides(
        [
            "trainer.strategy=megatron",
            "trainer.fused_lm_head_logprob=true",
            "trainer.fused_lm_head_logprob_backend=logitless",
        ]
    )
    path = tmp_path / "cfg.pkl"
    path.write_bytes(pickle.dumps(cfg))
    probe = (
        "import pickle, sys; cfg = pickle.load(open(sys.argv[1], 'rb'));"
        "from skyrl.backends.skyrl_train.distributed.megatron import model_utils as m;"
        "import logitless.integrations.skyrl as s;"
        "print(cfg.trainer.fused_lm_head_logprob_backend,"
        " m._fused_lm_head_logprob_apply is s._fused_lm_head_logprob_apply)"
    )
    # the probe imports nothing of logitless before unpickling; it checks after
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(
        [sys.executable, "-c", "import sys; print('logitless' in sys.modules)"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    assert out.stdout.split() == ["False"]
    out = subprocess.run(
        [sys.executable, "-c", probe, str(path)], capture_output=True, text=True, env=env
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["logitless", "True"]


def test_override_entrypoint_runs_skyrls_main(monkeypatch):
    """``trainer.override_entrypoint=logitless.integrations.skyrl``: SkyRL's ``main()`` imports
    this module and calls its ``main()``, which parses and validates the config with SkyRL's
    own code (no second dispatch); Ray is where this test stops."""
    from skyrl.train.entrypoints import main_base

    seen = {}

    def stop(cfg):
        seen["cfg"] = cfg
        raise KeyboardInterrupt

    monkeypatch.setattr(main_base, "initialize_ray", stop)
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "main_base",
            "trainer.strategy=megatron",
            "trainer.logger=console",
            "trainer.override_entrypoint=logitless.integrations.skyrl",
            "trainer.fused_lm_head_logprob=true",
            "trainer.fused_lm_head_logprob_backend=logitless",
        ],
    )
    with pytest.raises(KeyboardInterrupt):
        main_base.main()
    trainer = seen["cfg"].trainer
    assert trainer.fused_lm_head_logprob_backend == "logitless"
    assert type(trainer.fused_lm_head_logprob_backend) is type(lsk.BACKEND)
