"""logitless.integrations.megatron against the real megatron-core on gloo ranks: 0.16 in the
main suite (Python 3.11), 0.19 in .ci/megatron.sh (Python 3.12), which also covers
``GPTModel.forward(output_processor=...)`` and MuP's logit scaling.

Each case builds one tiny GPTModel per rank (tests/_megatron_shim.py) and runs, on the same
weights and the same batch:

- ours: ``megatron.logprobs`` / ``megatron.policy_loss`` (the head inside ``output_layer``'s
  forward, never the logits);
- Megatron's own path (the reference): ``model(...)`` gives the ``[B, S, V/tp]`` logits, then
  ``vocab_parallel_cross_entropy`` and the entropy of the tensor-parallel-gathered logits;
- the truth: Megatron's path on a float64 copy of the model.

Log-probs, entropy and every parameter's gradient (the weight shard, every decoder parameter
through the hidden states) under random upstream gradients must be within the tolerance
derived from the reference's own error (tests/_tolerance.py); the fused loss is held to the
composed ``policy_loss`` on each path's log-probs the same way.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

pytest.importorskip("megatron.core", reason="the megatron extra: pip install -e '.[megatron]'")

from _dist import spawn  # noqa: E402
from _tolerance import FLOOR, assert_no_worse_than_reference  # noqa: E402

import logitless  # noqa: E402
from logitless.parallel import context_parallel_split  # noqa: E402

V = 1000
CONFIG = logitless.PolicyLossConfig(clip_high=0.28, aggregation="seq_mean_token_mean")


def _megatron_at_least(version: str) -> bool:
    from megatron.core import __version__
    from packaging.version import Version

    return Version(__version__) >= Version(version)


# GPTModel.forward takes an output_processor from megatron-core 0.19; from then on its logits
# are also multiplied by mup_output_mult where the config has use_mup.
OUTPUT_PROCESSOR = _megatron_at_least("0.19")
MUP_SCALES_LOGITS = _megatron_at_least("0.19")
MUP = {"use_mup": True, "mup_output_mult": 0.37}


# --- batches ------------------------------------------------------------------------------


def _dense_batch(seed: int = 1, b: int = 2, s: int = 16) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (b, s), generator=g)
    labels = torch.cat([ids[:, 1:], torch.zeros(b, 1, dtype=ids.dtype)], 1)
    mask = torch.ones(b, s)
    mask[:, -1] = 0
    mask[0, :3] = 0  # a prompt
    return dict(
        input_ids=ids,
        position_ids=torch.arange(s).expand(b, s),
        labels=labels,
        loss_mask=mask,
        packed_seq_params=None,
        up=torch.randn(2, b, s, generator=g),
        advantages=torch.randn(b, s, generator=g),
        document_ids=torch.arange(b)[:, None].expand(b, s),
    )


def _packed_batch(cp: int, cp_rank: int, multiple: int, seed: int = 2) -> dict:
    """Three documents packed THD, each padded to ``multiple`` and split zigzag over cp."""
    from megatron.core.packed_seq_params import PackedSeqParams

    g = torch.Generator().manual_seed(seed)
    lengths = [7, 13, 4]
    padded = [-(-n // multiple) * multiple for n in lengths]
    pieces = {k: [] for k in ("input_ids", "position_ids", "labels", "loss_mask", "up", "doc")}
    for d, (n, n_pad) in enumerate(zip(lengths, padded, strict=True)):
        ids = torch.randint(0, V, (n_pad,), generator=g)
        labels = torch.cat([ids[1:], ids.new_zeros(1)])
        mask = torch.ones(n_pad)  # the padding is left to packed_seq_params to exclude
        mask[:2] = 0  # a prompt
        mask[n - 1] = 0  # the document's last token has no next token
        full = dict(
            input_ids=ids,
            position_ids=torch.arange(n_pad),
            labels=labels,
            loss_mask=mask,
            up=torch.randn(2, n_pad, generator=g),
            doc=torch.where(torch.arange(n_pad) < n, d, -1),
        )
        for k, t in full.items():
            dim = 1 if k == "up" else 0
            pieces[k].append(context_parallel_split(t, cp_rank, cp, layout="zigzag", dim=dim)
                             if cp > 1 else t)  # fmt: skip
    batch = {k: torch.cat(v, 1 if k == "up" else 0) for k, v in pieces.items()}
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    cu_pad = torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()], dtype=torch.int32)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu_pad,
        cu_seqlens_kv_padded=cu_pad,
        max_seqlen_q=max(padded),
        max_seqlen_kv=max(padded),
    )
    return dict(
        input_ids=batch["input_ids"][None],
        position_ids=batch["position_ids"][None],
        labels=batch["labels"][None],
        loss_mask=batch["loss_mask"][None],
        packed_seq_params=params,
        up=batch["up"][:, None],
        advantages=torch.randn(len(lengths), generator=g),
        document_ids=batch["doc"][None],
    )


# --- the three paths ----------------------------------------------------------------------


def _model_inputs(batch: dict) -> tuple:
    return batch["input_ids"], batch["position_ids"], None


def _capture_hidden(model, store: list):
    """A forward pre-hook on output_layer: the hidden states it gets, and their gradient."""

    def hook(module, args):
        hidden = args[0]
        store.append(hidden)
        if hidden.requires_grad:
            hidden.register_hook(lambda g: store.append(g))

    return model.output_layer.register_forward_pre_hook(hook)


def _megatron_path(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's own log-probs and entropy: [B, S] from the logits."""
    from megatron.core.tensor_parallel import (
        gather_from_tensor_model_parallel_region,
        vocab_parallel_cross_entropy,
    )

    logits = model(*_model_inputs(batch), packed_seq_params=batch["packed_seq_params"])
    logits = logits.transpose(0, 1).contiguous()  # [S, B, V/tp] (a copy: the loss writes it)
    labels = batch["labels"].transpose(0, 1).contiguous()
    logp = -vocab_parallel_cross_entropy(logits.clone(), labels).transpose(0, 1)
    full = gather_from_tensor_model_parallel_region(logits)
    ent = -(full.softmax(-1) * full.log_softmax(-1)).sum(-1).transpose(0, 1)
    mask = _mask(batch)
    return torch.where(mask, logp, 0.0), torch.where(mask, ent, 0.0)


