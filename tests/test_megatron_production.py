"""logitless.integrations.megatron as Megatron is run in production, on gloo ranks against the
real megatron-core (0.16 here, 0.19 in .ci/megatron.sh): a bf16 model (``Float16Module``, bf16
parameters, megatron-core's DDP with fp32 ``main_grad`` and ``grad_reduce_in_fp32``), the
distributed optimizer with ``overlap_grad_reduce`` and ``overlap_param_gather`` over two
optimizer steps, and pipeline parallelism through ``get_forward_backward_func()``.

Every comparison is three-way, as in tests/test_megatron.py: ours (the head inside
``output_layer``'s forward, never the logits), Megatron's own path on the same model (its logits,
``vocab_parallel_cross_entropy``, the composed ``policy_loss``), and a float64 truth; ours must
be within the tolerance derived from Megatron's own error (tests/_tolerance.py). In bf16,
Megatron's path is the bf16 logits (``Float16Module`` hands them back in fp32) into
``vocab_parallel_cross_entropy``; the truth is a float64 copy of the bf16 weights.

Two bf16 checks hold properties of the numerics under the head rather than a comparison:
``test_bf16_main_grad_is_fp32_accumulated`` (the head's weight gradient reaches ``main_grad``
without a bf16 round trip) and ``test_bf16_per_token_loss_scale_unbiased`` (the fused loss's
gradients under ``calculate_per_token_loss`` with a token count bf16 does not hold, T=307,
carry no systematic scale error).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="the megatron extra: pip install -e '.[megatron]'")

import test_megatron as tm  # noqa: E402
from _dist import spawn  # noqa: E402
from _tolerance import FLOOR, assert_no_worse_than_reference  # noqa: E402

import logitless  # noqa: E402

V = tm.V
CONFIG = tm.CONFIG


# --- a bf16 GPTModel as Megatron wraps it for training ------------------------------------


def _bf16_setup(tp: int = 2, sp: bool = False, seed: int = 0):
    """A bf16 GPTModel in ``Float16Module`` in megatron-core's DDP (fp32 ``main_grad``,
    ``grad_reduce_in_fp32``, ``overlap_grad_reduce``); its float64 copy; the builder."""
    from _megatron_shim import gpt_model, init_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    init_parallel(tp)

    def build(dtype=torch.bfloat16, seed=seed):
        half = {"bf16": True} if dtype == torch.bfloat16 else {}
        return gpt_model(tp=tp, sequence_parallel=sp, vocab=V, dtype=dtype, seed=seed, **half)

    model = build()
    truth = tm._float64_copy(model, build)
    config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=True)
    ddp = DistributedDataParallel(model.config, config, module=Float16Module(model.config, model))
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(p.main_grad.dtype == torch.float32 for p in model.parameters())
    return ddp, model, truth, build


def _named_main_grads(ddp) -> dict[str, torch.Tensor]:
    """Every parameter's ``main_grad`` by the GPTModel's own names (Float16Module's prefix
    dropped), after the gradient sync, then zeroed."""
    return {_own_name(n): g for n, g in tm._main_grads(ddp).items()}


def _own_name(name: str) -> str:
    while name.startswith("module."):
        name = name.removeprefix("module.")
    return name


def _head_name(model) -> str:
    from logitless.integrations import megatron
    from logitless.integrations.megatron.model import head_weight

    w = head_weight(megatron.megatron_head(model))
    return next(n for n, p in model.named_parameters() if p is w)


def _bf16_floor(batch: dict) -> float:
    """A bf16 parameter gradient sums every token's bf16 contribution: the floor is the
    summation bound tokens x bf16's eps, the bf16 counterpart of tm._param_floor."""
    return batch["labels"].numel() * torch.finfo(torch.bfloat16).eps


def _compare(ours: dict, ref: dict, exact: dict, what: str, floor: float) -> None:
    assert set(ours) == set(ref) == set(exact), (set(ours) ^ set(ref), set(ref) ^ set(exact))
    for name in ref:
        f = FLOOR if name in ("logp", "ent", "loss", "div") else floor
        assert_no_worse_than_reference(ours[name], ref[name], exact[name], f"{what} {name}",
                                       floor=f)  # fmt: skip


