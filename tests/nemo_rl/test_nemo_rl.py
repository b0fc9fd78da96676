"""logitless as NeMo RL's fused-linear-logprobs backend, run through NeMo RL's own code.

Each check builds a tiny megatron-core GPTModel per gloo rank (tests/_megatron_shim.py), a
NeMo RL rollout batch (``BatchedDataDict``: input ids and lengths, token and sample masks,
advantages, previous / generation / reference log-probs) and NeMo RL's config, and runs NeMo
RL's Megatron training code on it: its micro-batch processing (``process_microbatch``:
padding, or THD packing and the context-parallel zigzag split), its
``megatron_forward_backward`` (``forward_with_post_processing_fn``, Megatron's schedule) with
its ``LogprobsPostProcessor`` (the previous log-probs) and ``LossPostProcessor`` around its
``ClippedPGLossFn``, three ways on the same weights and batch:

- ours: ``use_fused_linear_logprobs=true`` with ``fused_linear_logprobs_backend=logitless``;
- NeMo RL's logits path (``use_fused_linear_logprobs=false``), the reference;
- that path on a float64 copy of the model, the truth (its cast of the logits to fp32 before
  the log-softmax lifted: ``_float64_truth``).

The log-probs, the loss, and every parameter's gradient (``.grad``, or ``main_grad`` under
Megatron's DDP) must be within the tolerance derived from the reference's own error against
the truth (tests/_tolerance.py). NeMo RL's own fused path refuses context parallelism,
packing with GRPO and top-k / top-p; these run here with logitless.

NeMo RL needs Megatron-Bridge and Megatron-LM's ``megatron.training`` to import, and
hard-codes CUDA in its context-parallel gather: tests/nemo_rl/_nemo_shim.py says what is
stubbed and why.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import NamedTuple

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core (the 3.12 layer, .ci/nemo_rl.sh)")
pytest.importorskip("ray", reason="NeMo RL's imports (.ci/nemo_rl.sh)")

from _dist import spawn  # noqa: E402
from _tolerance import FLOOR, assert_no_worse_than_reference  # noqa: E402

V = 256
B, S = 3, 16
LENGTHS = (16, 9, 12)


class Shape(NamedTuple):
    """A rollout batch's shape: ``b`` sequences of ``lengths`` tokens padded to ``s``, over a
    vocabulary of ``v`` (benchmarks/nemo_rl_logprobs.py runs the same step at full size)."""

    b: int = B
    s: int = S
    lengths: tuple[int, ...] = LENGTHS
    v: int = V


SHAPE = Shape()


# --- NeMo RL's config, batch and step -------------------------------------------------------


def _config(tp: int, cp: int, packed: bool, sp: bool = False, backend: str = "logitless",
            pp: int = 1, fuse_loss: bool = False) -> dict:  # fmt: skip
    multiple = (2 * cp if cp > 1 else 1) * (tp if sp else 1)
    return {
        "sequence_packing": {"enabled": packed, "fuse_loss": fuse_loss},
        "dynamic_batching": {"enabled": False},
        "make_sequence_length_divisible_by": multiple,
        "logprob_chunk_size": None,
        "megatron_cfg": {
            "enabled": True,
            "use_fused_linear_logprobs": True,
            "fused_linear_logprobs_backend": backend,
            "tensor_model_parallel_size": tp,
            "context_parallel_size": cp,
            "pipeline_model_parallel_size": pp,
            "sequence_parallel": sp,
        },
    }


def _rollout(
    seed: int = 1, ids: torch.Tensor | None = None, shape: Shape = SHAPE
) -> dict[str, torch.Tensor]:
    """A GRPO batch as NeMo RL's policy worker gets it (the same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    B, S, V = shape.b, shape.s, shape.v  # noqa: N806
    lengths = torch.tensor(shape.lengths)
    real = torch.arange(S)[None] < lengths[:, None]
    if ids is None:
        ids = torch.randint(0, V, (B, S), generator=g)
    ids = torch.where(real, ids, 0)
    token_mask = (real & (torch.arange(S)[None] >= 3)).float()  # a 3-token prompt
    old = -torch.rand(B, S, generator=g) * 6
    return dict(
        input_ids=ids,
        input_lengths=lengths,
        token_mask=token_mask,
        sample_mask=torch.ones(B),
        advantages=torch.randn(B, S, generator=g),
        prev_logprobs=old,
        generation_logprobs=old + 0.05 * torch.randn(B, S, generator=g),
        reference_policy_logprobs=old + 0.1 * torch.randn(B, S, generator=g),
    )


