"""Parity with the peer libraries: Cut Cross-Entropy (log-probs) and Liger-Kernel (GRPO losses).

CCE: ``-cut_cross_entropy.linear_cross_entropy(e, c, targets, reduction="none")`` is the
per-token log-prob, so it must equal ``logitless.linear_logprobs(e, c, targets).logprobs``
(with ``ignore_index``, ``softcap`` and ``shift``; CCE has no bias or temperature, which map to
an extra input column and a scaled input).

Liger: ``liger_kernel.chunked_loss.LigerFusedLinearGRPOLoss`` for each of its loss types, at
token and sequence importance-sampling level, with and without the KL term, against
``logitless.fused_policy_loss`` and ``policy_loss(linear_logprobs(...))`` with the options that
:func:`liger_to_logitless` picks (the mapping table of the README, as code).

Tolerances (tests/_tolerance.py): the truth is the peer's own formula in float64 on float64
full logits (CCE: ``F.cross_entropy``; Liger: its ``ppo_loss_fn``); the naive composition is
the same formula in fp32. Peer and logitless results must each be within 4x the naive's error
of the truth (max and rms, per tensor); scalars get the fp32 summation floor
``num_tokens * eps * |value|``. Negative tests check that wrong mappings fail the comparison.

Both peers run on CPU: CCE through ``impl="torch_compile"`` (needs a C++ compiler), Liger's
chunked loss in plain torch (``compiled=False``; one case keeps its default ``torch.compile``).
Without the ``[peers]`` extra the tests skip with the reason.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from _tolerance import assert_no_worse_than_reference

import logitless
from logitless import LossNormalizer, PolicyLossConfig, fused_policy_loss, policy_loss

try:
    from cut_cross_entropy import linear_cross_entropy
except ImportError as exc:  # CCE also imports Triton at import time on Linux
    linear_cross_entropy = None
    _CCE_MISSING = (
        f"cut-cross-entropy is not importable ({exc}); pip install -e '.[peers]' in a logitless "
        "checkout"
    )
else:
    _CCE_MISSING = ""

try:
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
    from liger_kernel.chunked_loss.grpo_loss import LigerFusedLinearGRPOFunction
except ImportError as exc:
    LigerFusedLinearGRPOLoss = LigerFusedLinearGRPOFunction = None
    _LIGER_MISSING = (
        f"liger-kernel is not importable ({exc}); pip install -e '.[peers]' in a logitless checkout"
    )
else:
    _LIGER_MISSING = ""

needs_cce = pytest.mark.skipif(linear_cross_entropy is None, reason=_CCE_MISSING)
needs_liger = pytest.mark.skipif(LigerFusedLinearGRPOLoss is None, reason=_LIGER_MISSING)

EPS32 = torch.finfo(torch.float32).eps


def _check(errors: list[str], actual, naive, truth, name: str, *, floor: float) -> None:
    """Append the failure message of the K x naive-error rule instead of raising."""
    try:
        assert_no_worse_than_reference(actual, naive, truth, name, floor=floor)
    except AssertionError as e:
        errors.append(str(e))


# =============================================================================================
# Cut Cross-Entropy: per-token log-probs

CCE_SHAPE = (3, 41)  # [B, T] -> 123 rows; H = 48, V = 507
CCE_H, CCE_V = 48, 507


def _cce(e, c, targets, **kw):
    return linear_cross_entropy(e, c, targets, reduction="none", impl="torch_compile", **kw)


def _cce_problem(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    e = torch.randn(*CCE_SHAPE, CCE_H, generator=g)
    c = torch.randn(CCE_V, CCE_H, generator=g) * (2.0 / CCE_H**0.5)
    b = torch.randn(CCE_V, generator=g)
    targets = torch.randint(0, CCE_V, CCE_SHAPE, generator=g)
    targets[torch.rand(CCE_SHAPE, generator=g) < 0.3] = -100  # ignored rows, scattered
    targets[1, :7] = -100  # and a run of them
    upstream = torch.randn(CCE_SHAPE, generator=g)
    return e, c, b, targets, upstream


def _grads(fn, dtype, *leaves, upstream):
    """Run ``fn`` on fresh leaf copies in ``dtype``; return its output and the leaves' grads."""
    xs = [x.detach().to(dtype).requires_grad_() for x in leaves]
    out = fn(*xs)
    (out * upstream.to(out.dtype)).sum().backward()
    return [out.detach()] + [x.grad for x in xs]