def _bf16_head_case(rank: int, sp: bool) -> None:
    """bf16 (TP=2; then sequence parallelism): log-probs and entropy, the fused loss against
    the composed loss, and every parameter's ``main_grad`` (the head's by gradient-accumulation
    fusion), vs Megatron's bf16 logits path through the same DDP and float64."""
    from logitless.integrations import megatron

    ddp, model, truth, _ = _bf16_setup(2, sp)
    batch = tm._dense_batch(seed=11)
    up = batch["up"]
    floor = _bf16_floor(batch)

    out = megatron.logprobs(
        ddp, *tm._model_inputs(batch), batch["labels"], loss_mask=batch["loss_mask"],
        with_entropy=True,
    )  # fmt: skip
    assert out.logprobs.dtype == out.entropy.dtype == torch.float32
    (out.logprobs * up[0] + out.entropy * up[1]).sum().backward()
    ours = dict(logp=out.logprobs, ent=out.entropy, **_named_main_grads(ddp))
    assert model.output_layer.weight.grad is None, "the head's gradient went to main_grad"
    logp, ent = tm._megatron_path(ddp, batch)
    (logp * up[0] + ent * up[1]).sum().backward()
    ref = dict(logp=logp, ent=ent, **_named_main_grads(ddp))
    logp64, ent64 = tm._megatron_path(truth, batch)
    (logp64 * up[0] + ent64 * up[1]).sum().backward()
    exact = dict(logp=logp64, ent=ent64, **tm._grads(truth))
    _compare(ours, ref, exact, f"rank {rank}: bf16", floor)

    # the fused loss against the composed loss on Megatron's bf16 log-probs
    inputs = tm._loss_inputs(batch, logp)
    loss, _ = megatron.policy_loss(
        ddp, *tm._model_inputs(batch), batch["labels"], inputs, config=CONFIG,
        loss_mask=batch["loss_mask"],
    )  # fmt: skip
    loss.backward()
    fused = dict(loss=loss.detach(), **_named_main_grads(ddp))
    composed = tm._composed(tm._megatron_path(ddp, batch)[0], inputs, None)
    composed.backward()
    composed = dict(loss=composed.detach(), **_named_main_grads(ddp))
    composed64 = tm._composed(tm._megatron_path(truth, batch)[0], inputs, None)
    composed64.backward()
    _compare(fused, composed, dict(loss=composed64.detach(), **tm._grads(truth)),
             f"rank {rank}: bf16 fused", floor)  # fmt: skip