def _mask(batch: dict) -> torch.Tensor:
    return (batch["loss_mask"] != 0) & (batch["document_ids"] >= 0)


def _param_floor(batch: dict) -> float:
    """A parameter's gradient sums every token's backward of its hidden-state gradient: one
    sample of the reference's rounding can cancel in that sum, so its floor is the fp32
    summation bound tokens * eps (as tests/test_hf.py holds the HF backbones' gradients); the
    hidden-state gradient itself is held to the one-ulp floor."""
    return batch["labels"].numel() * FLOOR


def _grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def _float64_copy(model, build):
    truth = build(dtype=torch.float64)
    with torch.no_grad():
        for p64, p in zip(truth.parameters(), model.parameters(), strict=True):
            p64.copy_(p)
    return truth


def _loss_inputs(batch: dict, logp: torch.Tensor):
    from logitless.integrations.seam import LossInputs

    g = torch.Generator().manual_seed(7)
    old = logp.detach() + 0.1 * torch.randn(logp.shape, generator=g)
    return LossInputs(
        old_logprobs=old.float(),
        advantages=batch["advantages"],
        mask=_mask(batch),
        document_ids=batch["document_ids"],
    )


def _composed(logp, inputs, cp_group):
    loss, _ = logitless.policy_loss(
        logp, inputs.old_logprobs.to(logp.dtype), inputs.advantages.to(logp.dtype),
        inputs.mask, config=CONFIG, document_ids=inputs.document_ids, context_group=cp_group,
    )  # fmt: skip
    return loss


def _setup(tp: int, cp: int, sp: bool, tied: bool = False, seed: int = 0, **config):
    """Megatron's groups for this case, the model, a float64 copy and the model builder;
    ``config``: more TransformerConfig fields."""
    from _megatron_shim import gpt_model, init_parallel

    init_parallel(tp, cp)

    def build(dtype=torch.float32, seed=seed):
        return gpt_model(
            tp=tp, cp=cp, sequence_parallel=sp, vocab=V, tied=tied, dtype=dtype, seed=seed,
            **config,
        )  # fmt: skip

    model = build()
    return model, _float64_copy(model, build), build


def _batch(tp: int, cp: int, sp: bool, packed: bool, seed: int = 1) -> dict:
    from megatron.core import parallel_state as ps

    if packed:
        rank = ps.get_context_parallel_rank()
        return _packed_batch(cp, rank, 2 * cp * (tp if sp else 1), seed=seed)
    return _dense_batch(seed=seed)