def _truth_ce(e, c, targets, softcap=None):
    """-log p(target) from full logits, in the inputs' dtype: ``F.cross_entropy`` per row."""
    logits = e @ c.T
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    flat = F.cross_entropy(logits.flatten(0, -2), targets.flatten(), reduction="none")
    return flat.view(targets.shape)  # 0 at ignore_index


def _compare_cce(ours, cce, naive, truth, names) -> list[str]:
    errors: list[str] = []
    for name, o, p, n, t in zip(names, ours, cce, naive, truth, strict=True):
        _check(errors, o, n, t, f"logitless {name}", floor=EPS32)
        _check(errors, p, n, t, f"cce {name}", floor=EPS32)
    return errors


@needs_cce
@pytest.mark.parametrize("softcap", [None, 5.0], ids=["plain", "softcap"])
def test_cce_logprobs_and_grads(softcap):
    """linear_logprobs(e, c, y).logprobs == -CCE(e, c, y, reduction="none"), and gradients."""
    e, c, _, targets, g = _cce_problem()
    kw = {} if softcap is None else {"softcap": softcap}

    def ours(e, c):
        return -logitless.linear_logprobs(e, c, targets, **kw).logprobs

    def naive(e, c):
        return _truth_ce(e, c, targets, softcap)

    res = {
        "ours": _grads(ours, torch.float32, e, c, upstream=g),
        "cce": _grads(lambda e, c: _cce(e, c, targets, **kw), torch.float32, e, c, upstream=g),
        "naive": _grads(naive, torch.float32, e, c, upstream=g),
        "truth": _grads(naive, torch.float64, e, c, upstream=g),
    }
    errors = _compare_cce(*res.values(), names=("-logprobs", "e.grad", "c.grad"))
    assert not errors, "\n".join(errors)
    ignored = targets == -100
    assert (res["cce"][0][ignored] == 0).all() and (res["ours"][0][ignored] == 0).all()
    assert (res["ours"][1][ignored] == 0).all()  # ignored rows get no gradient in either
    assert (res["cce"][1][ignored] == 0).all()


@needs_cce
def test_cce_shift_bias_temperature():
    """CCE's ``shift=True``, and logitless's bias / temperature expressed in CCE's inputs.

    shift:       -CCE(e, c, y, shift=True)  == linear_logprobs(e[:, :-1], c, y[:, 1:])
    bias:        -CCE([e, 1], [c, b], y)    == linear_logprobs(e, c, y, bias=b)
    temperature: -CCE(e / t, c, y)          == linear_logprobs(e, c, y, temperature=t)
    """
    e, c, b, targets, g = _cce_problem(seed=1)
    t = 0.7
    ones = torch.ones(*CCE_SHAPE, 1)

    def with_col(e, c, b):  # [e, 1] @ [c, b].T = e @ c.T + b
        return torch.cat([e, ones.to(e.dtype)], -1), torch.cat([c, b[:, None]], -1)

    cases = {
        "shift": (
            lambda e, c: -logitless.linear_logprobs(e[:, :-1], c, targets[:, 1:]).logprobs,
            lambda e, c: _cce(e, c, targets, shift=True),
            lambda e, c: _truth_ce(e[:, :-1], c, targets[:, 1:]),
            (e, c),
            g[:, 1:],
        ),
        "bias": (
            lambda e, c, b: -logitless.linear_logprobs(e, c, targets, bias=b).logprobs,
            lambda e, c, b: _cce(*with_col(e, c, b), targets),
            lambda e, c, b: _truth_ce(*with_col(e, c, b), targets),
            (e, c, b),
            g,
        ),
        "temperature": (
            lambda e, c: -logitless.linear_logprobs(e, c, targets, temperature=t).logprobs,
            lambda e, c: _cce(e / t, c, targets),
            lambda e, c: _truth_ce(e / t, c, targets),
            (e, c),
            g,
        ),
    }
    errors = []
    for case, (ours, cce, naive, leaves, up) in cases.items():
        res = [
            _grads(ours, torch.float32, *leaves, upstream=up),
            _grads(cce, torch.float32, *leaves, upstream=up),
            _grads(naive, torch.float32, *leaves, upstream=up),
            _grads(naive, torch.float64, *leaves, upstream=up),
        ]
        names = [f"{case}: {n}" for n in ("-logprobs", "e.grad", "c.grad", "b.grad")]
        errors += _compare_cce(*res, names=names[: len(leaves) + 1])
    assert not errors, "\n".join(errors)