def _bf16_divergence_case(rank: int) -> None:
    """bf16 divergence to a bf16 teacher GPTModel (TP=2, beta=0.5) vs the generalized JSD of
    both models' bf16 logits and float64."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    from megatron.core.transformer.module import Float16Module

    from logitless.integrations import megatron

    beta = 0.5
    ddp, model, truth, build = _bf16_setup(2, False)
    teacher = build(seed=5)
    teacher64 = tm._float64_copy(teacher, build)
    teacher = Float16Module(teacher.config, teacher)
    batch = tm._dense_batch(seed=12)
    up = batch["up"][0]

    def reference(student, teach) -> torch.Tensor:
        def logits(m):
            z = m(*tm._model_inputs(batch)).transpose(0, 1).contiguous()
            return gather_from_tensor_model_parallel_region(z).transpose(0, 1)

        with torch.no_grad():
            lt = logits(teach).log_softmax(-1)
        ls = logits(student).log_softmax(-1)
        lm = torch.logsumexp(torch.stack([ls + torch.tensor(1 - beta).log(),
                                          lt + torch.tensor(beta).log()]), 0)  # fmt: skip
        d = beta * (lt.exp() * (lt - lm)).sum(-1) + (1 - beta) * (ls.exp() * (ls - lm)).sum(-1)
        return torch.where(tm._mask(batch), d, 0.0)

    out = megatron.divergence(
        ddp, teacher, *tm._model_inputs(batch), batch["labels"], beta=beta,
        loss_mask=batch["loss_mask"],
    )  # fmt: skip
    (out.divergence * up).sum().backward()
    ours = dict(div=out.divergence, **_named_main_grads(ddp))
    d = reference(ddp, teacher)
    (d * up).sum().backward()
    ref = dict(div=d, **_named_main_grads(ddp))
    d64 = reference(truth, teacher64)
    (d64 * up).sum().backward()
    _compare(ours, ref, dict(div=d64, **tm._grads(truth)), f"rank {rank}: bf16 divergence",
             _bf16_floor(batch))  # fmt: skip


def _bf16_main_grad_case(rank: int) -> None:
    """After one micro-batch under gradient-accumulation fusion (log-probs and entropy, then
    the fused loss), the head's ``main_grad`` is an fp32 accumulation of the weight-gradient
    products, not bf16-rounded products added into fp32: most of its entries are not bf16
    values, and it is no further from float64 than Megatron's own bf16 weight gradient added
    into ``main_grad`` (rms). Today both fail: every entry is a bf16 value, the very numbers
    of Megatron's bf16 gradient."""
    from logitless.integrations import megatron

    ddp, model, truth, _ = _bf16_setup(2, False)
    batch = tm._dense_batch(seed=13, s=64)
    up = batch["up"]
    inputs = tm._loss_inputs(batch, tm._megatron_path(ddp, batch)[0].detach())
    name = _head_name(model)

    def logprobs(m, ours: bool):
        if ours:
            out = megatron.logprobs(m, *tm._model_inputs(batch), batch["labels"],
                                    loss_mask=batch["loss_mask"], with_entropy=True)  # fmt: skip
            logp, ent = out.logprobs, out.entropy
        else:
            logp, ent = tm._megatron_path(m, batch)
        (logp * up[0] + ent * up[1]).sum().backward()

    def loss(m, ours: bool):
        if ours:
            megatron.policy_loss(
                m, *tm._model_inputs(batch), batch["labels"], inputs, config=CONFIG,
                loss_mask=batch["loss_mask"], gradient_accumulation_fusion=True,
            )[0].backward()  # fmt: skip
        else:
            tm._composed(tm._megatron_path(m, batch)[0], inputs, None).backward()

    failures = []  # asserted after both paths: every rank runs the same collectives
    for what, run in (("logprobs", logprobs), ("fused loss", loss)):
        run(ddp, True)
        main = _named_main_grads(ddp)[name].double()
        run(ddp, False)
        ref = _named_main_grads(ddp)[name].double()
        run(truth, False)
        exact = tm._grads(truth)[name]
        bf16_valued = float((main == main.bfloat16().double())[exact != 0].double().mean())
        err, ref_err = (float((g - exact).square().mean().sqrt()) for g in (main, ref))
        if bf16_valued >= 0.5:
            failures.append(
                f"rank {rank} ({what}): {bf16_valued:.1%} of the head's main_grad entries are "
                "bf16 values after one micro-batch: the weight-gradient products were rounded "
                "to bf16 before the fp32 add"
            )
        if err > ref_err:
            failures.append(
                f"rank {rank} ({what}): the head's main_grad is {err:.3e} (rms) off float64, "
                f"further than Megatron's bf16 weight gradient added into main_grad "
                f"({ref_err:.3e})"
            )
    assert not failures, "\n".join(failures)


def _per_token_batches() -> list[dict]:
    """Two micro-batches whose trained tokens add up to T = 307 (bf16 holds 306 and 308)."""
    batches = [tm._dense_batch(seed=s, s=80) for s in (14, 15)]
    batches[1]["loss_mask"][1, :3] = 0  # 155 + 152 tokens
    assert sum(int(tm._mask(b).sum()) for b in batches) == 307
    return batches


def _relative_bias(grads: dict, exact: dict) -> float:
    """The systematic scale error of a set of gradients: the least-squares factor ``a`` of
    ``grads ≈ a · exact`` over every entry, minus 1."""
    num = sum(float((grads[n].double() * exact[n].double()).sum()) for n in exact)
    den = sum(float(exact[n].double().square().sum()) for n in exact)
    return num / den - 1.0


