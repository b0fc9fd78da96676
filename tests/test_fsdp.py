"""LogprobHead / PolicyLossHead: module forms that hold the head weight, under FSDP2.

Single process: the modules equal the functional forms exactly (outputs and gradients under
random upstream gradients); a tied embedding's gradient is the lookup's plus the head's,
against a plain torch model (F.embedding + F.linear + log_softmax); a bf16 weight read with
head_dtype=float32 gets its gradient in bf16.

FSDP2 on 2 gloo ranks (CPU): a tiny decoder (embedding, one RMSNorm + MLP block, final norm,
head via LogprobHead / PolicyLossHead, tied or not) under ``fully_shard``; each rank runs a
different part of the batch. The ranks' loss shares must sum to the whole-batch loss of one
process, and the gathered gradients (``.full_tensor()``) must equal its gradients, within the
tolerance derived from the plain-torch reference's error against a float64 truth
(tests/_tolerance.py).

Gradient averaging: FSDP2 averages gradients over the ranks. Each rank normalizes its loss by
the global counts (``loss_normalizer(..., process_group=...)``), so the ranks' losses *sum* to
the whole-batch loss; each rank backpropagates its loss times the world size, and FSDP2's
average is then the whole-batch gradient.
"""

from __future__ import annotations

import pickle
import re
import warnings
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _dist import spawn
from _tolerance import assert_no_worse_than_reference
from torch import nn

from logitless import (
    LossNormalizer,
    PolicyLossConfig,
    VocabParallel,
    fused_policy_loss,
    linear_logprobs,
    loss_normalizer,
    policy_loss,
)
from logitless.modules import LogprobHead, PolicyLossHead

V, H = 67, 16  # odd V: FSDP2 shards dim 0 unevenly (34 / 33 rows) and pads
B, T = 5, 9
WORLD = 2
ROWS = {0: [0, 1], 1: [2, 3, 4]}  # each rank's sequences: different rows, uneven token counts
LENGTHS = [9, 6, 8, 4, 7]  # tokens per sequence (the rest is padding)
PROMPTS = [3, 2, 2, 1, 3]  # prompt tokens per sequence (no loss)

DAPO = PolicyLossConfig(clip_low=0.2, clip_high=0.28, kl_coef=0.05, entropy_coef=0.01)
GSPO = PolicyLossConfig(
    ratio_level="sequence", clip_low=3e-4, clip_high=4e-4, aggregation="seq_mean_token_mean"
)


@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # "logprob": LogprobHead + a loss of random per-token weights; "policy"
    tied: bool = True
    bias: bool = False
    dtype: torch.dtype = torch.float32
    head_dtype: torch.dtype | None = None
    inside: bool = False  # the head is called inside the model's forward (else after it)
    holder: bool = False  # HF-like: an nn.Linear lm_head holding the weight stays in the model
    mp: bool = False  # fp32 sharded params, MixedPrecisionPolicy(param_dtype=bf16, reduce fp32)
    config: PolicyLossConfig | None = None

    @property
    def compute_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.mp else self.dtype


CASES = [
    Case("fp32_tied_logprob", "logprob"),
    Case("fp32_tied_logprob_inside", "logprob", inside=True),
    Case("fp32_untied_bias_logprob", "logprob", tied=False, bias=True),
    Case("fp32_tied_holder_logprob", "logprob", holder=True),
    Case("fp32_untied_holder_policy_dapo", "policy", tied=False, holder=True, config=DAPO),
    Case("fp32_tied_policy_dapo", "policy", config=DAPO),
    Case("fp32_untied_bias_policy_gspo_inside", "policy", False, True, inside=True, config=GSPO),
    Case("bf16_tied_logprob_fp32head", "logprob", dtype=torch.bfloat16, head_dtype=torch.float32),
    Case(
        "bf16_untied_policy_fp32head",
        "policy",
        tied=False,
        dtype=torch.bfloat16,
        head_dtype=torch.float32,
        config=DAPO,
    ),
    Case(
        "bf16_tied_policy_fp32head_inside",
        "policy",
        dtype=torch.bfloat16,
        head_dtype=torch.float32,
        inside=True,
        config=DAPO,
    ),
    Case(
        "mp_untied_bias_policy_fp32head",
        "policy",
        tied=False,
        bias=True,
        head_dtype=torch.float32,
        mp=True,
        config=DAPO,
    ),
    Case(
        "mp_tied_logprob_fp32head_inside", "logprob", head_dtype=torch.float32, inside=True, mp=True
    ),
    Case("mp_tied_policy_dapo_fp32head", "policy", head_dtype=torch.float32, mp=True, config=DAPO),
]