@needs_cce
def test_cce_comparison_can_fail():
    """The CCE comparison rejects a result that is off by a temperature of 1.001."""
    e, c, _, targets, g = _cce_problem()
    cce = _grads(lambda e, c: _cce(e, c, targets), torch.float32, e, c, upstream=g)
    naive = _grads(lambda e, c: _truth_ce(e, c, targets), torch.float32, e, c, upstream=g)
    truth = _grads(lambda e, c: _truth_ce(e, c, targets), torch.float64, e, c, upstream=g)
    wrong = _grads(
        lambda e, c: -logitless.linear_logprobs(e, c, targets, temperature=1.001).logprobs,
        torch.float32,
        e,
        c,
        upstream=g,
    )
    errors = _compare_cce(wrong, cce, naive, truth, names=("-logprobs", "e.grad", "c.grad"))
    assert len(errors) == 3, errors  # -logprobs, e.grad and c.grad all fail


# =============================================================================================
# Liger-Kernel: LigerFusedLinearGRPOLoss

B, T, H, V = 4, 17, 32, 301
IS_CAP = 2.0  # truncation of the vLLM importance-sampling ratio (TRL's cap)
LENGTHS = (17, 11, 6, 14)  # completion tokens per row, right-padded to T
HEAD_OPTIONS = ("temperature", "compiled", "use_ref_model", "chunk_size")


def liger_to_logitless(
    *,
    loss_type: str = "dapo",
    importance_sampling_level: str = "token",
    beta: float = 0.04,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    max_completion_length: int | None = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    delta: float | None = None,
    **head_options,
) -> PolicyLossConfig:
    """The ``PolicyLossConfig`` that reproduces ``LigerFusedLinearGRPOLoss(**options)``.

    Defaults are Liger's (0.8.5). ``head_options`` (temperature, chunk_size, compiled,
    use_ref_model) do not enter the config: the temperature goes to ``fused_policy_loss``.
    """
    unknown = set(head_options) - set(HEAD_OPTIONS)
    if unknown:  # e.g. use_bias_correction_kl, vespo_*
        raise ValueError(f"no logitless mapping for Liger options {sorted(unknown)}")
    if loss_type == "luspo" and (importance_sampling_level != "sequence" or beta != 0.0):
        # token-level LUSPO (and its KL term) also sums the loss at padded positions
        raise ValueError("luspo maps only with importance_sampling_level='sequence', beta=0")
    if delta is not None and loss_type not in ("cispo", "sapo") and delta < 1 + epsilon_high:
        raise ValueError(f"delta={delta} maps to dual_clip only when >= 1 + epsilon_high")
    aggregations = {
        "grpo": "seq_mean_token_mean",  # per-row token mean, then mean over rows
        "sapo": "seq_mean_token_mean",
        "bnpo": "token_mean",  # sum / mask.sum()
        "dapo": "token_mean",
        "cispo": "token_mean",
        "dr_grpo": "seq_mean_token_sum_norm",  # sum / (B * max_completion_length)
        "luspo": "seq_mean_token_sum",  # sequence level only: sum_d n_d L_d / B
    }
    if loss_type not in aggregations:  # vespo: no logitless equivalent
        raise ValueError(f"no logitless mapping for loss_type={loss_type!r}")
    aggregation = aggregations[loss_type]
    surrogate = {"cispo": "cispo", "sapo": "sapo"}.get(loss_type, "ppo_clip")
    if loss_type == "cispo":
        # Liger clamps the ratio to at most epsilon_high itself (no lower bound);
        # logitless's bound is 1 + clip_high, and clip_low=1 leaves the low side open.
        clip_low, clip_high = 1.0, epsilon_high - 1.0
    else:
        clip_low, clip_high = epsilon_low, epsilon_high
    extra = {}
    if surrogate == "sapo":
        extra = dict(sapo_tau_pos=sapo_temperature_pos, sapo_tau_neg=sapo_temperature_neg)
    if delta is not None and surrogate == "ppo_clip":
        # min(r, delta) in the unclipped term only bites for A < 0: PPO dual clip with c=delta
        # (the same loss while delta >= 1 + epsilon_high)
        extra["dual_clip"] = delta
    return PolicyLossConfig(
        surrogate=surrogate,
        clip_low=clip_low,
        clip_high=clip_high,
        ratio_level=importance_sampling_level,
        aggregation=aggregation,
        norm_length=max_completion_length,
        kl_coef=beta,
        kl_estimator="k3",  # exp(ref - lp) - (ref - lp) - 1
        kl_log_ratio_clamp=None,  # Liger clamps neither
        kl_value_clamp=None,
        **extra,
    )