def _bf16_per_token_case(rank: int) -> None:
    """calculate_per_token_loss=True through get_forward_backward_func and Megatron's own
    finalize_model_grads (it divides the gradients by the step's T = 307 tokens, the loss
    function multiplied by T): ours (policy_loss_step) vs the composed loss on Megatron's bf16
    logits through the same schedule, and float64. The gradients carry no scale error: their
    least-squares factor against float64 is within 4x Megatron's own (a scale applied in bf16
    gives bf16(307)/307 - 1 = +3.3e-3)."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from logitless.integrations import megatron

    ddp, model, truth, _ = _bf16_setup(2, False)
    batches = _per_token_batches()
    head = megatron.megatron_head(ddp)
    masks = [megatron.token_layout(head, b["labels"], b["loss_mask"])[0] for b in batches]
    norm = megatron.step_normalizer(
        masks, [b["document_ids"] for b in batches], calculate_per_token_loss=True
    )
    assert int(norm.num_tokens) == 307
    inputs = []
    for b in batches:
        with torch.no_grad():
            inputs.append(tm._loss_inputs(b, tm._megatron_path(ddp, b)[0]))
    model.config.calculate_per_token_loss = True
    model.config.finalize_model_grads_func = finalize_model_grads

    def run(forward_step) -> dict:
        data = list(zip(batches, inputs, strict=True))
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(data),
            model=[ddp], num_microbatches=2, seq_length=80, micro_batch_size=2,
            forward_only=False,
        )  # fmt: skip
        return _after_schedule(ddp)

    def ours_step(it, m):
        b, inp = next(it)
        return megatron.policy_loss_step(
            m, *tm._model_inputs(b), b["labels"], inp, config=CONFIG, normalizer=norm,
            num_microbatches=2, calculate_per_token_loss=True, loss_mask=b["loss_mask"],
        )  # fmt: skip

    def megatron_step(it, m):
        b, inp = next(it)
        logp = tm._megatron_path(m, b)[0]
        loss, _ = logitless.policy_loss(
            logp, inp.old_logprobs, inp.advantages, inp.mask, config=CONFIG,
            document_ids=inp.document_ids, normalizer=norm,
        )  # fmt: skip
        n = tm._mask(b).sum().to(torch.int)
        return loss, lambda out: (out * norm.num_tokens, n, {})

    ours, ref = run(ours_step), run(megatron_step)
    for b, inp in zip(batches, inputs, strict=True):
        logp = tm._megatron_path(truth, b)[0]
        loss, _ = logitless.policy_loss(
            logp, inp.old_logprobs.double(), inp.advantages.double(), inp.mask, config=CONFIG,
            document_ids=inp.document_ids, normalizer=norm,
        )  # fmt: skip
        loss.backward()
    exact = tm._grads(truth)
    _compare(ours, ref, exact, f"rank {rank}: per-token step", 2 * _bf16_floor(batches[0]))
    bias, ref_bias = _relative_bias(ours, exact), _relative_bias(ref, exact)
    assert abs(bias) <= 4 * abs(ref_bias) + 2e-4, (
        f"rank {rank}: the step's gradients are scaled by 1{bias:+.2e} against float64 "
        f"(Megatron's own path: 1{ref_bias:+.2e}): the upstream gradient T=307 was applied "
        "in bf16"
    )


# --- the distributed optimizer, both overlaps, two steps -----------------------------------

ADAM = dict(lr=0.05, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-2)


def _schedule_config(ddp, per_token: bool = False) -> None:
    """What Megatron-LM's training loop sets on the model's config for its schedule: DDP's
    no_sync and grad-sync functions, finalize_model_grads, the loss mode."""
    from megatron.core.distributed import finalize_model_grads

    config = ddp.module.config if hasattr(ddp.module, "config") else ddp.config
    config.no_sync_func = ddp.no_sync
    config.grad_sync_func = ddp.start_grad_sync
    config.finalize_model_grads_func = finalize_model_grads
    config.calculate_per_token_loss = per_token


def _megatron_step(micro_batches, normalizer, per_token: bool = False):
    """A forward_step on Megatron's logits path: vocab_parallel_cross_entropy, then the
    composed policy_loss with the step normalizer, scaled as policy_loss_step scales its
    loss for the schedule; on a stage without the head, the model's output."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from logitless.integrations.megatron.model import gpt_model

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        out = model(mb["tokens"], mb["position_ids"], None)
        if not gpt_model(model).post_process:
            return out, None
        logits = out.transpose(0, 1).contiguous()
        logp = -vocab_parallel_cross_entropy(logits, mb["labels"].T.contiguous()).T
        mask = mb["mask"]
        loss, _ = logitless.policy_loss(
            torch.where(mask, logp, 0.0), mb["old_logprobs"].to(logp.dtype),
            mb["advantages"].to(logp.dtype), mask, config=CONFIG,
            document_ids=mb["document_ids"], normalizer=normalizer,
        )  # fmt: skip
        n = mask.sum().to(torch.int)
        scale = normalizer.num_tokens if per_token else n * len(micro_batches)
        return loss, lambda output: (output * scale, n, {})

    return forward_step