def _head_case(
    rank: int, tp: int, cp: int, sp: bool, tied: bool, packed: bool, mup: bool = False
) -> None:
    from megatron.core import parallel_state as ps

    from logitless.integrations import megatron

    # MuP (megatron-core 0.19+): GPTModel scales its logits by mup_output_mult
    model, truth, _ = _setup(tp, cp, sp, tied, **(MUP if mup else {}))
    cp_group = ps.get_context_parallel_group() if cp > 1 else None
    batch = _batch(tp, cp, sp, packed)
    up = batch["up"]

    if packed:  # the tokens trained on and their documents, read from packed_seq_params
        mask, doc = megatron.token_layout(
            megatron.megatron_head(model), batch["labels"], batch["loss_mask"],
            batch["packed_seq_params"],
        )  # fmt: skip
        assert torch.equal(mask, _mask(batch)) and torch.equal(doc, batch["document_ids"])

    # ours; the pre-hook on output_layer fires once, with the hidden states
    seen: list = []
    handle = _capture_hidden(model, seen)
    processors: list = []  # what GPTModel.forward got as its output_processor
    spy = model.register_forward_pre_hook(
        lambda m, a, kw: processors.append(kw.get("output_processor")), with_kwargs=True
    )
    out = megatron.logprobs(
        model, *_model_inputs(batch), batch["labels"], loss_mask=batch["loss_mask"],
        packed_seq_params=batch["packed_seq_params"], with_entropy=True,
    )  # fmt: skip
    spy.remove()
    assert len(seen) == 1, "output_layer's forward pre-hook must fire once, before the head"
    # the seam Megatron offers where it has one (0.19+), else output_layer's own forward
    assert (processors[0] is not None) == OUTPUT_PROCESSOR, (processors, OUTPUT_PROCESSOR)
    (out.logprobs * up[0] + out.entropy * up[1]).sum().backward()
    ours = dict(logp=out.logprobs, ent=out.entropy, dh=seen[1], **_grads(model))

    seen.clear()
    logp, ent = _megatron_path(model, batch)
    (logp * up[0] + ent * up[1]).sum().backward()
    ref = dict(logp=logp, ent=ent, dh=seen[1], **_grads(model))
    handle.remove()

    seen.clear()
    _capture_hidden(truth, seen)
    logp64, ent64 = _megatron_path(truth, batch)
    (logp64 * up[0] + ent64 * up[1]).sum().backward()
    exact = dict(logp=logp64, ent=ent64, dh=seen[1], **_grads(truth))

    assert set(ours) == set(ref) == set(exact), (set(ours) ^ set(ref), set(ref) ^ set(exact))
    floor = _param_floor(batch)
    for name in ref:
        f = floor if name not in ("logp", "ent", "dh") else FLOOR
        assert_no_worse_than_reference(
            ours[name], ref[name], exact[name], f"rank {rank}: {name}", floor=f
        )

    # the fused loss equals the composed loss (and its gradients); a packed batch's document
    # ids are the library's own (read from packed_seq_params)
    inputs = _loss_inputs(batch, logp)
    loss, _ = megatron.policy_loss(
        model, *_model_inputs(batch), batch["labels"],
        inputs.replace(document_ids=None) if packed else inputs, config=CONFIG,
        loss_mask=batch["loss_mask"], packed_seq_params=batch["packed_seq_params"],
    )  # fmt: skip
    loss.backward()
    fused = dict(loss=loss.detach(), **_grads(model))
    composed = _composed(_megatron_path(model, batch)[0], inputs, cp_group)
    composed.backward()
    composed = dict(loss=composed.detach(), **_grads(model))
    composed64 = _composed(_megatron_path(truth, batch)[0], inputs, cp_group)
    composed64.backward()
    composed64 = dict(loss=composed64.detach(), **_grads(truth))
    assert set(fused) == set(composed)
    for name in composed:
        assert_no_worse_than_reference(
            fused[name], composed[name], composed64[name], f"rank {rank}: fused {name}",
            floor=FLOOR if name == "loss" else floor,
        )  # fmt: skip


