"""What the Fast-LLM tests share: a head built by Fast-LLM from a config (its own, or ``type:
logitless``), run through Fast-LLM's ``Stage`` as its trainer runs it, a batch in Fast-LLM's
kwargs, and a float64 truth.

The truth is plain torch in float64 from the same parameters: Fast-LLM's final norm
(``rms_norm``), the logits ``softcap(h·Wᵀ)·scale`` (its order), then each loss with Fast-LLM's
semantics (its masks, divisors, weights, ``grad_output``), written out here from its docs and
code (``fast_llm/layers/language_model/loss/``): the test's own obviously-correct reference.
Fast-LLM's own losses cast the logits to fp32 (``softmax_base``), so they cannot be the truth.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import torch
from fast_llm.engine.distributed.distributed import Distributed
from fast_llm.engine.multi_stage.config import StageConfig
from fast_llm.engine.multi_stage.stage import Stage
from fast_llm.layers.block.config import BlockKwargs
from fast_llm.layers.language_model.config import LanguageModelKwargs
from fast_llm.layers.language_model.loss.config import LanguageModelLossKwargs
from fast_llm.models.gpt.config import GPTModelConfig

import logitless.integrations.fast_llm  # noqa: F401  (registers head type logitless)

H, V = 24, 96


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    losses: dict  # Fast-LLM's head.losses
    dtype: torch.dtype = torch.float32
    scale: float = 1.0  # head.logits_scale_factor
    softcap: float | None = None  # head.final_logit_softcap
    lengths: tuple[int, ...] = (9, 14, 5, 12)  # documents (GSPO)
    ignored: float = 0.25
    grad_output: float = 0.5
    prediction_heads: int = 1
    splits: int = 1  # head.cross_entropy_splits
    teacher_softcap: float | None = None
    loss_mask: bool = False  # kwargs loss_mask (distillation)

    @property
    def tokens(self) -> int:
        return sum(self.lengths)


DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float64: "float64"}


def model_config(case: Case, logitless: bool, dtype: torch.dtype, distributed: dict | None = None):
    head: dict[str, Any] = {
        "normalization": {"type": "rms_norm"},
        "losses": case.losses,
        "logits_scale_factor": case.scale,
        "cross_entropy_splits": case.splits,
        "prediction_heads": case.prediction_heads,
    }
    if case.softcap is not None:
        head["final_logit_softcap"] = case.softcap
    if logitless:
        head["type"] = "logitless"
    else:
        head["loss_implementation"] = "per_loss"  # the losses registered as logitless does
    dist = {"compute_dtype": DTYPES[dtype], "use_cuda": False, **(distributed or {})}
    return GPTModelConfig.from_dict(
        {
            "base_model": {
                "decoder": {"num_blocks": 0},
                "embeddings": {"vocab_size": V},
                "head": head,
                "hidden_size": H,
            },
            "distributed": dist,
        }
    )


@dataclasses.dataclass
class Built:
    heads: list  # the main head, then the multi-token-prediction heads
    stages: list
    distributed: Distributed


def build(case: Case, logitless: bool, dtype: torch.dtype, distributed: dict | None = None):
    """Fast-LLM's base model for ``case`` and a ``Stage`` per head (as its test suite and its
    multi-stage model build them)."""
    config = model_config(case, logitless, dtype, distributed)
    model_class = config.get_base_model_config_class()
    base = model_class.get_base_model(config.base_model, config.distributed)
    dist = Distributed(config.distributed)
    base.setup(dist)
    heads = [base.head, *base.multi_token_prediction.heads]
    stages = []
    for head in heads:
        stage = Stage(
            config=StageConfig(),
            layers=[head],
            distributed_config=dist.config,
            index=0,
            tied_parameter_duplicates=(),
        )
        stage.setup(distributed=dist, tied_parameter_duplicate_buffers={})
        stage.initialize_weights()
        stage.restore_parameters()
        stage.reset_gradients()
        stages.append(stage)
    return Built(heads, stages, dist)


@dataclasses.dataclass
class Batch:
    x: torch.Tensor  # [N, H] the head's input (before the final norm), float64
    weight: torch.Tensor  # [P, V, H] per head, float64
    norm: torch.Tensor  # [P, H]
    kwargs: dict
    teacher: tuple[torch.Tensor, torch.Tensor] | None  # (hidden [N, H], weight [V, H])


def batch(case: Case, seed: int = 0) -> Batch:
    """The same data on every rank (float64; each side casts what it holds)."""
    g = torch.Generator().manual_seed(seed)
    n, p = case.tokens, case.prediction_heads
    x = torch.randn(n, H, generator=g, dtype=torch.float64)
    weight = torch.randn(p, V, H, generator=g, dtype=torch.float64) * 0.4
    norm = 1 + 0.1 * torch.randn(p, H, generator=g, dtype=torch.float64)
    labels = [torch.randint(0, V, (n,), generator=g) for _ in range(p)]
    for lab in labels:
        lab[torch.rand(n, generator=g) < case.ignored] = -100
    kw: dict[str, Any] = {
        BlockKwargs.grad_output: case.grad_output,
        LanguageModelKwargs.labels: labels,
        LanguageModelKwargs.num_labels_in_batch: [int((lab >= 0).sum()) for lab in labels],
        LanguageModelKwargs.num_documents_in_batch: len(case.lengths),
        LanguageModelKwargs.documents_seen: 50,
    }
    reps = torch.tensor(case.lengths)
    doc = torch.repeat_interleave(torch.arange(len(case.lengths)), reps)
    kw[BlockKwargs.global_document_index_q] = doc + 1
    kw[BlockKwargs.num_documents_in_sequence] = len(case.lengths)
    kw[LanguageModelLossKwargs.label_counts] = [
        torch.zeros(len(case.lengths)).index_add_(0, doc, (lab >= 0).float())[doc] for lab in labels
    ]
    kw[LanguageModelLossKwargs.advantages] = [
        torch.randn(len(case.lengths), generator=g)[doc] + 0.1 * torch.randn(n, generator=g)
        for _ in range(p)
    ]
    kw[LanguageModelLossKwargs.old_log_probabilities] = [
        -4.0 + 0.3 * torch.randn(n, generator=g) for _ in range(p)
    ]
    kw[LanguageModelLossKwargs.reward] = [torch.randn(n, generator=g) for _ in range(p)]
    kw[LanguageModelLossKwargs.model_version] = [torch.randint(0, 40, (n,), generator=g)] * p
    teacher = None
    if any(loss["type"] == "distillation" for loss in case.losses.values()):
        teacher = (
            torch.randn(n, H, generator=g, dtype=torch.float64),
            torch.randn(V, H, generator=g, dtype=torch.float64) * 0.4,
        )
        if case.loss_mask:
            mask = torch.rand(n, generator=g) > 0.3
            kw[LanguageModelKwargs.loss_mask] = [mask] * p
            kw[LanguageModelKwargs.num_labels_in_batch] = [int(mask.sum())] * p
    return Batch(x, weight, norm, kw, teacher)


def _softcap(z: torch.Tensor, cap: float | None) -> torch.Tensor:
    return z if cap is None else torch.tanh(z / cap) * cap


def kwargs_for(
    case: Case, b: Batch, logitless: bool, dtype: torch.dtype, rows=None, seq=None
) -> dict:
    """A fresh copy of the batch's kwargs for one run, with the teacher as Fast-LLM's head hands
    it: logits (Fast-LLM's student; all tokens under vocabulary parallelism) or hidden states and
    weight (a logitless student, from a teacher head with ``teacher_hidden_states``: its input,
    this rank's sequence shard ``seq`` under sequence parallelism). ``rows``: this rank's
    vocabulary rows."""
    from logitless.integrations.fast_llm import TeacherOutput

    kw = dict(b.kwargs)
    if b.teacher is not None:
        t_hidden, t_weight = b.teacher
        if logitless:
            w = t_weight if rows is None else t_weight[rows]
            h = t_hidden if seq is None else t_hidden[seq]
            out = TeacherOutput(h.to(dtype), w.to(dtype), case.teacher_softcap)
        else:
            logits = _softcap(t_hidden.to(dtype) @ t_weight.to(dtype).T, case.teacher_softcap)
            out = logits if rows is None else logits[:, rows]
        kw["reference_teacher_hidden_states"] = {"head.logits": out}
    return kw


def run(built: Built, case: Case, b: Batch, logitless: bool, dtype, rows=None, seq=None) -> dict:
    """Every head forward and backward through its ``Stage`` (the MTP heads first get the
    stacked input they get from the model), the results: loss, input gradient, norm and weight
    gradients, registered losses (summed over the list Fast-LLM keeps per name)."""
    kw = kwargs_for(case, b, logitless, dtype, rows, seq)
    x = b.x if seq is None else b.x[seq]
    for k, head in enumerate(built.heads):
        head.output_weights.data.copy_(b.weight[k] if rows is None else b.weight[k][rows])
        head.final_norm.weight.data.copy_(b.norm[k])
    out = []
    for k, (head, stage) in enumerate(zip(built.heads, built.stages, strict=True)):
        if k == 0 and logitless:
            head.preprocess(kw)  # Fast-LLM's preprocess_batch calls it before the forward
        losses = collections.defaultdict(list)
        inp = x.to(dtype)
        grad = torch.tensor(float("nan"), dtype=dtype)
        if not head._is_last_head:
            inp, grad = torch.stack((inp, inp)), torch.zeros_like(inp)
        inp = inp.clone().requires_grad_()
        output, context = stage.forward(inp, kw, losses)
        stage.backward(grad, context)
        g = inp.grad if head._is_last_head else inp.grad[1]
        out.append(
            {
                "input": g,
                "norm": head.final_norm.weight.grad_buffer.clone(),
                "weight": head.output_weights.grad_buffer.clone(),
                "losses": _reduced(head, losses),
            }
        )
    return {"heads": out}


def _reduced(head, losses: dict) -> dict:
    """Each registered name's values, reduced as its ``LossDef`` says (Fast-LLM keeps one
    value per split: summed, or the maximum / minimum)."""
    reductions = {d.name: d.reduction for d in head.get_loss_definitions()}
    return {name: reductions[name].torch(torch.stack(values)) for name, values in losses.items()}


# --- the float64 truth ------------------------------------------------------------------------


def _loss_value(name: str, cfg: dict, case: Case, b: Batch, z: torch.Tensor, k: int):
    """One loss of head ``k`` (prediction distance k + 1), Fast-LLM's semantics, float64."""
    kw = b.kwargs
    labels = kw[LanguageModelKwargs.labels][k]
    mask = labels >= 0
    divisor = kw[LanguageModelKwargs.num_labels_in_batch][k]
    logp_all = torch.log_softmax(z, dim=-1)  # [N, V]
    lp = logp_all.gather(-1, labels.clamp(min=0)[:, None])[:, 0]  # [N]
    kind = cfg["type"]
    if kind == "label":
        return (-lp * mask).sum() / divisor
    lo, hi = cfg.get("epsilon_low", 0.2), cfg.get("epsilon_high", 0.2)
    old = kw[LanguageModelLossKwargs.old_log_probabilities][k].double()
    adv = kw[LanguageModelLossKwargs.advantages][k].double()
    if kind == "grpo":
        r = torch.exp(lp - old)
        per = -torch.minimum(r * adv, r.clamp(1 - lo, 1 + hi) * adv)
        return (per * mask).sum() / divisor
    if kind == "gspo":
        doc = kw[BlockKwargs.global_document_index_q] - 1
        total = z.new_zeros(())
        for d in range(len(case.lengths)):
            m = (doc == d) & mask
            n = m.sum()
            if int(n) == 0:
                continue
            ratio = torch.exp(((lp - old) * m).sum() / n)
            a = (adv * m).sum() / n
            total = total - n * torch.minimum(ratio * a, ratio.clamp(1 - lo, 1 + hi) * a)
        return total / kw[LanguageModelKwargs.num_documents_in_batch]
    # distillation: the teacher's logits scaled by logits_scale_factor / temperature
    t_hidden, t_weight = b.teacher
    zt = _softcap(t_hidden @ t_weight.T, case.teacher_softcap) * case.scale
    zt = zt / cfg.get("temperature", 1.0)
    lpt = torch.log_softmax(zt, dim=-1)
    pt, ps = lpt.exp(), logp_all.exp()
    loss_type = cfg.get("loss_type", "cross_entropy")
    if loss_type == "forward_kl":
        per = (pt * (lpt - logp_all)).sum(-1)
    elif loss_type == "reverse_kl":
        per = (ps * (logp_all - lpt)).sum(-1)
    else:
        per = -(pt * logp_all).sum(-1)
    lmask = kw.get(LanguageModelKwargs.loss_mask)
    if lmask is not None:
        per = per * lmask[k]
    return per.sum() / divisor


def truth(case: Case, b: Batch, k: int, eps: float) -> dict:
    """Head ``k``'s loss (Σ weight · value), values per loss name, and the float64 gradients of
    ``grad_output`` times it with respect to its input, norm weight and output weight."""
    x = b.x.clone().requires_grad_()
    norm = b.norm[k].clone().requires_grad_()
    w = b.weight[k].clone().requires_grad_()
    h = torch.rms_norm(x, (H,), norm, eps)
    z = _softcap(h @ w.T, case.softcap) * case.scale
    values = {name: _loss_value(name, cfg, case, b, z, k) for name, cfg in case.losses.items()}
    total = sum(cfg.get("weight", 1.0) * values[name] for name, cfg in case.losses.items())
    (total * case.grad_output).backward()
    return {
        "loss": total.detach(),
        "values": {name: v.detach() for name, v in values.items()},
        "input": x.grad,
        "norm": norm.grad,
        "weight": w.grad,
    }
