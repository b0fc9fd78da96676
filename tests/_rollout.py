"""What the rollout-mismatch tests share: a problem whose engine is a perturbed copy of the
policy, and the float64 truth of the diagnostics written out directly (per position, from the
full softmax), independent of the library's bucket algebra."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import logitless
from logitless import RolloutTopK

FLOAT_FIELDS = (
    "logprobs",
    "kl_rollout_trainer",
    "kl_trainer_rollout",
    "total_variation",
    "topk_mass",
    "rollout_mass",
)
BOOL_FIELDS = ("top1_agree", "compared")


@dataclass
class Problem:
    hidden: torch.Tensor  # [..., H] fp32
    weight: torch.Tensor  # [V, H] fp32
    labels: torch.Tensor  # [...] (ignore_index -100 at some positions)
    topk: RolloutTopK  # the engine's top-k (+ the sampled token), padded with -1
    bias: torch.Tensor | None = None


def problem(
    shape=(3, 13), H=24, V=300, k=6, *, seed=0, noise=0.6, bias=False, scale=3.0
) -> Problem:
    """The engine samples each label from a perturbed copy of the policy (logit noise
    ``noise``) and returns its top-k log-probs plus the sampled token (vLLM's ``logprobs=k``:
    ``k + 1`` slots, the last one padding when the sampled token is among the top k); some
    positions are ignored, two use fewer slots, one has none."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, H, generator=g)
    weight = torch.randn(V, H, generator=g) * (scale / math.sqrt(H))
    b = torch.randn(V, generator=g) * 0.5 if bias else None
    z = hidden.double() @ weight.double().T + (0.0 if b is None else b.double())
    engine = (z + noise * torch.randn(z.shape, generator=g, dtype=torch.float64)).log_softmax(-1)
    flat = engine.reshape(-1, V)
    labels = torch.multinomial(flat.exp(), 1, generator=g).reshape(shape)
    topk = engine_topk(flat, labels.reshape(-1), k)
    ids, lps = topk.token_ids, topk.logprobs
    n = flat.shape[0]
    ids[1, 2:] = -1  # fewer slots
    ids[n // 2, 1:] = -1
    ids[n - 2] = -1  # no id: not compared
    labels = labels.clone()
    flat_labels = labels.reshape(-1)
    flat_labels[0] = -100
    flat_labels[n // 3] = -100
    return Problem(
        hidden,
        weight,
        labels,
        RolloutTopK(ids.reshape(*shape, k + 1), lps.reshape(*shape, k + 1)),
        b,
    )


def engine_topk(engine: torch.Tensor, sampled: torch.Tensor, k: int) -> RolloutTopK:
    """What vLLM's ``logprobs=k`` returns from the engine's log-probs ``engine`` ``[N, V]``:
    the top ``k`` and the sampled token (``sampled`` ``[N]``, negative: none) when it is not
    among them, in ``[N, k + 1]`` slots (-1 unused), fp32 log-probs."""
    top = engine.topk(k)
    ids = torch.full((engine.shape[0], k + 1), -1, dtype=torch.int64)
    lps = torch.zeros(engine.shape[0], k + 1, dtype=torch.float32)
    ids[:, :k], lps[:, :k] = top.indices, top.values.float()
    outside = ~(top.indices == sampled[:, None]).any(1) & (sampled >= 0)
    ids[outside, k] = sampled[outside]
    lps[outside, k] = engine[outside, sampled[outside]].float()
    return RolloutTopK(ids, lps)


def transformed(p: Problem, dtype, *, temperature=1.0, softcap=None, logit_scale=None):
    """``[N, V]`` float64 logits of ``p`` with its inputs rounded to ``dtype`` first."""
    h = p.hidden.to(dtype).double().reshape(-1, p.hidden.shape[-1])
    z = h @ p.weight.to(dtype).double().T
    if p.bias is not None:
        z = z + p.bias.to(dtype).double()
    if logit_scale is not None:
        z = z * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    if isinstance(temperature, torch.Tensor):
        return z / temperature.double().reshape(-1, 1)
    return z / temperature


def truth(z: torch.Tensor, labels: torch.Tensor, topk: RolloutTopK, keep=None) -> dict:
    """The diagnostics in float64, position by position, from full logits ``z`` ``[N, V]``
    (``keep``: ``[N, V]`` bool kept sets under replay: the trainer's distribution is the
    softmax over them). Written from the definitions: buckets = the ids and the rest."""
    if keep is not None:
        z = z.masked_fill(~keep, -math.inf)
    lp_all = z.log_softmax(-1)
    n, vocab = z.shape
    ids = topk.token_ids.reshape(n, -1)
    lps = topk.logprobs.reshape(n, -1).double()
    out = {f: torch.zeros(n, dtype=torch.float64) for f in FLOAT_FIELDS[1:]}
    out["logprobs"] = torch.zeros(ids.shape, dtype=torch.float64)
    out["top1_agree"] = torch.zeros(n, dtype=torch.bool)
    out["compared"] = torch.zeros(n, dtype=torch.bool)
    flat = labels.reshape(-1)
    for i in range(n):
        used = ids[i] != topk.pad_id
        if flat[i] == -100 or not used.any():
            continue
        K = ids[i][used]
        r, t = lps[i][used].clamp(max=0).exp(), lp_all[i][K].exp()
        rest = torch.ones(vocab, dtype=torch.bool)
        rest[K] = False
        tau_t, tau_r = lp_all[i][rest].exp().sum(), (1 - r.sum()).clamp(min=0)
        rb, tb = torch.cat([r, tau_r[None]]), torch.cat([t, tau_t[None]])
        out["kl_rollout_trainer"][i] = _kl(rb, tb)
        out["kl_trainer_rollout"][i] = _kl(tb, rb)
        out["total_variation"][i] = 0.5 * (rb - tb).abs().sum()
        out["topk_mass"][i], out["rollout_mass"][i] = t.sum(), r.sum()
        out["logprobs"][i, used] = lp_all[i][K].double()
        engine_top = set(K[lps[i][used] == lps[i][used].max()].tolist())
        trainer_top = set(torch.nonzero(z[i] == z[i].max())[:, 0].tolist())
        out["top1_agree"][i] = bool(engine_top & trainer_top)
        out["compared"][i] = True
    shape = labels.shape
    return {f: v.reshape(*shape, *v.shape[1:]) for f, v in out.items()}


def _kl(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    pos = a > 0
    return (a[pos] * (a[pos].log() - b[pos].log())).sum()


def run(p: Problem, dtype, fn=logitless.linear_logprobs, **options):
    """``fn`` on ``p`` with its inputs in ``dtype`` (the op or the reference)."""
    bias = None if p.bias is None else p.bias.to(dtype)
    return fn(
        p.hidden.to(dtype), p.weight.to(dtype), p.labels, bias=bias, rollout_topk=p.topk, **options
    )