def _example():
    """examples/megatron_step.py, whose train_step is docs/megatron.md's recipe."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "megatron_step.py"
    spec = importlib.util.spec_from_file_location("megatron_step", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _schedule_case(rank: int, per_token: bool, sp: bool) -> None:
    """docs/megatron.md's recipe (examples/megatron_step.train_step): Megatron's own schedule
    (get_forward_backward_func) over two micro-batches drives policy_loss_step; the step's
    gradients equal the composed policy_loss of both micro-batches with the same step
    normalizer (float64 truth beside)."""
    from logitless.integrations import megatron

    example = _example()
    model, truth, _ = _setup(2, 1, sp)
    head = megatron.megatron_head(model)
    batches = [_dense_batch(seed=s) for s in (3, 4)]
    masks = [megatron.token_layout(head, b["labels"], b["loss_mask"])[0] for b in batches]
    norm = megatron.step_normalizer(
        masks, [b["document_ids"] for b in batches], calculate_per_token_loss=per_token
    )
    micro_batches = []
    for b, m in zip(batches, masks, strict=True):
        with torch.no_grad():
            logp = megatron.logprobs(model, *_model_inputs(b), b["labels"], loss_mask=m)
        inp = _loss_inputs(b, logp.logprobs)
        micro_batches.append(
            dict(tokens=b["input_ids"], position_ids=b["position_ids"], attention_mask=None,
                 labels=b["labels"], loss_mask=b["loss_mask"], packed_seq_params=None,
                 old_logprobs=inp.old_logprobs, advantages=inp.advantages,
                 document_ids=inp.document_ids, mask=inp.mask)
        )  # fmt: skip

    def finalize(models, num_tokens, **kwargs):  # what finalize_model_grads does to the grads
        if num_tokens is not None:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.div_(num_tokens)

    model.config.calculate_per_token_loss = per_token
    model.config.finalize_model_grads_func = finalize
    from logitless.integrations.megatron import layout

    reads, read = [], layout._token_layout
    layout._token_layout = lambda *a: reads.append(1) or read(*a)
    try:
        example.train_step(model, micro_batches, per_token=per_token)
    finally:
        layout._token_layout = read
    # each micro-batch's layout read twice: once by train_step for the step's normalizer
    # (examples/megatron_step.py), once by its policy_loss_step (which used to read it twice)
    assert len(reads) == 2 * len(micro_batches), len(reads)
    ours = _grads(model)

    def composed(m) -> dict:
        for mb in micro_batches:
            batch = dict(input_ids=mb["tokens"], position_ids=mb["position_ids"],
                         labels=mb["labels"], loss_mask=mb["loss_mask"],
                         packed_seq_params=None, document_ids=mb["document_ids"])  # fmt: skip
            logp = _megatron_path(m, batch)[0]
            loss, _ = logitless.policy_loss(
                logp, mb["old_logprobs"].to(logp.dtype), mb["advantages"].to(logp.dtype),
                mb["mask"], config=example.config, document_ids=mb["document_ids"],
                normalizer=norm,
            )  # fmt: skip
            loss.backward()
        return _grads(m)

    ref, exact = composed(model), composed(truth)
    assert set(ours) == set(ref) == set(exact)
    floor = 2 * _param_floor(batches[0])
    for name in ref:
        assert_no_worse_than_reference(ours[name], ref[name], exact[name], name, floor=floor)


def _divergence_case(rank: int) -> None:
    """The divergence to a teacher GPTModel (TP=2 with sequence parallelism, beta=0.5) vs the
    generalized JSD of both models' gathered logits, in fp32 and float64."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from logitless.integrations import megatron

    beta = 0.5
    model, truth, build = _setup(2, 1, True)
    teacher = build(seed=5)
    teacher64 = _float64_copy(teacher, build)
    batch = _dense_batch(seed=6)
    up = batch["up"][0]

    def reference(student, teach) -> torch.Tensor:
        def logits(m):
            out = m(*_model_inputs(batch)).transpose(0, 1).contiguous()
            return gather_from_tensor_model_parallel_region(out).transpose(0, 1)

        with torch.no_grad():
            lt = logits(teach).log_softmax(-1)
        ls = logits(student).log_softmax(-1)
        lm = torch.logsumexp(torch.stack([ls + torch.tensor(1 - beta).log(),
                                          lt + torch.tensor(beta).log()]), 0)  # fmt: skip
        kl_t = (lt.exp() * (lt - lm)).sum(-1)
        kl_s = (ls.exp() * (ls - lm)).sum(-1)
        return torch.where(_mask(batch), beta * kl_t + (1 - beta) * kl_s, 0.0)

    out = megatron.divergence(
        model, teacher, *_model_inputs(batch), batch["labels"], beta=beta,
        loss_mask=batch["loss_mask"],
    )  # fmt: skip
    (out.divergence * up).sum().backward()
    ours = dict(div=out.divergence, **_grads(model))
    d = reference(model, teacher)
    (d * up).sum().backward()
    ref = dict(div=d, **_grads(model))
    d64 = reference(truth, teacher64)
    (d64 * up).sum().backward()
    exact = dict(div=d64, **_grads(truth))
    assert set(ours) == set(ref) == set(exact)
    assert not any(p.grad is not None for p in teacher.parameters()), "the teacher is frozen"
    for name in ref:
        f = FLOOR if name == "div" else _param_floor(batch)
        assert_no_worse_than_reference(ours[name], ref[name], exact[name], name, floor=f)

    # the fused policy loss with the distillation term from the teacher GPTModel equals the
    # composed policy_loss(..., divergence=) on both models' logits
    distill = logitless.PolicyLossConfig(distill_coef=0.3, distill_beta=beta)
    with torch.no_grad():
        inputs = _loss_inputs(batch, _megatron_path(model, batch)[0])
    loss, _ = megatron.policy_loss(
        model, *_model_inputs(batch), batch["labels"], inputs, config=distill, teacher=teacher,
        loss_mask=batch["loss_mask"],
    )  # fmt: skip
    loss.backward()
    fused = dict(loss=loss.detach(), **_grads(model))

    def composed(student, teach) -> dict:
        logp = _megatron_path(student, batch)[0]
        loss, _ = logitless.policy_loss(
            logp, inputs.old_logprobs.to(logp.dtype), inputs.advantages.to(logp.dtype),
            inputs.mask, config=distill, document_ids=inputs.document_ids,
            divergence=reference(student, teach),
        )  # fmt: skip
        loss.backward()
        return dict(loss=loss.detach(), **_grads(student))

    ref, exact = composed(model, teacher), composed(truth, teacher64)
    assert set(fused) == set(ref) == set(exact)
    for name in ref:
        f = FLOOR if name == "loss" else _param_floor(batch)
        assert_no_worse_than_reference(
            fused[name], ref[name], exact[name], f"fused {name}", floor=f
        )