def _liger_batch(
    temperature: float, *, use_bias: bool = True, empty_row: bool = False, seed: int = 0
) -> dict:
    """Liger-layout inputs: hidden [B, T, H], ids [B, T], float attention mask, adv [B]."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g)
    weight = torch.randn(V, H, generator=g) * (2.0 / H**0.5)
    bias = 0.5 * torch.randn(V, generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    lengths = torch.tensor(LENGTHS)
    if empty_row:
        lengths[2] = 0
    mask = (torch.arange(T) < lengths[:, None]).float()
    mask[0, 3:5] = 0.0  # a hole (e.g. tool output): masked inside a completion
    adv = torch.randn(B, generator=g).abs() * torch.tensor([1.0, -1.0, 1.0, -1.0])
    with torch.no_grad():
        lp = _naive_head(hidden, weight, bias if use_bias else None, ids, temperature)  # policy
    old = lp + 0.35 * torch.randn(B, T, generator=g)  # wide enough that clips bite
    ref = lp + 0.35 * torch.randn(B, T, generator=g)
    is_ratio = torch.exp(0.3 * torch.randn(B, T, generator=g)).clamp(max=IS_CAP)  # as TRL
    return dict(
        hidden=hidden, weight=weight, bias=bias, ids=ids, mask=mask, adv=adv,
        old=old, ref=ref, is_ratio=is_ratio,
        # a reference model's head inputs, for Liger's ref_input / ref_weight / ref_bias
        ref_hidden=hidden + 0.3 * torch.randn(B, T, H, generator=g),
        ref_weight=weight + 0.1 * torch.randn(V, H, generator=g),
        ref_bias=bias + 0.1 * torch.randn(V, generator=g),
    )  # fmt: skip


def _naive_head(hidden, weight, bias, ids, temperature):
    """log softmax(h W^T + b) / T at ``ids``, from full logits: the obviously-correct head."""
    logits = F.linear(hidden, weight, bias) / temperature
    return torch.log_softmax(logits, -1).gather(-1, ids[..., None]).squeeze(-1)


@dataclasses.dataclass
class Result:
    loss: torch.Tensor
    metrics: dict  # Liger's names: "kl" (with beta), "clip"
    grads: list  # hidden, weight (, bias)


def _leaves(batch, dtype, use_bias):
    names = ("hidden", "weight", "bias") if use_bias else ("hidden", "weight")
    return [batch[n].detach().to(dtype).requires_grad_() for n in names]


def _inputs(batch, extra, dtype=torch.float32):
    """Liger's optional per-call inputs for a case's ``extra`` (``vllm_is_ratio``, counts)."""
    kw = {}
    if "vllm_is_ratio" in extra:
        kw["vllm_is_ratio"] = batch["is_ratio"].to(dtype)
    if "num_items_in_batch" in extra:
        kw["num_items_in_batch"] = extra["num_items_in_batch"]
    return kw


SCALE = 2.5  # upstream gradient of the loss (Liger scales its stored gradients by it)


def _run_liger(batch, options, extra, use_bias) -> Result:
    leaves = _leaves(batch, torch.float32, use_bias)
    fn = LigerFusedLinearGRPOLoss(**{"compiled": False, **options})
    h, w, *b = leaves
    kw = dict(ref_per_token_logps=batch["ref"], old_per_token_logps=batch["old"])
    if extra.get("ref_model"):  # Liger runs the reference head itself
        kw.update(
            ref_per_token_logps=None,
            ref_input=batch["ref_hidden"],
            ref_weight=batch["ref_weight"],
            ref_bias=batch["ref_bias"],
        )
    if extra.get("on_policy"):  # old = the current log-probs, detached
        kw["old_per_token_logps"] = None
    loss, metrics = fn(
        h, w, batch["ids"], batch["mask"], batch["adv"], b[0] if b else None,
        **kw, **_inputs(batch, extra),
    )  # fmt: skip
    (loss * SCALE).backward()
    return Result(loss.detach(), _liger_metrics(options, metrics), [x.grad for x in leaves])


def _liger_metrics(options, metrics) -> dict:
    metrics = [m.detach() for m in metrics]
    if options.get("beta", 0.04) != 0.0:
        return {"kl": metrics[0], "clip": metrics[1]}
    return {"clip": metrics[0]}


def _run_formula(batch, options, extra, use_bias, dtype) -> Result:
    """Liger's own loss formula (``ppo_loss_fn``) on full-logits log-probs in ``dtype``."""
    leaves = _leaves(batch, dtype, use_bias)
    h, w, *b = leaves
    temperature = options.get("temperature", 1.0)
    lp = _naive_head(h, w, b[0] if b else None, batch["ids"], temperature)
    ref = batch["ref"].to(dtype)
    if extra.get("ref_model"):
        with torch.no_grad():
            ref_head = [batch[k].to(dtype) for k in ("ref_hidden", "ref_weight", "ref_bias")]
            ref = _naive_head(*ref_head, batch["ids"], temperature)
    old = None if extra.get("on_policy") else batch["old"].to(dtype)
    loss_options = {k: v for k, v in options.items() if k not in HEAD_OPTIONS}
    loss, metrics = LigerFusedLinearGRPOFunction.ppo_loss_fn(
        per_token_logps=lp,
        attention_mask=batch["mask"].to(dtype),
        advantages=batch["adv"].to(dtype),
        full_attention_mask=batch["mask"].to(dtype),
        ref_per_token_logps=ref,
        old_per_token_logps=old,
        **_inputs(batch, extra, dtype),
        **loss_options,
    )
    (loss * SCALE).backward()
    return Result(loss.detach(), _liger_metrics(options, metrics), [x.grad for x in leaves])