def _microbatch(rollout: dict, cfg: dict):
    """NeMo RL's processing of one micro-batch (``process_microbatch``, as
    ``make_processed_microbatch_iterator`` runs it, without its move to CUDA)."""
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict
    from nemo_rl.models.megatron import data as nd

    data = BatchedDataDict({k: v.clone() for k, v in rollout.items()})
    pack = cfg["sequence_packing"]["enabled"]
    pad = (1, 1, None)
    if pack:
        pad = nd._get_pack_sequence_parameters_for_megatron(
            cfg["megatron_cfg"],
            cfg["make_sequence_length_divisible_by"],
            rollout["input_ids"].shape[1],
        )
    inputs = nd.process_microbatch(
        data, seq_length_key="input_lengths" if pack else None,
        pad_individual_seqs_to_multiple_of=pad[0], pad_packed_seq_to_multiple_of=pad[1],
        pad_full_seq_to=pad[2], pack_sequences=pack,
    )  # fmt: skip
    fields = {f.name: getattr(inputs, f.name) for f in dataclasses.fields(inputs)}
    return nd.ProcessedMicrobatch(data_dict=data, **fields)


def _loss_fn(fused: bool, kl: float = 0.01):
    from nemo_rl.algorithms.loss import ClippedPGLossConfig, ClippedPGLossFn

    cfg = ClippedPGLossConfig(
        reference_policy_kl_penalty=kl, ratio_clip_min=0.2, ratio_clip_max=0.28
    )
    return ClippedPGLossFn(cfg, use_fused_linear_logprobs=fused)


def _run(model, cfg: dict, rollout: dict, sampling, what: str, fused: bool, loss_fn=None):
    """One NeMo RL step (``megatron_forward_backward``): ``what`` ``"logprobs"`` (its
    ``LogprobsPostProcessor``, forward only) or ``"loss"`` (``LossPostProcessor``, backward)."""
    from nemo_rl.models.megatron import train

    if what == "logprobs":
        post = train.LogprobsPostProcessor(cfg, sampling, use_fused_linear_logprobs=fused)
    else:
        loss_fn = _loss_fn(fused) if loss_fn is None else loss_fn
        post = train.LossPostProcessor(loss_fn, cfg, 1, sampling_params=sampling)
    mask = rollout["token_mask"][:, 1:] * rollout["sample_mask"][:, None]
    b, s = rollout["input_ids"].shape
    out = train.megatron_forward_backward(
        model=model, data_iterator=iter([_microbatch(rollout, cfg)]), num_microbatches=1,
        seq_length=s, mbs=b, post_processing_fn=post, forward_only=what == "logprobs",
        global_valid_seqs=rollout["sample_mask"].sum(), global_valid_toks=mask.sum(),
        sampling_params=sampling, use_fused_linear_logprobs=fused,
    )  # fmt: skip
    return out[0] if out else None  # a pipeline stage without the head reports nothing


# --- the three paths ---------------------------------------------------------------------


def _setup(tp: int, cp: int, sp: bool = False, pp: int = 1, seed: int = 0):
    """This rank's model (its pipeline stage of ``pp``) and a float64 copy."""
    from _megatron_shim import gpt_model, init_parallel

    init_parallel(tp, cp, pp)

    def build(dtype=torch.float32):
        return gpt_model(
            tp=tp, cp=cp, sequence_parallel=sp, vocab=V, dtype=dtype, seed=seed, pp=pp,
            layers=2 if pp > 1 else 1, position_embedding_type="none",
        )  # fmt: skip

    model = build()
    truth = build(torch.float64)
    with torch.no_grad():
        for p64, p in zip(truth.parameters(), model.parameters(), strict=True):
            p64.copy_(p)
    return model, truth