def _errors_case(rank: int) -> None:
    """Bad input: a ValueError in Megatron's terms, on every rank (never a hang)."""
    from logitless.integrations import megatron

    def raises(match_here: str, match_other: str | None, fn) -> None:
        with pytest.raises(ValueError) as caught:
            fn()
        want = match_here if match_other is None or rank == 1 else match_other
        assert want in str(caught.value), (want, str(caught.value))

    other = "another rank of the tensor- or context-parallel group rejected"

    model, _, _ = _setup(2, 1, False)
    batch = _dense_batch()
    args = _model_inputs(batch)
    # a bad option is refused before the model runs (the seam's prepare): no decoder forward
    forwards: list[int] = []
    hook = model.decoder.register_forward_pre_hook(lambda *_: forwards.append(1))
    cold = torch.zeros(batch["labels"].shape)  # a per-token temperature of 0
    inputs = _loss_inputs(batch, torch.zeros(batch["labels"].shape))
    raises("temperature must be finite and > 0", None,
           lambda: megatron.logprobs(model, *args, batch["labels"], temperature=cold))  # fmt: skip
    raises("chunk_size must be", None,
           lambda: megatron.logprobs(model, *args, batch["labels"], chunk_size=0))  # fmt: skip
    raises("temperature must be finite and > 0", None, lambda: megatron.policy_loss(
        model, *args, batch["labels"], inputs, config=CONFIG, temperature=cold))  # fmt: skip
    raises("advantages", None, lambda: megatron.policy_loss(
        model, *args, batch["labels"], inputs.replace(advantages=inputs.advantages[:1]),
        config=CONFIG))  # fmt: skip
    hook.remove()
    assert forwards == [], "a bad option ran the decoder"
    # labels that do not match the hidden states, on one rank only
    labels = batch["labels"][:, :-1] if rank == 1 else batch["labels"]
    raises("labels must be [batch, seq_length] = [2, 16]", other,
           lambda: megatron.logprobs(model, *args, labels))  # fmt: skip
    # output_layer's weight is not this rank's shard of the vocabulary
    layer, weight = model.output_layer, model.output_layer.weight
    if rank == 1:
        layer.weight = torch.nn.Parameter(torch.zeros(weight.shape[0] + 1, weight.shape[1]))
    raises("output_layer's weight must be this tensor-parallel rank's", other,
           lambda: megatron.logprobs(model, *args, batch["labels"]))  # fmt: skip
    layer.weight = weight
    # a packed batch whose sequences do not add up to the labels
    packed = _packed_batch(1, 0, 2)
    raises("packed_seq_params describes", None, lambda: megatron.logprobs(
        model, packed["input_ids"][:, :-2], packed["position_ids"][:, :-2], None,
        packed["labels"][:, :-2], packed_seq_params=packed["packed_seq_params"]))  # fmt: skip
    # multi-token prediction, refused by name
    model.config.mtp_num_layers = 1
    raises("multi-token prediction (mtp_num_layers=1)", None,
           lambda: megatron.logprobs(model, *args, batch["labels"]))  # fmt: skip
    model.config.mtp_num_layers = None
    # the logits gathered over the TP ranks (parallel_output=False), a stage that is not the last
    model.output_layer.gather_output = True
    raises("parallel_output=True", None, lambda: megatron.logprobs(model, *args, batch["labels"]))
    model.output_layer.gather_output = False
    model.post_process = False
    raises("the last pipeline stage (post_process=True)", None,
           lambda: megatron.logprobs(model, *args, batch["labels"]))  # fmt: skip
    model.post_process = True

    model, _, _ = _setup(2, 1, True)  # sequence parallelism: S must split over the TP ranks
    odd = {k: v[:, :15] for k, v in batch.items() if k in ("input_ids", "labels")}
    raises(
        "with sequence_parallel=True the sequence length must be a multiple of "
        "tensor_model_parallel_size=2, got seq_length=15",
        None,
        lambda: megatron.logprobs(model, odd["input_ids"], None, None, odd["labels"]),
    )

    model, _, _ = _setup(1, 2, False)  # context parallelism needs the packed parameters
    raises("context_parallel_size=2 needs packed_seq_params", None,
           lambda: megatron.logprobs(model, *args, batch["labels"]))  # fmt: skip