# ----------------------------------------------------------------------------- the model


class Block(nn.Module):
    """Pre-norm MLP residual block: x + down(silu(up(rmsnorm(x))))."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(H)
        self.up = nn.Linear(H, 2 * H)
        self.down = nn.Linear(2 * H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.silu(self.up(self.norm(x))))


class TinyDecoder(nn.Module):
    """embed -> block -> norm -> hidden [B, T, H]; ``self.head`` holds the embedding's weight
    (tied) or a fresh nn.Linear's (untied). With ``head_inputs`` the model's forward also calls
    the head; otherwise the caller calls ``model.head`` on the returned hidden states."""

    def __init__(self, case: Case) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, H)
        self.block = Block()
        self.norm = nn.RMSNorm(H)
        source = self.embed if case.tied else nn.Linear(H, V, bias=case.bias)
        if case.holder:  # like an HF model: lm_head (tied to embed, or not) stays, never called
            self.lm_head = source if not case.tied else nn.Linear(H, V, bias=False)
            self.lm_head.weight = source.weight
            source = self.lm_head
        self.head: LogprobHead | PolicyLossHead
        if case.kind == "logprob":
            self.head = LogprobHead(source, with_entropy=True, head_dtype=case.head_dtype)
        else:
            self.head = PolicyLossHead(source, config=case.config, head_dtype=case.head_dtype)

    def forward(self, ids: torch.Tensor, head_inputs: dict | None = None):
        hidden = self.norm(self.block(self.embed(ids)))
        return hidden if head_inputs is None else self.head(hidden, **head_inputs)


def make_model(case: Case, dtype: torch.dtype) -> TinyDecoder:
    """The same initial weights in every process (fixed seed); random norm scales and biases."""
    torch.manual_seed(1234)
    model = TinyDecoder(case)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.uniform_(-0.5, 0.5)
    return model.to(dtype)


def reference_head(head: nn.Module, hidden, labels, head_dtype, *, with_entropy=True):
    """Plain torch: full logits (F.linear in head_dtype), log_softmax in at least fp32."""
    dtype = head_dtype or hidden.dtype
    bias = None if head.bias is None else head.bias.to(dtype)
    logits = F.linear(hidden.to(dtype), head.weight.to(dtype), bias)
    lsm = logits.to(torch.promote_types(dtype, torch.float32)).log_softmax(-1)
    valid = labels != -100
    logp = lsm.gather(-1, labels.clamp(min=0)[..., None])[..., 0] * valid
    ent = -(lsm.exp() * lsm).sum(-1) * valid if with_entropy else None
    return logp, ent


# ----------------------------------------------------------------------------- the data


def batch(case: Case) -> dict:
    """ids [B, T], next-token labels [B, T] (prompt and padding: -100), per-token upstream
    weights of logp / entropy, and the policy-loss inputs (old / ref log-probs, advantages)."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, V, (B, T), generator=g)
    labels = torch.full((B, T), -100)
    for b, (n, p) in enumerate(zip(LENGTHS, PROMPTS, strict=True)):
        labels[b, p - 1 : n - 1] = ids[b, p:n]
    w_logp = torch.randn(B, T, generator=g, dtype=torch.float64)
    w_ent = torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    # old / ref log-probs off by about the clip range (GSPO's is 3e-4): some ratios clipped
    scale = 0.1 if case.config is None else min(0.1, 3 * case.config.clip_low)
    noise = scale * torch.randn(2, B, T, generator=g, dtype=torch.float64)
    # ... of this case's current policy (its float64 model)
    model = make_model(case, torch.float64)
    with torch.no_grad():
        logp = reference_head(model.head, model(ids), labels, None, with_entropy=False)[0]
    old = torch.where(labels != -100, logp + noise[0], 0.0)
    ref = torch.where(labels != -100, logp + noise[1], 0.0)
    return dict(ids=ids, labels=labels, w_logp=w_logp, w_ent=w_ent, adv=adv, old=old, ref=ref)