def _float64_truth():
    """NeMo RL's logits path computes its log-softmax in fp32 (``DistributedLogprob`` and
    ``DistributedLogprobWithSampling`` cast the logits; so does
    ``get_next_token_logprobs_from_logits``). For the truth the float64 model's logits stay
    float64: the two autograd functions are replaced by their plain-torch float64 equivalent
    (the logits gathered over the tensor-parallel group, NeMo RL's own ``apply_top_k_top_p``
    on them, the log-softmax, the target's entry: the gradient of this rank's shard as NeMo
    RL's backward gives it) and the cast is skipped."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    from nemo_rl.algorithms.logits_sampling_utils import apply_top_k_top_p
    from nemo_rl.algorithms.loss import utils
    from nemo_rl.distributed import model_utils

    def logprob(logits, target, group, top_k=None, top_p=1.0):
        full = gather_from_tensor_model_parallel_region(logits)
        if top_k is not None or top_p != 1.0:
            full = apply_top_k_top_p(full, top_k=top_k, top_p=top_p)[0]
        return full.log_softmax(-1).gather(-1, target[..., None])[..., 0]

    class Plain:
        @staticmethod
        def apply(logits, target, start, end, group, inference_only=False):
            return logprob(logits, target, group)

    class WithSampling:
        @staticmethod
        def apply(logits, target, group, top_k, top_p, inference_only=False):
            return logprob(logits, target, group, top_k, top_p)

    def float64(input_ids, next_token_logits, vocab_parallel_rank=None,
                vocab_parallel_group=None, context_parallel_group=None, sampling_params=None,
                **_):  # fmt: skip
        shard = next_token_logits.shape[-1]
        logp = model_utils.from_parallel_logits_to_logprobs(
            next_token_logits, input_ids, vocab_parallel_rank * shard,
            (vocab_parallel_rank + 1) * shard, vocab_parallel_group,
            cp_group=context_parallel_group, sampling_params=sampling_params,
        )  # fmt: skip
        return logp[:, : input_ids.shape[1] - 1]

    return _swapped(
        (utils, "get_next_token_logprobs_from_logits", float64),
        (model_utils, "DistributedLogprob", Plain),
        (model_utils, "DistributedLogprobWithSampling", WithSampling),
    )


@contextlib.contextmanager
def _swapped(*replacements):
    """Each ``(module, name, value)`` set for the block, then restored."""
    old = [(m, n, getattr(m, n)) for m, n, _ in replacements]
    for m, n, v in replacements:
        setattr(m, n, v)
    try:
        yield
    finally:
        for m, n, v in old:
            setattr(m, n, v)


def _grads(model) -> dict[str, torch.Tensor]:
    out = {}
    for n, p in model.named_parameters():
        g = getattr(p, "main_grad", None)
        g = p.grad if g is None else g
        if g is not None:
            out[n.removeprefix("module.").removeprefix("module.")] = g.detach().float().clone()
    for p in model.parameters():
        p.grad = None
        if getattr(p, "main_grad", None) is not None:
            p.main_grad.zero_()
    return out


def _three_ways(model, truth, cfg, rollout, sampling, what: str, loss_fn=None) -> list[dict]:
    """ours, NeMo RL's logits path, float64: ``{"out": log-probs or loss, **grads}``."""
    results = []
    for m, fused in ((model, True), (model, False), (truth, False)):
        ctx = _float64_truth() if m is truth else contextlib.nullcontext()
        with ctx:
            out = _run(m, cfg, rollout, sampling, what, fused, loss_fn)
        row = _grads(m) if what == "loss" else {}
        if out is not None:
            value = out["logprobs"] if what == "logprobs" else torch.tensor(out["loss"])
            row["out"] = value.double()
        results.append(row)
    return results


def _compare(results: list[dict], what: str, floor: float) -> None:
    ours, ref, exact = results
    assert set(ours) == set(ref) == set(exact), (set(ours) ^ set(ref), set(ref) ^ set(exact))
    for name in ref:
        f = FLOOR if name == "out" else floor
        assert_no_worse_than_reference(
            ours[name].double(), ref[name].double(), exact[name].double(), f"{what}: {name}",
            floor=f,
        )  # fmt: skip


def _sampling(temperature=1.0, top_k=None, top_p=1.0):
    from nemo_rl.algorithms.logits_sampling_utils import TrainingSamplingParams

    return TrainingSamplingParams(top_k=top_k, top_p=top_p, temperature=temperature)


# --- the checks ---------------------------------------------------------------------------