def _ddp(model, overlap: bool = True):
    """``model`` in megatron-core's own DistributedDataParallel: every parameter gets an fp32
    ``main_grad`` and a backward hook that adds ``.grad`` into it (``overlap_grad_reduce``:
    the hook asserts a ``.grad`` and marks the parameter ready for its bucket's reduce)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    config = DistributedDataParallelConfig(overlap_grad_reduce=overlap, grad_reduce_in_fp32=True)
    return DistributedDataParallel(model.config, config, module=model)


def _main_grads(ddp) -> dict[str, torch.Tensor]:
    """Every parameter's ``main_grad`` after the step's gradient sync, then zeroed."""
    ddp.finish_grad_sync()
    out = {n: p.main_grad.detach().clone() for n, p in ddp.module.named_parameters()}
    ddp.zero_grad_buffer()
    return out


def _hook_spy(weight, seen: list):
    """A post-hook on ``weight``'s gradient accumulator, registered before DDP's own, so it
    runs just before it: what DDP's hook will see (``.grad``'s storage, the flag)."""
    acc = weight.expand_as(weight).grad_fn.next_functions[0][0]

    def spy(*_):
        g = weight.grad
        nbytes = None if g is None else g.untyped_storage().nbytes()
        seen.append((nbytes, bool(weight.grad_added_to_main_grad)))

    acc.register_hook(spy)
    return acc  # keep the node alive: DDP registers its hook on the same one


def _fusion_case(rank: int, sp: bool, tied: bool) -> None:
    """gradient_accumulation_fusion under megatron-core's DDP (TP=2, overlap_grad_reduce):
    the head's weight gradient is added straight into ``main_grad`` over two micro-batches.
    Every parameter's ``main_grad`` equals Megatron's logits path through the same DDP (its
    hook adding ``.grad``) and a float64 truth, after each micro-batch for the head's weight;
    DDP's hook sees the flag and a one-element placeholder (untied), or the tied embedding's
    own gradient and no flag; the fused loss likewise; ``True`` without DDP raises."""
    from logitless.integrations import megatron
    from logitless.integrations.megatron import model as megatron_model

    model, truth, build = _setup(2, 1, sp, tied)
    ref_model = build()
    weight = megatron_model.head_weight(megatron.megatron_head(model))
    seen: list = []
    node = _hook_spy(weight, seen)
    ours, ref = _ddp(model), _ddp(ref_model)
    batches = [_dense_batch(seed=s) for s in (3, 4)]
    snapshots = {"ours": [], "ref": []}
    for i, batch in enumerate(batches):
        up = batch["up"]
        # as Megatron's schedule runs them: every micro-batch but the last under no_sync
        last = i == len(batches) - 1
        with contextlib.nullcontext() if last else ours.no_sync():
            out = megatron.logprobs(
                ours, *_model_inputs(batch), batch["labels"], loss_mask=batch["loss_mask"],
                with_entropy=True,
            )  # fmt: skip
            (out.logprobs * up[0] + out.entropy * up[1]).sum().backward()
        snapshots["ours"].append(weight.main_grad.clone())
        with contextlib.nullcontext() if last else ref.no_sync():
            logp, ent = _megatron_path(ref, batch)
            (logp * up[0] + ent * up[1]).sum().backward()
        ref_weight = megatron_model.head_weight(megatron.megatron_head(ref_model))
        snapshots["ref"].append(ref_weight.main_grad.clone())
        logp64, ent64 = _megatron_path(truth, batch)
        (logp64 * up[0] + ent64 * up[1]).sum().backward()
    del node
    ours_g, ref_g, exact = _main_grads(ours), _main_grads(ref), _grads(truth)
    assert set(ours_g) == set(ref_g) == set(exact), set(ours_g) ^ set(exact)
    floor = 2 * _param_floor(batches[0])
    truth_w = megatron_model.head_weight(megatron.megatron_head(truth))
    exact_name = next(n for n, p in truth.named_parameters() if p is truth_w)
    for name in ref_g:
        assert_no_worse_than_reference(
            ours_g[name], ref_g[name], exact[name], f"rank {rank}: main_grad {name}", floor=floor
        )
    # after the first micro-batch alone (the weight's float64 gradient: the second batch's
    # share subtracted is not exact, so hold it to the first one's truth)
    first = _megatron_path(truth, batches[0])
    (first[0] * batches[0]["up"][0] + first[1] * batches[0]["up"][1]).sum().backward()
    assert_no_worse_than_reference(
        snapshots["ours"][0], snapshots["ref"][0], _grads(truth)[exact_name],
        f"rank {rank}: main_grad after micro-batch 1", floor=floor,
    )  # fmt: skip
    # what DDP's hook saw on the head's weight, once per backward
    if tied:  # the embedding's gradient, for the hook to add; not flagged
        assert seen == [(weight.numel() * 4, False)] * 2, seen
    else:  # the one-element placeholder and the flag: the hook adds nothing
        assert seen == [(weight.element_size(), True)] * 2, seen
    assert weight.grad is None

    # the fused loss: its weight gradient added into main_grad by backward()
    seen.clear()
    batch = batches[0]
    with torch.no_grad():
        logp = megatron.logprobs(ours, *_model_inputs(batch), batch["labels"],
                                 loss_mask=batch["loss_mask"]).logprobs  # fmt: skip
    inputs = _loss_inputs(batch, logp)
    loss, _ = megatron.policy_loss(
        ours, *_model_inputs(batch), batch["labels"], inputs, config=CONFIG,
        loss_mask=batch["loss_mask"],
    )  # fmt: skip
    loss.backward()
    _composed(_megatron_path(ref, batch)[0], inputs, None).backward()
    _composed(_megatron_path(truth, batch)[0], inputs, None).backward()
    ours_g, ref_g, exact = _main_grads(ours), _main_grads(ref), _grads(truth)
    for name in ref_g:
        assert_no_worse_than_reference(
            ours_g[name], ref_g[name], exact[name], f"rank {rank}: fused main_grad {name}",
            floor=floor,
        )  # fmt: skip

    # True without Megatron's DDP: no main_grad to add into, on every rank
    with pytest.raises(ValueError, match="gradient_accumulation_fusion=True needs"):
        megatron.logprobs(
            build(), *_model_inputs(batch), batch["labels"], gradient_accumulation_fusion=True
        )


def _run_checks(rank: int, world: int, checks: list[tuple[str, tuple]]) -> dict[str, str | None]:
    """Run each check on this rank; its failure as text (None: passed), so one spawn serves
    several tests. After a failure the rank runs no further check (they are reported as not
    run): a check that failed on one rank only leaves the ranks' collectives out of step."""
    import traceback

    import _megatron_shim  # noqa: F401  (the warning filters, before megatron's imports)

    results: dict[str, str | None] = {}
    failed = None
    for name, args in checks:
        if failed is not None:
            results[name] = f"rank {rank}: not run, after {failed} failed"
            continue
        try:
            CHECKS[name.split(":")[0]](rank, *args)
            results[name] = None
        except Exception:  # noqa: BLE001 - reported by the test of this check
            results[name] = f"rank {rank}: {traceback.format_exc()}"
            failed = name
    return results