def _logitless_inputs(batch, options, extra, use_bias):
    """Liger's inputs in logitless's layout: labels with ignore_index, old log-probs, extras."""
    mask = batch["mask"].bool()
    labels = torch.where(mask, batch["ids"], -100)
    head = dict(labels=labels, temperature=options.get("temperature", 1.0))
    old = batch["old"]
    if extra.get("on_policy"):
        with torch.no_grad():
            bias = batch["bias"] if use_bias else None
            old = logitless.linear_logprobs(batch["hidden"], batch["weight"], bias=bias, **head)
            old = old.logprobs
    kw = {}
    if options.get("beta", 0.04) != 0.0:
        kw["ref_logprobs"] = batch["ref"]
        if extra.get("ref_model"):  # the reference head at the same temperature
            with torch.no_grad():
                ref = logitless.linear_logprobs(
                    batch["ref_hidden"], batch["ref_weight"], bias=batch["ref_bias"], **head
                )
            kw["ref_logprobs"] = ref.logprobs
    if "vllm_is_ratio" in extra:  # rho = pi_old / pi_rollout = the ratio Liger is given
        kw["rollout_logprobs"] = batch["old"] - batch["is_ratio"].log()
    if extra.get("normalizer"):
        # Liger counts every row in B (TRL too), logitless only rows with a valid token; DAPO's
        # token count is num_items_in_batch when given
        tokens = extra.get("num_items_in_batch", mask.sum())
        kw["normalizer"] = LossNormalizer(num_tokens=tokens, num_sequences=B)
    return labels, old, kw