def _run_schedule(model, micro_batches, forward_step) -> None:
    """``get_forward_backward_func()`` over ``micro_batches``; ``model`` a list of model chunks
    (virtual pipeline stages): a data iterator per chunk, as the interleaved schedule takes."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    data = [iter(micro_batches) for _ in model] if isinstance(model, list) else iter(micro_batches)
    get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=data, model=model,
        num_microbatches=len(micro_batches), seq_length=micro_batches[0]["tokens"].shape[1],
        micro_batch_size=micro_batches[0]["tokens"].shape[0], forward_only=False,
    )  # fmt: skip


def _after_schedule(ddp) -> dict[str, torch.Tensor]:
    """Every parameter's ``main_grad`` as the schedule's finalize_model_grads left it (synced,
    divided by the step's tokens in the per-token mode), by the GPTModel's names; then
    zeroed."""
    grads = {_own_name(n): p.main_grad.clone() for n, p in ddp.named_parameters()}
    ddp.zero_grad_buffer()
    return grads


def _micro_batches(seeds) -> list[dict]:
    """examples/megatron_step.py's micro-batches, with the mask of the tokens trained on."""
    example = tm._example()
    out = []
    for seed in seeds:
        mb = example.micro_batch(seed, V)
        mb["attention_mask"] = None  # the test model's attention is token-local
        mb["mask"] = mb["loss_mask"] != 0
        out.append(mb)
    return out


def _distributed_optimizer_case(rank: int, tp: int) -> None:
    """megatron-core's DistributedOptimizer (Adam) under DDP with use_distributed_optimizer,
    overlap_grad_reduce and overlap_param_gather (TP=tp, DP=the rest): two optimizer steps of
    docs/megatron.md's recipe (two micro-batches per data-parallel rank). After each step the
    parameters equal those of the same run on Megatron's logits path, and float64 (the same
    steps of torch's Adam on a float64 copy). The parameters of step 2's forward are
    all-gathered from the optimizer's shards by output_layer's forward pre-hook: a head that
    bypassed it would score stale weights."""
    from _megatron_shim import gpt_model, init_parallel
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from logitless.integrations import megatron

    init_parallel(tp, gloo_groups=True)
    example = tm._example()
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=True, use_distributed_optimizer=True,
        overlap_param_gather=True, bucket_size=4000,
    )  # fmt: skip
    runs = {}
    for name in ("ours", "megatron"):
        model = gpt_model(tp=tp, vocab=V, seed=0)
        ddp = DistributedDataParallel(model.config, ddp_config, module=model)
        _schedule_config(ddp)
        opt = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", weight_decay=0.0, clip_grad=0.0,
                            use_distributed_optimizer=True, **ADAM),
            [ddp],
        )  # fmt: skip
        runs[name] = (model, ddp, opt)
    assert len(runs["ours"][1].bucket_groups) > 1, "several buckets: a gather per bucket"
    truth = tm._float64_copy(runs["ours"][0], lambda dtype: gpt_model(tp=tp, vocab=V, dtype=dtype))
    initial = {n: p.detach().double().clone() for n, p in truth.named_parameters()}
    adam = torch.optim.Adam(
        truth.parameters(), lr=ADAM["lr"], betas=(ADAM["adam_beta1"], ADAM["adam_beta2"]),
        eps=ADAM["adam_eps"],
    )  # fmt: skip
    seen = {}
    for step in range(2):
        every = [_micro_batches((100 * step + 10 * r, 100 * step + 10 * r + 1)) for r in range(dp)]
        mbs = every[dp_rank]
        norm = megatron.step_normalizer([mb["mask"] for mb in mbs],
                                        [mb["document_ids"] for mb in mbs])  # fmt: skip
        for name, (model, ddp, opt) in runs.items():
            ddp.zero_grad_buffer()
            opt.zero_grad()
            if name == "ours":
                example.train_step(ddp, mbs)
            else:
                _run_schedule(ddp, mbs, _megatron_step(mbs, norm))
            seen[name] = {n: p.detach().clone() for n, p in model.named_parameters()}
            assert opt.step()[0], f"{name}: the optimizer step was skipped"
        # the truth: the step's gradient over every data-parallel rank's micro-batches
        for mb in (m for batches in every for m in batches):
            logits = _gathered_logits(truth, mb)
            logp = logits.log_softmax(-1).gather(-1, mb["labels"][..., None])[..., 0]
            loss, _ = logitless.policy_loss(
                torch.where(mb["mask"], logp, 0.0), mb["old_logprobs"].double(),
                mb["advantages"].double(), mb["mask"], config=CONFIG,
                document_ids=mb["document_ids"], normalizer=norm,
            )  # fmt: skip
            (loss / dp).backward()
        if step == 1:  # the parameters after step 1, as step 2's forward gathered them
            _compare_parameters(seen, truth, initial, f"rank {rank} after step 1")
        adam.step()
        adam.zero_grad()
    for name, (model, ddp, _) in runs.items():
        ddp.start_param_sync(force_sync=True)
        seen[name] = {n: p.detach().clone() for n, p in model.named_parameters()}
    _compare_parameters(seen, truth, initial, f"rank {rank} after step 2")