HEAD_CASES = {  # tp, cp, sequence_parallel, tied, packed[, mup]
    "tp2": (2, 1, False, False, False),
    "tp2_sp_tied": (2, 1, True, True, False),
    "tp2_sp_packed": (2, 1, True, False, True),
    "cp2_packed": (1, 2, False, False, True),
    "tp2_cp2_sp_packed": (2, 2, True, False, True),
}
if MUP_SCALES_LOGITS:  # GPTModel multiplies its logits by mup_output_mult (0.19+)
    HEAD_CASES["tp2_sp_mup"] = (2, 1, True, False, False, True)
CHECKS: dict = {
    "head": _head_case,
    "schedule": _schedule_case,
    "divergence": _divergence_case,
    "errors": _errors_case,
}


def _invariant_case(rank: int) -> None:
    """``batch_invariant=True``: a token's log-prob and entropy are the same bits whether the
    call scores every token or a few (TP=2), and the fused loss's ratio on log-probs recorded
    over the whole batch is exactly 1.0."""
    from logitless.integrations import megatron

    model, _, _ = _setup(2, 1, False)
    batch = _batch(2, 1, False, False)
    few = torch.zeros_like(batch["loss_mask"])
    few[:, -3:] = 1
    with torch.no_grad():
        full = megatron.logprobs(model, *_model_inputs(batch), batch["labels"],
                                 loss_mask=batch["loss_mask"], with_entropy=True,
                                 batch_invariant=True)  # fmt: skip
        part = megatron.logprobs(model, *_model_inputs(batch), batch["labels"], loss_mask=few,
                                 with_entropy=True, batch_invariant=True)  # fmt: skip
    keep = few.bool() & batch["loss_mask"].bool()
    assert keep.any()
    for a, b in ((full.logprobs, part.logprobs), (full.entropy, part.entropy)):
        assert torch.equal(a[keep].view(torch.int32), b[keep].view(torch.int32)), rank
    from logitless.integrations.seam import LossInputs

    inputs = LossInputs(old_logprobs=full.logprobs, advantages=batch["advantages"], mask=keep,
                        document_ids=batch["document_ids"])  # fmt: skip
    _, metrics = megatron.policy_loss(
        model, *_model_inputs(batch), batch["labels"], inputs, config=CONFIG,
        loss_mask=keep.to(batch["loss_mask"].dtype), batch_invariant=True,
    )  # fmt: skip
    assert float(metrics["ratio_min"]) == 1.0 == float(metrics["ratio_max"]), metrics


CHECKS["invariant"] = _invariant_case
CHECKS["fusion"] = _fusion_case


def _checks_of(world: int) -> list[tuple[str, tuple]]:
    heads = [(f"head:{k}", v) for k, v in HEAD_CASES.items() if v[0] * v[1] == world]
    return heads + EXTRA_CHECKS.get(world, [])