def run_step(model: TinyDecoder, case: Case, d: dict, rows: list[int], scale: float, group):
    """Forward + backward of ``rows`` of the batch with the logitless head. The loss is this
    part's *share* of the whole-batch loss (normalized by the counts over ``group``);
    backward runs on ``loss * scale``. Returns the share (float64)."""
    ids, labels = d["ids"][rows], d["labels"][rows]
    norm = loss_normalizer([labels != -100], process_group=group)
    head_inputs: dict = dict(labels=labels)
    if case.kind == "policy":
        head_inputs.update(
            old_logprobs=d["old"][rows].float(),
            advantages=d["adv"][rows].float(),
            ref_logprobs=d["ref"][rows].float(),
            normalizer=norm,
        )
    out = model(ids, head_inputs) if case.inside else model.head(model(ids), **head_inputs)
    if case.kind == "logprob":
        per_token = d["w_logp"][rows] * out.logprobs + d["w_ent"][rows] * out.entropy
        loss = per_token.sum() / norm.num_tokens
    else:
        loss = out[0]
    (loss * scale).backward()
    return loss.detach().double()


def reference_step(case: Case, d: dict, dtype: torch.dtype):
    """One process, whole batch, plain torch head (and policy_loss on its log-probs): the loss
    and every parameter's gradient, as float64."""
    model = make_model(case, dtype)
    labels = d["labels"]
    head_dtype = None if dtype == torch.float64 else case.head_dtype
    with_ent = case.kind == "logprob" or case.config.entropy_coef != 0
    hidden = model(d["ids"])
    logp, ent = reference_head(model.head, hidden, labels, head_dtype, with_entropy=with_ent)
    if case.kind == "logprob":
        per_token = d["w_logp"] * logp + d["w_ent"] * ent
        loss = per_token.sum() / (labels != -100).sum()
    else:
        f = logp.dtype
        loss, _ = policy_loss(
            logp,
            d["old"].to(f),
            d["adv"].to(f),
            labels != -100,
            config=case.config,
            ref_logprobs=d["ref"].to(f),
            entropy=ent,
        )
    loss.backward()
    return loss.detach().double(), {n: p.grad.double() for n, p in model.named_parameters()}


# ----------------------------------------------------------------------------- one process