def _gathered_logits(model, mb) -> torch.Tensor:
    """``[B, S, V]`` logits of ``model`` (gathered over the tensor-parallel group)."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    z = model(mb["tokens"], mb["position_ids"], None).transpose(0, 1).contiguous()
    return gather_from_tensor_model_parallel_region(z).transpose(0, 1)


def _compare_parameters(seen: dict, truth, initial: dict, what: str) -> None:
    """Each parameter's change since the start, ours vs Megatron's path vs float64."""
    for n, exact in truth.named_parameters():
        exact = exact.detach()
        ours, ref = seen["ours"][n].double(), seen["megatron"][n].double()
        assert_no_worse_than_reference(
            ours - initial[n], ref - initial[n], exact - initial[n], f"{what}: {n}",
            floor=1e-6,
        )  # fmt: skip


# --- pipeline parallelism ---------------------------------------------------------------


def _pipeline_case(rank: int, tp: int, tied: bool, per_token: bool) -> None:
    """PP=2 (x TP=tp) through get_forward_backward_func()'s 1F1B schedule over 4
    micro-batches, megatron-core's DDP (overlap_grad_reduce) and finalize_model_grads:
    docs/megatron.md's recipe, unchanged on both stages, gives every parameter of both stages
    the main_grad of Megatron's logits path through the same schedule, and float64 (the same
    schedule on a float64 copy of each stage). ``tied``: the last stage's copy of the word
    embedding, its gradient all-reduced with the first stage's. Then bad input raises
    ValueError on every stage before the schedule starts."""
    from _megatron_shim import gpt_model, init_parallel
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from logitless.integrations import megatron

    init_parallel(tp, pp=2)

    def build(dtype=torch.float32):
        return gpt_model(tp=tp, pp=2, layers=2, vocab=V, tied=tied, dtype=dtype)

    model = build()
    truth = tm._float64_copy(model, build)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=True)
    ddp = DistributedDataParallel(model.config, ddp_config, module=model)
    ddp64 = DistributedDataParallel(truth.config, ddp_config, module=truth)
    for d in (ddp, ddp64):
        _schedule_config(d, per_token)
    mbs = _micro_batches(range(20, 24))
    layouts = [megatron.token_layout(ddp, mb["labels"], mb["loss_mask"]) for mb in mbs]
    norm = megatron.step_normalizer(
        [m for m, _ in layouts], [mb["document_ids"] for mb in mbs],
        calculate_per_token_loss=per_token,
    )  # fmt: skip

    tm._example().train_step(ddp, mbs, per_token=per_token)
    ours = _after_schedule(ddp)
    _run_schedule(ddp, mbs, _megatron_step(mbs, norm, per_token))
    ref = _after_schedule(ddp)
    _run_schedule(ddp64, mbs, _megatron_step(mbs, norm, per_token))
    exact = _after_schedule(ddp64)
    stage = ps.get_pipeline_model_parallel_rank()
    assert any("output_layer" in n for n in ours) == (stage == 1), sorted(ours)
    _compare(ours, ref, exact, f"rank {rank} (stage {stage})", 4 * tm._param_floor(mbs[0]))

    # a loss_mask that does not match the labels: refused on both stages, by token_layout
    bad = [dict(mb, loss_mask=mb["loss_mask"][:, :-1]) for mb in mbs]
    with pytest.raises(ValueError, match="loss_mask must have the labels' shape"):
        tm._example().train_step(ddp, bad, per_token=per_token)


def _interleaved_train_step(chunks: list, micro_batches: list[dict]) -> None:
    """docs/megatron.md's recipe for interleaved (virtual) pipeline stages: the layout read
    from one chunk, a data iterator per chunk, the recipe's forward_step on every chunk."""
    from logitless.integrations import megatron as lm
    from logitless.integrations.seam import LossInputs

    example = tm._example()
    layouts = [lm.token_layout(chunks[-1], mb["labels"], mb["loss_mask"]) for mb in micro_batches]
    normalizer = lm.step_normalizer([m for m, _ in layouts], [d for _, d in layouts])

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        inputs = LossInputs(old_logprobs=mb["old_logprobs"], advantages=mb["advantages"],
                            document_ids=mb["document_ids"])  # fmt: skip
        return lm.policy_loss_step(
            model, mb["tokens"], mb["position_ids"], mb["attention_mask"], mb["labels"],
            inputs, config=example.config, normalizer=normalizer,
            num_microbatches=len(micro_batches), loss_mask=mb["loss_mask"],
            packed_seq_params=mb["packed_seq_params"],
        )  # fmt: skip

    _run_schedule(chunks, micro_batches, forward_step)