def _run_logitless(batch, options, extra, use_bias, *, fused: bool, config=None) -> Result:
    config = config or liger_to_logitless(**options)
    if "vllm_is_ratio" in extra:
        config = dataclasses.replace(config, mismatch_is="token", mismatch_is_cap=IS_CAP)
    labels, old, kw = _logitless_inputs(batch, options, extra, use_bias)
    leaves = _leaves(batch, torch.float32, use_bias)
    h, w, *b = leaves
    bias = b[0] if b else None
    temperature = options.get("temperature", 1.0)
    if fused:
        loss, m = fused_policy_loss(
            h, w, labels, old, batch["adv"], config=config, bias=bias,
            temperature=temperature, **kw,
        )  # fmt: skip
    else:
        lp = logitless.linear_logprobs(h, w, labels, bias=bias, temperature=temperature)
        loss, m = policy_loss(lp.logprobs, old, batch["adv"], labels != -100, config=config, **kw)
    (loss * SCALE).backward()
    metrics = {"clip": m["clip_frac_low"] + m["clip_frac_high"]}
    if "kl_ref" in m:
        metrics["kl"] = m["kl_ref"]
    return Result(loss.detach(), metrics, [x.grad for x in leaves])


def _comparable_metrics(config: PolicyLossConfig) -> tuple[str, ...]:
    """Liger's metrics are token means; logitless's are too under ``token_mean``. Liger counts
    CISPO clips for A > 0 only, logitless for any A, so only PPO clip fractions compare."""
    if config.aggregation != "token_mean":
        return ()
    names = ("kl",) if config.kl_coef > 0 else ()
    return names + (("clip",) if config.surrogate == "ppo_clip" else ())


def _compare_liger(actual: Result, naive: Result, truth: Result, who: str, metrics, n) -> list:
    errors: list[str] = []
    floor = n * EPS32  # a scalar sums n per-token terms (as in test_fused_loss)
    _check(errors, actual.loss, naive.loss, truth.loss, f"{who} loss", floor=floor)
    for key in metrics:
        m = (actual.metrics[key], naive.metrics[key], truth.metrics[key])
        _check(errors, *m, f"{who} metric {key}", floor=floor)
    names = ("hidden", "weight", "bias")[: len(truth.grads)]
    for name, a, r, t in zip(names, actual.grads, naive.grads, truth.grads, strict=True):
        _check(errors, a, r, t, f"{who} {name}.grad", floor=EPS32)
    return errors


def _parity_errors(options, extra=None, *, use_bias=True, empty_row=False, config=None):
    """Compare Liger fused, logitless fused and logitless composed with the float64 truth."""
    extra = extra or {}
    batch = _liger_batch(options.get("temperature", 1.0), use_bias=use_bias, empty_row=empty_row)
    truth = _run_formula(batch, options, extra, use_bias, torch.float64)
    naive = _run_formula(batch, options, extra, use_bias, torch.float32)
    cfg = config or liger_to_logitless(**options)
    metrics = _comparable_metrics(cfg)
    if "num_items_in_batch" in extra:  # Liger's metrics keep the local token count, ours not
        metrics = ()
    n = int(batch["mask"].sum())
    errors = _compare_liger(
        _run_liger(batch, options, extra, use_bias), naive, truth, "liger", metrics, n
    )
    for fused in (True, False):
        ours = _run_logitless(batch, options, extra, use_bias, fused=fused, config=cfg)
        who = "logitless fused" if fused else "logitless composed"
        errors += _compare_liger(ours, naive, truth, who, metrics, n)
    return errors