class Holder(nn.Module):
    """Any module with an nn.Parameter ``weight`` [V, H] (and no ``bias`` attribute)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(V, H))


SOURCES = {
    "linear_bias": lambda: nn.Linear(H, V),
    "linear": lambda: nn.Linear(H, V, bias=False),
    "embedding": lambda: nn.Embedding(V, H),
    "custom": Holder,
}


def _exact(actual, expected, name):
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


def _leaf(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().clone().requires_grad_()


@pytest.mark.parametrize("per_call_temperature", [False, True])
@pytest.mark.parametrize("source", list(SOURCES))
def test_logprob_head_equals_functional(source, per_call_temperature):
    src = SOURCES[source]()
    opts = dict(with_entropy=True, temperature=0.7, softcap=3.0, chunk_size=5)
    head = LogprobHead(src, **opts)
    assert head.weight is src.weight and head.bias is getattr(src, "bias", None)
    assert [id(p) for p in head.parameters()] == [id(p) for p in src.parameters()]
    hidden = torch.randn(3, 7, H, requires_grad=True)
    labels = torch.randint(0, V, (3, 7))
    labels[:, :2] = -100
    temperature = torch.rand(3, 7) + 0.5 if per_call_temperature else None
    g_logp, g_ent = torch.randn(2, 3, 7)  # random upstream gradients

    out = head(hidden, labels, temperature=temperature)
    assert out.logprobs._base is None and out.entropy._base is None  # not views (FSDP2 hooks)
    ((out.logprobs * g_logp).sum() + (out.entropy * g_ent).sum()).backward()

    h2, w2, b2 = _leaf(hidden), _leaf(src.weight), _leaf(head.bias)
    if temperature is not None:
        opts["temperature"] = temperature
    ref = linear_logprobs(h2, w2, labels, bias=b2, **opts)
    ((ref.logprobs * g_logp).sum() + (ref.entropy * g_ent).sum()).backward()
    _exact(out.logprobs, ref.logprobs, "logprobs")
    _exact(out.entropy, ref.entropy, "entropy")
    _exact(hidden.grad, h2.grad, "hidden grad")
    _exact(src.weight.grad, w2.grad, "weight grad")
    if b2 is not None:
        _exact(src.bias.grad, b2.grad, "bias grad")


@pytest.mark.parametrize("config", [DAPO, GSPO], ids=["dapo_kl_entropy", "gspo"])
def test_policy_head_equals_functional(config):
    n = 23
    src = nn.Linear(H, V)
    head = PolicyLossHead(src, config=config, temperature=0.9, chunk_size=4)
    hidden = torch.randn(n, H, requires_grad=True)
    labels = torch.randint(0, V, (n,))
    labels[[0, 7, 8, 15]] = -100
    document_ids = torch.tensor([0] * 8 + [1] * 7 + [2] * 6 + [-1] * 2)  # packed, 2 padding
    labels[-2:] = -100
    with torch.no_grad():
        old = linear_logprobs(hidden, src.weight, labels, bias=src.bias).logprobs
    old = old + 0.05 * torch.randn(n) * (labels != -100)
    ref_lp, adv = old + 0.05 * torch.randn(n), torch.randn(3)
    kw = dict(document_ids=document_ids, ref_logprobs=ref_lp)

    loss, metrics = head(hidden, labels, old, adv, **kw)
    loss.backward()
    h2, w2, b2 = _leaf(hidden), _leaf(src.weight), _leaf(src.bias)
    loss2, metrics2 = fused_policy_loss(
        h2, w2, labels, old, adv, config=config, bias=b2, temperature=0.9, chunk_size=4, **kw
    )
    loss2.backward()
    _exact(loss, loss2, "loss")
    assert metrics.keys() == metrics2.keys()
    for k in metrics:
        _exact(metrics[k], metrics2[k], k)
    _exact(hidden.grad, h2.grad, "hidden grad")
    _exact(src.weight.grad, w2.grad, "weight grad")
    _exact(src.bias.grad, b2.grad, "bias grad")


def _tied_model_loss(embed_w, head_w, mlp, ids, labels, head, g_logp):
    """The tied model: hidden = tanh(mlp(embed(ids))); a random-weighted sum of log-probs from
    ``head`` (logitless module) or, with ``head=None``, plain torch log_softmax."""
    hidden = torch.tanh(F.linear(F.embedding(ids, embed_w), mlp))
    if head is not None:
        logp = head(hidden, labels).logprobs
    else:
        lsm = F.linear(hidden, head_w).log_softmax(-1)
        logp = lsm.gather(-1, labels.clamp(min=0)[..., None])[..., 0] * (labels != -100)
    return (g_logp * logp).sum()


def test_tied_embedding_gradient_is_lookup_plus_head():
    """One Parameter, two uses: its .grad must be d/d(lookup) + d/d(head), computed here by the
    plain torch model with two separate copies of the weight."""
    ids = torch.randint(0, V, (4, 6))
    labels = torch.cat([ids[:, 1:], torch.full((4, 1), -100)], 1)
    g_logp = torch.randn(4, 6)
    embed = nn.Embedding(V, H)
    mlp = torch.randn(H, H) / H**0.5
    head = LogprobHead(embed)
    _tied_model_loss(embed.weight, None, mlp, ids, labels, head, g_logp).backward()

    def two_copies(dtype):
        lookup_w, head_w = (_leaf(embed.weight.to(dtype)) for _ in range(2))
        loss = _tied_model_loss(
            lookup_w, head_w, mlp.to(dtype), ids, labels, None, g_logp.to(dtype)
        )
        loss.backward()
        return lookup_w.grad, head_w.grad

    ref_lookup, ref_head = two_copies(torch.float32)
    truth_lookup, truth_head = two_copies(torch.float64)
    assert float(truth_lookup.abs().sum()) > 0 and float(truth_head.abs().sum()) > 0
    assert_no_worse_than_reference(
        embed.weight.grad, ref_lookup + ref_head, truth_lookup + truth_head, "tied grad"
    )


def test_fp32_head_on_bf16_weight_grad_lands_in_bf16_parameter():
    src = nn.Linear(H, V).to(torch.bfloat16)
    head = LogprobHead(src, with_entropy=True, head_dtype=torch.float32)
    hidden = torch.randn(4, 5, H, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, V, (4, 5))
    g_logp, g_ent = torch.randn(2, 4, 5)
    out = head(hidden, labels)
    ((out.logprobs * g_logp).sum() + (out.entropy * g_ent).sum()).backward()
    assert src.weight.grad.dtype == torch.bfloat16 and src.bias.grad.dtype == torch.bfloat16

    def plain(dtype):  # plain torch: the fp32 projection of the bf16 weights (float64: truth)
        h, w, b = (t.detach().to(dtype).requires_grad_() for t in (hidden, src.weight, src.bias))
        lsm = F.linear(h, w, b).log_softmax(-1)
        logp = lsm.gather(-1, labels[..., None])[..., 0]
        ent = -(lsm.exp() * lsm).sum(-1)
        ((logp * g_logp.to(dtype)).sum() + (ent * g_ent.to(dtype)).sum()).backward()
        return {"hidden": h.grad, "weight": w.grad, "bias": b.grad}

    ref, truth = plain(torch.float32), plain(torch.float64)
    # the reference's gradients rounded to the parameters' bf16, as autograd would store them
    ref = {k: v.to(torch.bfloat16) for k, v in ref.items()}
    got = {"hidden": hidden.grad, "weight": src.weight.grad, "bias": src.bias.grad}
    for k in got:
        assert_no_worse_than_reference(got[k], ref[k], truth[k], f"bf16 {k} grad")


def test_bad_source_or_config_raises_value_error():
    class NoWeight(nn.Module):
        pass

    class PlainTensorWeight(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.randn(V, H)  # not a Parameter: cannot be shared

    class BadBias(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(V, H))
            self.bias = nn.Parameter(torch.randn(V + 1))

    cases = [
        (torch.randn(V, H), "must be an nn.Module"),
        (NoWeight(), "nn.Parameter attribute 'weight'"),
        (PlainTensorWeight(), "nn.Parameter attribute 'weight'"),
        (nn.LayerNorm(H), "floating [V, H] parameter"),
        (BadBias(), f"shape [{V}]"),
    ]
    for source, expected in cases:
        for make in (LogprobHead, lambda s: PolicyLossHead(s, config=DAPO)):
            with pytest.raises(ValueError, match=re.escape(expected)):
                make(source)
    with pytest.raises(ValueError, match="config must be a PolicyLossConfig"):
        PolicyLossHead(nn.Linear(H, V), config={"clip_low": 0.2})


def test_16_bit_loss_inputs_raise_value_error():
    """What FSDP2's MixedPrecisionPolicy would hand the heads with cast_forward_inputs=True."""
    n = 6
    head = PolicyLossHead(nn.Linear(H, V), config=DAPO)
    hidden, labels = torch.randn(n, H), torch.randint(0, V, (n,))
    docs = torch.zeros(n, dtype=torch.long)
    old, adv = torch.full((n,), -2.0), torch.ones(1)
    bf = torch.bfloat16
    norm = loss_normalizer([labels >= 0], [docs])
    head(hidden, labels, old, adv, document_ids=docs, ref_logprobs=old, normalizer=norm)  # ok
    bad = {
        "old_logprobs": dict(old_logprobs=old.to(bf)),
        "advantages": dict(advantages=adv.to(torch.float16)),
        "ref_logprobs": dict(ref_logprobs=old.to(bf)),
        "normalizer.num_tokens": dict(
            normalizer=LossNormalizer(norm.num_tokens.to(bf), norm.num_sequences)
        ),
    }
    for name, change in bad.items():
        kw = dict(old_logprobs=old, advantages=adv, ref_logprobs=old, normalizer=norm) | change
        with pytest.raises(ValueError, match=re.escape(f"{name} must be float32 or float64")):
            head(hidden, labels, document_ids=docs, **kw)
    with pytest.raises(ValueError, match="temperature must be float32 or float64"):
        LogprobHead(nn.Linear(H, V))(hidden, labels, temperature=torch.full((n,), 0.7, dtype=bf))