def _parity_case(
    rank: int,
    tp: int,
    cp: int,
    packed: bool,
    sp: bool,
    sampled: bool,
    pp: int = 1,
    fuse_loss: bool = False,
) -> None:
    """The previous log-probs and the GRPO loss step, three ways (module docstring); with
    ``pp`` stages, each rank compares its own stage's gradients (the log-probs and the loss
    live on the last). ``fuse_loss``: NeMo RL's ``SequencePackingFusionLossWrapper`` (one
    loss call over the packed batch) instead of its per-sequence ``SequencePackingLossWrapper``."""
    model, truth = _setup(tp, cp, sp, pp)
    cfg = _config(tp, cp, packed, sp, pp=pp, fuse_loss=fuse_loss)
    sampling = _sampling(0.7, 40, 0.9) if sampled else _sampling(0.7)
    rollout = _rollout(ids=_sampled_ids(model, sampling) if sampled else None)
    floor = S * B * FLOOR
    logp = _three_ways(model, truth, cfg, rollout, sampling, "logprobs")
    _compare(logp, f"rank {rank} logprobs", floor)
    if sampled:  # -inf where the token is outside the kept set, masked by NeMo RL to 0
        assert torch.isfinite(logp[0]["out"]).all()
        assert logp[0]["out"][1, OUTSIDE] == 0 == logp[1]["out"][1, OUTSIDE]
    if logp[1]:  # the last pipeline stage
        rollout["prev_logprobs"] = logp[1]["out"].detach().float() + 0.02 * torch.randn(B, S)
    _compare(_three_ways(model, truth, cfg, rollout, sampling, "loss"), f"rank {rank} loss", floor)


def _sampled_ids(model, sampling) -> torch.Tensor:
    """Token ids a vLLM-like sampler draws from the model itself with top-k / top-p at the
    temperature (the tiny model is token-local: each position's logits depend on its own token
    only, so one forward over the whole vocabulary gives every next-token distribution)."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    with torch.no_grad():
        logits = model(torch.arange(V)[None], None, None)  # [1, V, V/tp]
        table = gather_from_tensor_model_parallel_region(logits.transpose(0, 1).contiguous())
        table = table[:, 0].double() / sampling.temperature  # [V, V]
    kept = table >= table.topk(sampling.top_k, -1).values[:, -1:]
    probs = torch.where(kept, table, float("-inf")).softmax(-1)
    ordered, order = probs.sort(-1, descending=True)
    before = ordered.cumsum(-1) - ordered
    top_p = torch.zeros_like(kept).scatter(-1, order, before < sampling.top_p)
    probs = torch.where(top_p, probs, 0)
    g = torch.Generator().manual_seed(5)
    ids = torch.empty(B, S, dtype=torch.long)
    ids[:, 0] = torch.randint(0, V, (B,), generator=g)
    for t in range(1, S):
        ids[:, t] = torch.multinomial(probs[ids[:, t - 1]].float(), 1, generator=g)[:, 0]
    # one token outside its kept set (the least likely one), the last of sequence 1: both paths
    # give its log-prob -inf and NeMo RL masks the position (OUTSIDE)
    ids[1, OUTSIDE] = table[ids[1, OUTSIDE - 1]].argmin()
    return ids


OUTSIDE = LENGTHS[1] - 1  # its log-prob is at position OUTSIDE of [B, S] (a 0 prepended)


def _ddp(model, **ddp):
    """``model`` as NeMo RL's worker wraps it: megatron-core's DDP (fp32 ``main_grad``), its
    schedule functions set (tests/test_megatron_production.py's ``_schedule_config``)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from test_megatron_production import _schedule_config

    config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, **ddp)
    wrapped = DistributedDataParallel(model.config, config, module=model)
    _schedule_config(wrapped)
    return wrapped


def _bf16_main_grad_case(rank: int) -> None:
    """bf16 under Float16Module and DDP (TP=2, packed): the loss and every ``main_grad``, three
    ways (the truth: a float64 copy of the bf16 weights)."""
    from _megatron_shim import gpt_model, init_parallel
    from megatron.core.transformer.module import Float16Module

    init_parallel(2, 1)
    model = gpt_model(tp=2, vocab=V, dtype=torch.bfloat16, bf16=True,
                      position_embedding_type="none")  # fmt: skip
    truth = gpt_model(tp=2, vocab=V, dtype=torch.float64, position_embedding_type="none")
    with torch.no_grad():
        for p64, p in zip(truth.parameters(), model.parameters(), strict=True):
            p64.copy_(p)
    ddp = _ddp(Float16Module(model.config, model), overlap_grad_reduce=True)
    cfg = _config(2, 1, True)
    rollout = _rollout(seed=3)
    sampling = _sampling(0.8)
    results = []
    for m, fused in ((ddp, True), (ddp, False), (truth, False)):
        ctx = _float64_truth() if m is truth else contextlib.nullcontext()
        with ctx:
            out = _run(m, cfg, rollout, sampling, "loss", fused)
        if m is ddp:
            m.finish_grad_sync()
        results.append(dict(out=torch.tensor(out["loss"]).double(), **_grads(m)))
    _compare(results, f"rank {rank} bf16 main_grad", S * B * FLOOR)