def _virtual_pipeline_case(rank: int) -> None:
    """PP=2 with two virtual stages per rank (interleaved 1F1B: four model chunks of one
    layer, the head on rank 1's second chunk), 4 micro-batches, megatron-core's DDP per chunk
    and finalize_model_grads: every parameter of every chunk gets the main_grad of Megatron's
    logits path through the same schedule, and float64."""
    from _megatron_shim import gpt_model, init_parallel
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

    from logitless.integrations import megatron

    init_parallel(1, pp=2, vpp=2)

    def build(vp_stage, dtype=torch.float32):
        return gpt_model(pp=2, vpp=2, vp_stage=vp_stage, layers=4, vocab=V, dtype=dtype)

    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=True)
    runs = []
    for dtype in (torch.float32, torch.float64):
        chunks = []
        for i in range(2):
            model = build(i)
            if dtype == torch.float64:
                model = tm._float64_copy(model, lambda dtype, i=i: build(i, dtype))
            chunks.append(DistributedDataParallel(model.config, ddp_config, module=model,
                                                  disable_bucketing=i > 0))  # fmt: skip
        config = chunks[0].module.config  # what Megatron-LM sets for the interleaved schedule
        config.no_sync_func = [c.no_sync for c in chunks]
        config.grad_sync_func = [c.start_grad_sync for c in chunks]
        config.finalize_model_grads_func = finalize_model_grads
        runs.append(chunks)
    mbs = _micro_batches(range(30, 34))
    chunks, chunks64 = runs
    norm = megatron.step_normalizer(
        [megatron.token_layout(chunks[-1], mb["labels"], mb["loss_mask"])[0] for mb in mbs],
        [mb["document_ids"] for mb in mbs],
    )  # fmt: skip

    def grads(chunks):
        return {f"{i}.{n}": g for i, c in enumerate(chunks) for n, g in _after_schedule(c).items()}

    from megatron.core.pipeline_parallel import get_forward_backward_func, schedules

    assert get_forward_backward_func() is schedules.forward_backward_pipelining_with_interleaving
    _interleaved_train_step(chunks, mbs)
    ours = grads(chunks)
    _run_schedule(chunks, mbs, _megatron_step(mbs, norm))
    ref = grads(chunks)
    _run_schedule(chunks64, mbs, _megatron_step(mbs, norm))
    exact = grads(chunks64)
    assert sum("output_layer" in n for n in ours) == (rank == 1), sorted(ours)
    _compare(ours, ref, exact, f"rank {rank}", 4 * tm._param_floor(mbs[0]))