def test_replaced_source_weight_raises_instead_of_training_a_stale_copy():
    src = nn.Linear(H, V)
    head = LogprobHead(src)
    hidden, labels = torch.randn(3, H), torch.randint(0, V, (3,))
    head(hidden, labels)
    src.weight = nn.Parameter(torch.randn(V, H))  # e.g. load_state_dict(assign=True)
    with pytest.raises(ValueError, match="stale copy"):
        head(hidden, labels)
    # A head whose source is gone (a consumed nn.Linear) has nothing to check against.
    head = LogprobHead(nn.Linear(H, V))
    assert head(hidden, labels).logprobs.shape == (3,)


def test_pickle_and_repr():
    head = PolicyLossHead(nn.Embedding(V, H), config=GSPO, head_dtype=torch.float32)
    copy = pickle.loads(pickle.dumps(head))
    _exact(copy.weight, head.weight, "weight")
    assert copy.weight is not head.weight and copy.bias is None
    text = repr(LogprobHead(nn.Linear(H, V), with_entropy=True))
    assert f"vocab={V}, hidden={H}, bias=True" in text and "with_entropy=True" in text


# ----------------------------------------------------------------------------- FSDP2 workers


def shard(model: TinyDecoder, case: Case, mesh) -> None:
    """Bottom-up fully_shard: the block; the head, in one group with every other module
    holding its weight (the tied embedding, an HF-like lm_head); the root."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp, mp_keep_inputs = {}, {}
    if case.mp:  # bf16 compute; modules that get loss inputs must not cast them to bf16
        mp = dict(mp_policy=MixedPrecisionPolicy(torch.bfloat16, torch.float32))
        policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32, cast_forward_inputs=False)
        mp_keep_inputs = dict(mp_policy=policy)
    fully_shard(model.block, mesh=mesh, **mp)
    holders = [model.embed] if case.tied else []
    holders += [model.lm_head] if case.holder else []
    fully_shard([*holders, model.head] if holders else model.head, mesh=mesh, **mp_keep_inputs)
    fully_shard(model, mesh=mesh, **mp_keep_inputs)


def _worker(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    results: dict = {}
    view_warnings: list[str] = []  # FSDP2: a head output that is a view can lose its hook
    for case in CASES:
        d = batch(case)
        model = make_model(case, case.dtype)
        shard(model, case, mesh)
        # FSDP2 averages gradients over the ranks: backpropagate each share times WORLD.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = run_step(model, case, d, ROWS[rank], float(WORLD), dist.group.WORLD)
        view_warnings += [
            str(w.message) for w in caught if "Head) returned a view" in str(w.message)
        ]
        grads = {}
        for name, p in model.named_parameters():
            assert type(p).__name__ == "DTensor", f"{case.name}: {name} is not sharded"
            assert p.grad is not None, f"{case.name}: no gradient reached {name}"
            assert p.grad.dtype == case.dtype, (case.name, name, p.grad.dtype)
            grads[name] = p.grad.full_tensor().double()
        results[case.name] = (loss, grads)

    results["view_warnings"] = view_warnings
    # Misuse: fully_shard on the module the weight came from, not on the head. Sharded
    # after the head was built, the head would hold a stale full copy; built from the
    # sharded module, it would get a DTensor. Both raise, saying what to shard.
    lm_head = nn.Linear(H, V)
    stale = LogprobHead(lm_head)
    fully_shard(lm_head, mesh=mesh)
    for key, head in (("stale", stale), ("dtensor", LogprobHead(lm_head))):
        try:
            head(torch.randn(3, H), torch.zeros(3, dtype=torch.long))
            results[key] = None
        except ValueError as e:
            results[key] = str(e)

    # MixedPrecisionPolicy casts a sharded module's floating inputs to param_dtype unless
    # cast_forward_inputs=False: old log-probs, advantages, normalizer counts would be bf16.
    cast = PolicyLossHead(nn.Linear(H, V), config=DAPO, head_dtype=torch.float32)
    fully_shard(cast, mesh=mesh, mp_policy=MixedPrecisionPolicy(torch.bfloat16))
    ids = torch.zeros(3, dtype=torch.long)
    try:
        cast(torch.randn(3, H), ids, torch.full((3,), -1.0), torch.ones(1), document_ids=ids)
        results["cast"] = None
    except ValueError as e:
        results["cast"] = str(e)
    results["vocab_parallel"] = vocab_parallel_module_vs_functional()
    return results


def vocab_parallel_module_vs_functional() -> list[str]:
    """The heads pass ``vocab_parallel`` through: a module holding this rank's vocabulary shard
    equals the functional call on that shard (outputs and gradients, bitwise). Returns the
    names of the mismatches."""
    vp = VocabParallel.even(V)
    torch.manual_seed(5)  # the same full head on every rank
    full = nn.Linear(H, V)
    src = nn.Linear(H, vp.shard_size)
    with torch.no_grad():
        src.weight.copy_(vp.shard(full.weight))
        src.bias.copy_(vp.shard(full.bias))
    torch.manual_seed(6)  # the same tokens on every rank (the shards above differ in size)
    hidden = torch.randn(11, H, requires_grad=True)
    labels = torch.randint(0, V, (11,))
    labels[:3] = -100
    docs = torch.tensor([0] * 6 + [1] * 5)
    with torch.no_grad():
        old = linear_logprobs(hidden, src.weight, labels, bias=src.bias, vocab_parallel=vp)[0]
    g_logp, g_ent = torch.randn(2, 11)
    bad = []

    def compare(run_module, run_functional, what):
        h2, w2, b2 = _leaf(hidden), _leaf(src.weight), _leaf(src.bias)
        outs = run_module(hidden), run_functional(h2, w2, b2)
        for name, a, b in [("out", *outs), ("hidden", hidden.grad, h2.grad)] + [
            ("weight", src.weight.grad, w2.grad),
            ("bias", src.bias.grad, b2.grad),
        ]:
            if not torch.equal(a, b):
                bad.append(f"{what} {name}")
        for t in (hidden, src.weight, src.bias):
            t.grad = None

    def logp_loss(out):
        return (out.logprobs * g_logp).sum() + (out.entropy * g_ent).sum()

    def module_logp(h):
        out = LogprobHead(src, with_entropy=True, vocab_parallel=vp)(h, labels)
        logp_loss(out).backward()
        return torch.stack([out.logprobs, out.entropy])

    def functional_logp(h, w, b):
        out = linear_logprobs(h, w, labels, bias=b, with_entropy=True, vocab_parallel=vp)
        logp_loss(out).backward()
        return torch.stack([out.logprobs, out.entropy])

    def module_loss(h):
        loss, _ = PolicyLossHead(src, config=DAPO, vocab_parallel=vp)(
            h,
            labels,
            old,
            torch.randn(2, generator=torch.Generator().manual_seed(1)),
            document_ids=docs,
            ref_logprobs=old,
        )
        loss.backward()
        return loss.detach()

    def functional_loss(h, w, b):
        loss, _ = fused_policy_loss(
            h,
            w,
            labels,
            old,
            torch.randn(2, generator=torch.Generator().manual_seed(1)),
            config=DAPO,
            bias=b,
            document_ids=docs,
            ref_logprobs=old,
            vocab_parallel=vp,
        )
        loss.backward()
        return loss.detach()

    compare(module_logp, functional_logp, "LogprobHead")
    compare(module_loss, functional_loss, "PolicyLossHead")
    return bad


@pytest.fixture(scope="module")
def fsdp_results() -> list[dict]:
    return spawn(_worker, WORLD)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_fsdp2_matches_one_process(fsdp_results, case):
    d = batch(case)
    truth_loss, truth_grads = reference_step(case, d, torch.float64)
    ref_loss, ref_grads = reference_step(case, d, case.compute_dtype)
    shares = [r[case.name][0] for r in fsdp_results]
    assert_no_worse_than_reference(sum(shares), ref_loss, truth_loss, f"{case.name} loss")
    grads0, grads1 = fsdp_results[0][case.name][1], fsdp_results[1][case.name][1]
    assert set(grads0) == set(truth_grads), (sorted(grads0), sorted(truth_grads))
    for name, g in grads0.items():
        assert torch.equal(g, grads1[name]), f"{case.name} {name}: ranks gathered different grads"
        assert_no_worse_than_reference(g, ref_grads[name], truth_grads[name], f"{case.name} {name}")


def test_sharding_the_source_without_the_head_says_what_to_shard(fsdp_results):
    for r in fsdp_results:
        assert r["view_warnings"] == []
        assert r["stale"] is not None, "the head ran on a stale copy of a sharded weight"
        assert "stale copy" in r["stale"] and "fully_shard([lm_head, head])" in r["stale"]
        assert r["dtensor"] is not None, "a sharded DTensor weight reached the head"
        assert "DTensor" in r["dtensor"] and "fully_shard(head)" in r["dtensor"], r["dtensor"]
        assert r["cast"] is not None, "bf16-cast old log-probs reached the loss"
        assert "old_logprobs must be float32" in r["cast"], r["cast"]
        assert "cast_forward_inputs=False" in r["cast"], r["cast"]


def test_vocab_parallel_passes_through(fsdp_results):
    for r in fsdp_results:
        assert r["vocab_parallel"] == [], r["vocab_parallel"]