# Liger options (its defaults: loss_type="dapo", beta=0.04, epsilon 0.2/0.2, token level,
# temperature 1, chunk_size 1, compiled=True; compiled=False here except in "dapo_compiled").
SEQ = dict(importance_sampling_level="sequence", epsilon_low=0.15, epsilon_high=0.2)
LIGER_CASES = {
    "grpo": dict(loss_type="grpo"),
    "grpo_nokl_nobias": dict(loss_type="grpo", beta=0.0),
    "grpo_seq": dict(loss_type="grpo", beta=0.0, **SEQ),
    "grpo_seq_kl": dict(loss_type="grpo", beta=0.1, temperature=0.8, **SEQ),
    "bnpo": dict(loss_type="bnpo", epsilon_high=0.28, chunk_size=2),
    "bnpo_seq": dict(loss_type="bnpo", beta=0.0, **SEQ),
    "dr_grpo": dict(loss_type="dr_grpo", beta=0.0, max_completion_length=24),
    "dr_grpo_seq_kl": dict(loss_type="dr_grpo", max_completion_length=24, **SEQ),
    "dapo_compiled": dict(loss_type="dapo", epsilon_high=0.28, compiled=True),
    "dapo_nokl_temp": dict(loss_type="dapo", beta=0.0, epsilon_high=0.28, temperature=0.7),
    "dapo_seq": dict(loss_type="dapo", beta=0.0, **SEQ),
    "dapo_delta": dict(loss_type="dapo", beta=0.0, epsilon_high=0.28, delta=1.4),
    "cispo": dict(loss_type="cispo", beta=0.0, epsilon_high=1.3),
    "cispo_kl_temp": dict(loss_type="cispo", epsilon_high=1.2, temperature=0.9),
    "sapo": dict(loss_type="sapo", beta=0.0, sapo_temperature_pos=0.8, sapo_temperature_neg=1.6),
    "sapo_kl": dict(loss_type="sapo"),
    "luspo_seq": dict(loss_type="luspo", beta=0.0, **SEQ),
}
NO_BIAS = {"grpo_nokl_nobias", "dapo_seq", "sapo"}


@needs_liger
@pytest.mark.parametrize("name", list(LIGER_CASES))
def test_liger_grpo_loss_parity(name):
    """Loss, token-mean metrics and hidden / weight / bias gradients of each loss type."""
    errors = _parity_errors(LIGER_CASES[name], use_bias=name not in NO_BIAS)
    assert not errors, "\n".join(errors)


LIGER_INPUT_CASES = {
    # vLLM importance-sampling correction: a [B, T] ratio that multiplies the policy term
    "dapo_vllm_is_ratio": (dict(loss_type="dapo", epsilon_high=0.28), {"vllm_is_ratio": True}),
    # DAPO's token count from the whole generation batch (grad accumulation): a normalizer
    "dapo_num_items": (
        dict(loss_type="dapo", epsilon_high=0.28),
        {"num_items_in_batch": 150, "normalizer": True},
    ),
    # the reference model's head run by Liger (ref_input/ref_weight/ref_bias) vs ref_logprobs
    "grpo_ref_model": (dict(loss_type="grpo", beta=0.1, temperature=0.9), {"ref_model": True}),
    # old_per_token_logps=None: on-policy, old = the current log-probs (no-grad pass)
    "dapo_on_policy": (dict(loss_type="dapo", epsilon_high=0.28), {"on_policy": True}),
    # a row with no completion token still counts in Liger's B: num_sequences=B
    "grpo_empty_row": (dict(loss_type="grpo"), {"empty_row": True, "normalizer": True}),
    "dr_grpo_empty_row": (
        dict(loss_type="dr_grpo", max_completion_length=24),
        {"empty_row": True, "normalizer": True},
    ),
}