EXTRA_CHECKS: dict[int, list[tuple[str, tuple]]] = {
    2: [
        ("schedule", (False, False)),
        ("schedule:per_token_sp", (True, True)),
        ("divergence", ()),
        ("errors", ()),
        ("invariant", ()),
        ("fusion", (False, False)),
        ("fusion:sp_tied", (True, True)),
    ],
}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return spawn(_run_checks, 2, _checks_of(2))


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    return spawn(_run_checks, 4, _checks_of(4))


def _passed(results: list[dict], name: str) -> None:
    failures = [r[name] for r in results if r[name] is not None]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("case", [k for k, v in HEAD_CASES.items() if v[0] * v[1] == 2])
def test_head_matches_megatron_and_float64(two_ranks, case):
    """Log-probs, entropy and every gradient vs Megatron's logits path and float64; the fused
    loss vs the composed loss; output_layer's pre-hook fires."""
    _passed(two_ranks, f"head:{case}")


def test_head_tensor_and_context_parallel(four_ranks):
    """TP=2 x CP=2 with sequence parallelism and packed documents split zigzag (4 ranks)."""
    _passed(four_ranks, "head:tp2_cp2_sp_packed")


@pytest.mark.parametrize("name", ["schedule", "schedule:per_token_sp"])
def test_forward_backward_func_drives_the_step(two_ranks, name):
    """docs/megatron.md's recipe: Megatron's get_forward_backward_func over two micro-batches
    (TP=2; then with sequence parallelism, calculate_per_token_loss and finalize_model_grads'
    division) gives the step normalizer's gradients."""
    _passed(two_ranks, name)


def test_divergence_to_a_teacher_gpt_model(two_ranks):
    """megatron.divergence, and policy_loss(teacher=) with the distillation term, vs both
    models' gathered logits and float64 (TP=2 with sequence parallelism)."""
    _passed(two_ranks, "divergence")


def test_batch_invariant_bits_and_ratio(two_ranks):
    """batch_invariant=True through the Megatron head under TP=2: a token's bits do not depend
    on which other tokens are scored; the loss's ratio on unchanged weights is exactly 1.0."""
    _passed(two_ranks, "invariant")


@pytest.mark.parametrize("name", ["fusion", "fusion:sp_tied"])
def test_gradient_accumulation_fusion_into_ddp_main_grad(two_ranks, name):
    """The head's weight gradient straight into megatron-core DDP's main_grad (TP=2,
    overlap_grad_reduce; then sequence parallelism with tied embeddings), over two
    micro-batches and for the fused loss, vs Megatron's logits path through the same DDP and
    float64; DDP's hook sees the flag and a one-element placeholder."""
    _passed(two_ranks, name)


def test_bad_input_raises_on_every_rank(two_ranks):
    _passed(two_ranks, "errors")


def test_benchmark_script_runs(tmp_path):
    """benchmarks/megatron_head.py end to end on a tiny shape (its figures are not checked)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "megatron_head.py"),
         *("--seq", "64", "--hidden", "32", "--vocab", "500", "--tp", "2", "--repeats", "1"),
         "--entropy", "--csv", str(tmp_path / "mh.csv")],
        capture_output=True, text=True, timeout=300, cwd=root,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "megatron (logprobs): peak" in proc.stdout, proc.stdout
    assert "logitless (logprobs): peak" in proc.stdout, proc.stdout
    assert "ratio logitless/megatron" in proc.stdout, proc.stdout
    assert (tmp_path / "mh.csv").read_text().count("\n") == 3  # header + 2 rows


def test_benchmark_loss_task_runs(tmp_path):
    """benchmarks/megatron_head.py --task loss --main-grad on a tiny shape: both ways give
    the same loss; the rows are appended to an older CSV, whose header gains the columns."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    old = "method,tp,seq,hidden,vocab,entropy,peak_mb_per_rank,median_s\n"
    (tmp_path / "mh.csv").write_text(old + "megatron,2,64,32,500,True,1.0,0.1\n")
    proc = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "megatron_head.py"),
         *("--seq", "64", "--hidden", "32", "--vocab", "500", "--tp", "2", "--repeats", "1"),
         "--entropy", "--task", "loss", "--main-grad", "--csv", str(tmp_path / "mh.csv")],
        capture_output=True, text=True, timeout=300, cwd=root,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    losses = re.findall(r"\((?:loss, main_grad)\): peak .* loss (-?[0-9.]+)", proc.stdout)
    assert len(losses) == 2, proc.stdout
    assert abs(float(losses[0]) - float(losses[1])) < 1e-5, proc.stdout
    lines = (tmp_path / "mh.csv").read_text().splitlines()
    new = ",task,main_grad,loss_path,dtype,weight_seed,device"
    assert lines[0] == old.strip() + new and len(lines) == 4, lines
    assert lines[1].endswith("0.1,,,,,,"), lines
    assert lines[3].endswith(",loss,True,fused,float32,1000+rank,cpu"), lines