ADAM = dict(lr=0.01, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-2)


def _distributed_optimizer_case(rank: int) -> None:
    """NeMo RL's refusal of ``overlap_param_gather`` lifted: megatron-core's distributed
    optimizer with ``overlap_grad_reduce`` and ``overlap_param_gather`` (DP=2), two optimizer
    steps through NeMo RL's ``megatron_forward_backward``. Step 2's forward reads parameters
    that ``output_layer``'s forward pre-hook all-gathers from the optimizer's shards (NeMo RL's
    own fused forward bypasses that hook: the next step trips Megatron's
    ``param_gather_handle`` assertion). The parameters after each step equal those of NeMo RL's
    logits path, to Adam's amplification of the gradients' rounding."""
    from _megatron_shim import gpt_model, init_parallel
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    init_parallel(1, 1, gloo_groups=True)
    dp_rank = ps.get_data_parallel_rank()
    cfg = _config(1, 1, True)
    runs = {}
    for fused in (True, False):
        model = gpt_model(vocab=V, seed=0, position_embedding_type="none")
        ddp = _ddp(model, overlap_grad_reduce=True, use_distributed_optimizer=True,
                   overlap_param_gather=True, bucket_size=3000)  # fmt: skip
        opt = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", weight_decay=0.0, clip_grad=0.0,
                            use_distributed_optimizer=True, **ADAM), [ddp],
        )  # fmt: skip
        runs[fused] = (model, ddp, opt)
    assert len(runs[True][1].bucket_groups) > 1, "several buckets: a gather per bucket"
    for step in range(2):
        rollout = _rollout(seed=20 + 10 * step + dp_rank)
        for fused, (_, ddp, opt) in runs.items():
            ddp.zero_grad_buffer()
            opt.zero_grad()
            _run(ddp, cfg, rollout, _sampling(), "loss", fused)
            assert opt.step()[0], "the optimizer step was skipped"
        for name, p in runs[True][0].named_parameters():
            q = dict(runs[False][0].named_parameters())[name]
            what = f"rank {rank} step {step} {name}"
            torch.testing.assert_close(p, q, rtol=0, atol=2e-5, msg=what)
    for _, ddp, _ in runs.values():
        ddp.start_param_sync(force_sync=True)


def _errors_case(rank: int) -> None:
    """What NeMo RL's config lets through and logitless cannot do: a ValueError naming the
    option, on both ranks, before the decoder runs."""
    model, _ = _setup(2, 1)
    cfg = _config(2, 1, False)
    forwards: list[int] = []
    hook = model.decoder.register_forward_pre_hook(lambda *_: forwards.append(1))

    def raises(match: str, other: bool, sampling, rollout=None) -> None:
        with pytest.raises(ValueError) as caught:
            _run(model, cfg, rollout or _rollout(), sampling, "logprobs", True)
        want = "another rank" if other and rank == 0 else match
        assert want in str(caught.value), (want, str(caught.value))

    raises("policy.generation.temperature must be finite and > 0", False, _sampling(0.0))
    raises("policy.generation.temperature must be finite and > 0", False, _sampling(float("nan")))
    raises("policy.generation.top_p must be in (0, 1]", False, _sampling(top_p=1.5))
    bad = _rollout()
    if rank == 1:  # a token id outside the vocabulary, on one rank only
        bad["input_ids"][1, 4] = V + 3
    raises(f"input_ids (the rollout's token ids, NeMo RL's labels for the fused path) must be "
           f"in [0, {V})", True, _sampling(), bad)  # fmt: skip
    hook.remove()
    assert forwards == [], "a bad option ran the decoder"


class _EntropyLoss:
    """A LOGPROB loss of a user's that reads the entropy logitless hands it
    (``fused_linear_logprobs_entropy: true``): ``Σ up · H`` over the trained tokens."""

    def __init__(self, up: torch.Tensor) -> None:
        from nemo_rl.algorithms.loss.interfaces import LossInputType, LossType

        self.input_type, self.loss_type = LossInputType.LOGPROB, LossType.TOKEN_LEVEL
        self.use_fused_linear_logprobs, self.up = True, up

    def __call__(self, next_token_logprobs, data, global_valid_seqs, global_valid_toks):
        mask = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
        loss = (data["entropy"] * self.up * mask).sum()
        return loss, {"loss": loss.item()}