@needs_liger
@pytest.mark.parametrize("name", list(LIGER_INPUT_CASES))
def test_liger_inputs_parity(name):
    options, extra = LIGER_INPUT_CASES[name]
    errors = _parity_errors(options, extra, empty_row=extra.get("empty_row", False))
    assert not errors, "\n".join(errors)


@needs_liger
def test_liger_cases_exercise_the_clip():
    """Every PPO-clip case has tokens inside and outside the clip range (the data bites)."""
    for name, options in LIGER_CASES.items():
        if options.get("loss_type") in ("cispo", "sapo"):
            continue
        use_bias = name not in NO_BIAS
        batch = _liger_batch(options.get("temperature", 1.0), use_bias=use_bias)
        f = _run_formula(batch, options, {}, use_bias, torch.float64)
        assert 0.0 < float(f.metrics["clip"]) < 0.9, (name, float(f.metrics["clip"]))


WRONG_MAPPINGS = {
    # (Liger options, the wrong logitless config for them)
    "dapo_clip_high_not_mapped": (
        dict(loss_type="dapo", beta=0.0, epsilon_high=0.28),
        PolicyLossConfig(clip_low=0.2, clip_high=0.2),
    ),
    "grpo_as_token_mean": (
        dict(loss_type="grpo", beta=0.0),
        PolicyLossConfig(aggregation="token_mean"),
    ),
    "cispo_bound_as_1_plus_eps": (
        dict(loss_type="cispo", beta=0.0, epsilon_high=1.3),
        PolicyLossConfig(surrogate="cispo", clip_low=1.0, clip_high=1.3),
    ),
    "sequence_level_as_token": (
        dict(loss_type="bnpo", beta=0.0, **SEQ),
        PolicyLossConfig(clip_low=0.15, clip_high=0.2, aggregation="token_mean"),
    ),
    "dr_grpo_wrong_length": (
        dict(loss_type="dr_grpo", beta=0.0, max_completion_length=24),
        PolicyLossConfig(aggregation="seq_mean_token_sum_norm", norm_length=T),
    ),
    "delta_ignored": (
        dict(loss_type="dapo", beta=0.0, epsilon_high=0.28, delta=1.4),
        PolicyLossConfig(clip_low=0.2, clip_high=0.28),
    ),
    "sapo_temperatures_swapped": (
        dict(loss_type="sapo", beta=0.0, sapo_temperature_pos=0.8, sapo_temperature_neg=1.6),
        PolicyLossConfig(
            surrogate="sapo", sapo_tau_pos=1.6, sapo_tau_neg=0.8, aggregation="seq_mean_token_mean"
        ),
    ),
    "kl_k2_for_k3": (
        dict(loss_type="dapo", beta=0.5),
        PolicyLossConfig(kl_coef=0.5, kl_estimator="k2"),
    ),
}


@needs_liger
@pytest.mark.parametrize("name", list(WRONG_MAPPINGS))
def test_liger_wrong_mapping_fails(name):
    """A wrong mapping fails the same comparison, for logitless's results only."""
    options, wrong = WRONG_MAPPINGS[name]
    errors = _parity_errors(options, config=wrong)
    assert errors, "the comparison accepted a wrong mapping"
    assert not [e for e in errors if e.split("; ", 1)[1].startswith("liger ")], errors


@needs_liger
def test_liger_empty_row_is_a_convention_difference():
    """Without a normalizer logitless averages over non-empty sequences, Liger over all B rows:
    the losses differ by exactly B / (B - 1) for GRPO with one empty row."""
    options = dict(loss_type="grpo", beta=0.0)
    batch = _liger_batch(1.0, empty_row=True)
    liger = _run_liger(batch, options, {}, True)
    ours = _run_logitless(batch, options, {}, True, fused=True)
    ratio = float(ours.loss / liger.loss)
    assert math.isclose(ratio, B / (B - 1), rel_tol=1e-5), ratio
    assert _parity_errors(options, empty_row=True), "empty rows should need the normalizer"