CHECKS = {
    "bf16_head": _bf16_head_case,
    "bf16_divergence": _bf16_divergence_case,
    "bf16_main_grad": _bf16_main_grad_case,
    "bf16_per_token": _bf16_per_token_case,
    "distributed_optimizer": _distributed_optimizer_case,
    "pipeline": _pipeline_case,
    "virtual_pipeline": _virtual_pipeline_case,
}


def _run_checks(rank: int, world: int, checks: list[tuple[str, tuple]]) -> dict[str, str | None]:
    """Each check on this rank; its failure as text (None: passed). Unlike tm._run_checks it
    runs the checks after a failure too: the checks here assert only after their last
    collective, so a failure leaves the ranks in step (one that does not, hangs the
    remaining checks into the group's timeout)."""
    import traceback

    import _megatron_shim  # noqa: F401  (the warning filters, before megatron's imports)

    results: dict[str, str | None] = {}
    for name, args in checks:
        try:
            CHECKS[name.split(":")[0]](rank, *args)
            results[name] = None
        except Exception:  # noqa: BLE001 - reported by the test of this check
            results[name] = f"rank {rank}: {traceback.format_exc()}"
    return results


TWO_RANKS = [
    ("pipeline", (1, False, False)),
    ("pipeline:tied_per_token", (1, True, True)),
    ("virtual_pipeline", ()),
    ("distributed_optimizer", (1,)),
    ("bf16_head", (False,)),
    ("bf16_head:sp", (True,)),
    ("bf16_divergence", ()),
    ("bf16_main_grad", ()),
    ("bf16_per_token", ()),
]


FOUR_RANKS = [("pipeline:tp2_tied", (2, True, False))]


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return spawn(_run_checks, 2, TWO_RANKS, timeout_s=120.0)


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    return spawn(_run_checks, 4, FOUR_RANKS, timeout_s=120.0)


@pytest.mark.parametrize("name", ["bf16_head", "bf16_head:sp"])
def test_bf16_head_matches_megatron_and_float64(two_ranks, name):
    """Float16Module + DDP (fp32 main_grad, grad_reduce_in_fp32), TP=2 (then with sequence
    parallelism): log-probs, entropy, the fused loss and every main_grad vs Megatron's bf16
    logits path and float64."""
    tm._passed(two_ranks, name)


def test_bf16_divergence_matches_megatron_and_float64(two_ranks):
    tm._passed(two_ranks, "bf16_divergence")


def test_bf16_main_grad_is_fp32_accumulated(two_ranks):
    """The head's main_grad after one micro-batch (log-probs and the fused loss) is an fp32
    accumulation, not a bf16-rounded product (issue 40)."""
    tm._passed(two_ranks, "bf16_main_grad")


def test_bf16_per_token_loss_scale_unbiased(two_ranks):
    """calculate_per_token_loss=True with T=307 tokens: no bf16(T)/T scale error in the fused
    loss's gradients (issue 39, item 1)."""
    tm._passed(two_ranks, "bf16_per_token")


def test_distributed_optimizer_two_steps(two_ranks):
    """DistributedOptimizer with overlap_grad_reduce and overlap_param_gather (DP=2): the
    parameters after each of two steps equal Megatron's logits path and float64."""
    tm._passed(two_ranks, "distributed_optimizer")


@pytest.mark.parametrize("name", ["pipeline", "pipeline:tied_per_token"])
def test_pipeline_parallel_recipe(two_ranks, name):
    """PP=2, 4 micro-batches through get_forward_backward_func(): docs/megatron.md's recipe on
    both stages gives Megatron's gradients (then with tied embeddings and the per-token loss);
    bad input raises on both stages."""
    tm._passed(two_ranks, name)


def test_virtual_pipeline_stages(two_ranks):
    """PP=2 x two virtual stages (interleaved 1F1B, a list of model chunks): the recipe with a
    data iterator per chunk gives every chunk's main_grad of Megatron's path and float64."""
    tm._passed(two_ranks, "virtual_pipeline")


def test_pipeline_and_tensor_parallel(four_ranks):
    """TP=2 x PP=2 on 4 ranks, tied embeddings: the recipe on both stages gives Megatron's
    gradients on every rank."""
    tm._passed(four_ranks, "pipeline:tp2_tied")