def _entropy_case(rank: int) -> None:
    """The entropy at the temperature and its gradient, handed to a loss through NeMo RL's
    ``LossPostProcessor`` (TP=2, padded), against the entropy of the tensor-parallel-gathered
    logits of the model's own forward, fp32 and float64."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    model, truth = _setup(2, 1)
    cfg = _config(2, 1, False)
    cfg["megatron_cfg"]["fused_linear_logprobs_entropy"] = True
    rollout, t = _rollout(seed=4), 0.7
    up = torch.randn(B, S - 1, generator=torch.Generator().manual_seed(9))
    mask = rollout["token_mask"][:, 1:]
    out = _run(model, cfg, rollout, _sampling(t), "loss", True, _EntropyLoss(up))
    results = [dict(out=torch.tensor(out["loss"]).double(), **_grads(model))]
    for m in (model, truth):
        logits = m(rollout["input_ids"], None, None)  # [B, S, V/tp]
        full = gather_from_tensor_model_parallel_region(logits)[:, :-1] / t
        ent = -(full.softmax(-1) * full.log_softmax(-1)).sum(-1)
        loss = (ent * up.to(ent.dtype) * mask.to(ent.dtype)).sum()
        loss.backward()
        results.append(dict(out=loss.detach().double(), **_grads(m)))
    _compare(results, f"rank {rank} entropy", S * B * FLOOR)


CHECKS = {
    "parity": _parity_case,
    "bf16_main_grad": _bf16_main_grad_case,
    "distributed_optimizer": _distributed_optimizer_case,
    "errors": _errors_case,
    "entropy": _entropy_case,
}


def _run_checks(rank: int, world: int, checks: list) -> dict[str, str | None]:
    import traceback

    import _megatron_shim  # noqa: F401
    import _nemo_shim

    _nemo_shim.install()
    import logitless.integrations.nemo_rl as nemo  # noqa: F401  (installs)

    _nemo_shim.cpu_reference_path()
    from nemo_rl.distributed.model_utils import patch_gpt_model_forward_for_linear_ce_fusion

    patch_gpt_model_forward_for_linear_ce_fusion(chunk_size=8)
    results: dict[str, str | None] = {}
    for name, args in checks:
        try:
            CHECKS[name.split(":")[0]](rank, *args)
            results[name] = None
        except Exception:  # noqa: BLE001 - reported by the test of this check
            results[name] = f"rank {rank}: {traceback.format_exc()}"
    return results


TWO_RANKS = [
    ("parity:tp2_padded", (2, 1, False, False, False)),
    ("parity:tp2_packed_sp_topk", (2, 1, True, True, True)),
    ("parity:cp2_packed_fuse_loss", (1, 2, True, False, False, 1, True)),
    ("parity:pp2_padded", (1, 1, False, False, False, 2)),
    ("bf16_main_grad", ()),
    ("entropy", ()),
]
# Megatron's gloo copies of its groups (the distributed optimizer's) in a launch of their own
OPTIMIZER_RANKS = [("distributed_optimizer", ()), ("errors", ())]


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return spawn(_run_checks, 2, TWO_RANKS, timeout_s=120.0)


@pytest.fixture(scope="module")
def optimizer_ranks() -> list[dict]:
    return spawn(_run_checks, 2, OPTIMIZER_RANKS, timeout_s=120.0)


def _passed(results: list[dict], name: str) -> None:
    errors = [r[name] for r in results if r[name] is not None]
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("name", [n for n, _ in TWO_RANKS if n.startswith("parity")])
def test_parity_with_nemo_rl_logits_path_and_float64(two_ranks, name):
    """fp32; TP=2 padded, TP=2 with sequence parallelism packed with top-k / top-p, the
    temperature and the reference KL on unfiltered log-probs, CP=2 packed (zigzag), PP=2."""
    _passed(two_ranks, name)


def test_entropy_and_its_gradient_for_a_loss(two_ranks):
    _passed(two_ranks, "entropy")


def test_bf16_main_grad_under_ddp(two_ranks):
    _passed(two_ranks, "bf16_main_grad")


def test_distributed_optimizer_overlap_param_gather(optimizer_ranks):
    _passed(optimizer_ranks, "distributed_optimizer")


def test_bad_input_raises_on_every_rank_before_the_decoder(optimizer_ranks):
    _passed(optimizer_ranks, "errors")
