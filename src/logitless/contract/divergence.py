"""The divergence contract: :class:`DivergenceCall`, built by :func:`check_divergence_call`.

A divergence call is two head calls over the same label positions, the student's and the
teacher's, each checked by :func:`~logitless.contract.head.check_head_call` (its own bias,
logit scale, softcap and hidden width; one temperature), plus what only a divergence has: the
TRL ``beta``, the common vocabulary of two heads that differ by padding rows, and the sparse
teacher (:class:`TeacherTopK`, CSR rows of top-k log-probs) that stands in for the teacher's
head. Every check runs before any FLOP and raises ``ValueError`` naming the argument, what was
expected and what was given; under vocab parallelism the ranks fail together.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .checks import (
    INT_DTYPES,
    MASS_SLACK,
    check_flag,
    check_full_precision,
    check_topk_values,
    finite_number,
    fmt_shape,
    optional_positive_float,
)
from .collectives import check_then_agree
from .head import TEACHER_ARGS, HeadCall, check_head_call
from .options import HeadOptions
from .replay import check_csr_ids

__all__ = ["DivergenceCall", "DivergenceOptions", "TeacherTopK", "check_divergence_call"]


class TeacherTopK(NamedTuple):
    """A sparse teacher: its top-k log-probs per label position, in CSR form.

    token_ids: ``[nnz]`` integer global vocabulary ids, position 0's first, then position 1's
        (any order inside a position, no duplicates).
    logprobs: ``[nnz]`` float32 / float64 log-probabilities of those ids under the teacher's
        full distribution (as an inference server returns them; finite, ``<= 0``).
    offsets: ``[N + 1]`` integer CSR row pointers over the ``N = labels.numel()`` label
        positions (row-major): position ``i`` holds entries ``offsets[i]:offsets[i + 1]``.

    The divergence of a position (any ``beta``: forward KL, reverse KL, generalized JSD) is
    taken between the two distributions over its ids plus one tail bucket: the teacher's mass
    outside them, ``1 - Σ exp(logprobs)``, against the student's mass outside them. A position
    with no entry is all tail (divergence 0); one whose ids cover the whole vocabulary has no
    tail.

    Example:
        >>> import torch
        >>> topk = TeacherTopK(
        ...     token_ids=torch.tensor([3, 7, 5]),
        ...     logprobs=torch.tensor([-0.2, -2.0, -0.1]),
        ...     offsets=torch.tensor([0, 2, 2, 3]),  # 3 positions: 2, 0 and 1 entries
        ... )
        >>> topk.offsets.numel() - 1
        3
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    offsets: torch.Tensor


@dataclass(frozen=True)
class DivergenceOptions:
    """What a divergence call asks for beyond the student's head options (the same names and
    meanings as the keyword arguments of :func:`~logitless.linear_divergence`).

    beta: TRL's interpolation: 0 is KL(teacher‖student), 1 is KL(student‖teacher), in between
        the generalized Jensen-Shannon divergence. teacher_softcap / teacher_logit_scale: the
        teacher head's transform (its bias is a tensor argument). vocab_size: the common
        vocabulary of two heads that differ by padding rows (None: the heads' own, which must
        match). with_logprobs: also return the student's log-probs of the labels.
    """

    beta: float = 0.0
    teacher_softcap: float | None = None
    teacher_logit_scale: float | None = None
    vocab_size: int | None = None
    with_logprobs: bool = False

    def __post_init__(self) -> None:
        b = self.beta
        if not finite_number(b) or not 0.0 <= b <= 1.0:
            raise ValueError(
                f"beta must be a float in [0, 1] (0: KL(teacher||student), 1: "
                f"KL(student||teacher), else the generalized JSD), got {b!r}"
            )
        optional_positive_float("teacher_softcap", self.teacher_softcap)
        optional_positive_float("teacher_logit_scale", self.teacher_logit_scale)
        v = self.vocab_size
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"vocab_size must be None or an int >= 1, got {v!r}")
        check_flag("with_logprobs", self.with_logprobs)

    @classmethod
    def pick(cls, values: Mapping[str, object]) -> DivergenceOptions:
        """The options among ``values`` (a public function's arguments by name)."""
        return cls(**{k: values[k] for k in _FIELDS if k in values})


_FIELDS = tuple(f.name for f in dataclasses.fields(DivergenceOptions))


class TopKRows(NamedTuple):
    """A checked sparse teacher over the call's ``N`` label positions, padded to ``K`` slots.

    ids: ``[N, K]`` int64 global ids, ``-1`` in unused slots; logprobs: ``[N, K]`` teacher
    log-probs in the compute dtype, 0 in unused slots; used: ``[N, K]`` bool; log_tail: ``[N]``
    log of the teacher's tail mass ``1 - Σ exp(logprobs)`` (``-inf``: no tail).
    """

    ids: torch.Tensor
    logprobs: torch.Tensor
    used: torch.Tensor
    log_tail: torch.Tensor

    def take(self, idx: torch.Tensor | None) -> TopKRows:
        """Rows ``idx`` (all when None)."""
        return self if idx is None else TopKRows(*(t.index_select(0, idx) for t in self))


@dataclass(frozen=True)
class DivergenceCall:
    """One divergence call, checked.

    student: the student's head call (its options: temperature, softcap, scale, entropy, ...);
    teacher: the teacher's head call over the same labels (None with a sparse teacher), whose
    weight and bias do not require grad; topk: the sparse teacher (None with a head); beta;
    with_logprobs. Both heads hold the common vocabulary (padding rows sliced off).
    """

    student: HeadCall
    teacher: HeadCall | None
    topk: TopKRows | None
    beta: float
    with_logprobs: bool

    @property
    def mode(self) -> str:
        """``"topk"``, ``"forward"`` (beta 0), ``"reverse"`` (beta 1) or ``"jsd"``."""
        if self.topk is not None:
            return "topk"
        return {0.0: "forward", 1.0: "reverse"}.get(float(self.beta), "jsd")


def check_divergence_call(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None,
    teacher: tuple[object, object, object],
    teacher_topk: object,
    options: HeadOptions,
    div: DivergenceOptions,
) -> DivergenceCall:
    """The one check of a divergence call, or ``ValueError``.

    ``teacher``: ``(teacher_hidden, teacher_weight, teacher_bias)`` (all None with
    ``teacher_topk``). The divergence's own rules run first (which teacher, frozen teacher
    tensors, the vocabularies, the backend), then each head's check, then the sparse teacher's
    values. With ``options.vocab_parallel`` each step is collective: every rank joins its
    agreement, so a bad input on one rank raises on all of them.
    """
    vp = options.vocab_parallel

    def own_rules() -> int:
        return _check_divergence_rules(weight, bias, teacher, teacher_topk, options, div)

    vocab = _agreed(own_rules, vp, labels)
    if teacher_topk is not None or vp is not None:  # "auto": the torch tiles run these
        options = dataclasses.replace(options, backend="torch")
    w, b = _prefix(weight, vocab), None if bias is None else _prefix(bias, vocab)
    student = check_head_call(hidden, w, labels, b, options)
    teacher_call = topk = None
    if teacher_topk is None:
        t_hidden, t_weight, t_bias = teacher
        t_options = dataclasses.replace(
            options,
            softcap=div.teacher_softcap,
            logit_scale=div.teacher_logit_scale,
            with_entropy=False,
        )
        t_w = _prefix(t_weight, vocab)
        t_b = None if t_bias is None else _prefix(t_bias, vocab)
        # the same labels and temperature: the student's value checks stand (no second read)
        teacher_call = check_head_call(
            t_hidden, t_w, labels, t_b, t_options, values_of=student, names=TEACHER_ARGS
        )
        if teacher_call.backend != student.backend:  # "auto" on heads of two dtypes
            student = student.replace(backend="torch")
            teacher_call = teacher_call.replace(backend="torch")
    else:

        def check_topk() -> TopKRows:
            rows = _check_topk(teacher_topk, student)
            if div.beta == 1.0:
                _check_reverse_tail(rows, student)
            return rows

        topk = _agreed(check_topk, vp, labels)
    return DivergenceCall(student, teacher_call, topk, float(div.beta), div.with_logprobs)


def _agreed(check, vp, labels):
    """``check()``, collectively under vocab parallelism (every rank raises together)."""
    if vp is None:
        return check()

    def agree(_, error):
        ok = error is None and isinstance(labels, torch.Tensor)
        vp.agree(labels if ok else None, error)

    result, _ = check_then_agree(check, agree)
    return result


def _prefix(t: object, vocab: int | None) -> object:
    """The first ``vocab`` rows of a head's weight or bias (a differentiable view); ``t``
    itself when ``vocab`` is None or ``t`` is not a head tensor (its check says why)."""
    if vocab is None or not isinstance(t, torch.Tensor) or t.dim() < 1 or t.shape[0] <= vocab:
        return t
    return t[:vocab]


def _check_divergence_rules(
    weight, bias, teacher, teacher_topk, options: HeadOptions, div
) -> int | None:
    """Which teacher, frozen teacher tensors, the backend (a sparse teacher and vocab
    parallelism run on the torch tiles alone: any other backend, Triton's, takes a dense
    teacher on one device); returns the common vocabulary (rows of each head used; None: the
    heads as given)."""
    sparse_or_sharded = teacher_topk is not None or options.vocab_parallel
    if options.backend not in ("auto", "torch") and sparse_or_sharded:
        what = "teacher_topk (a sparse teacher)" if teacher_topk is not None else "vocab_parallel"
        raise ValueError(
            f"backend={options.backend!r} runs linear_divergence with a dense teacher on one "
            f"device; {what} runs on the torch tiles: use backend='torch' (or 'auto', which "
            "picks them)"
        )
    if options.capturable:
        raise ValueError("linear_divergence has no capturable mode yet")
    _check_teacher_given(teacher, teacher_topk)
    if teacher_topk is not None and (div.teacher_softcap or div.teacher_logit_scale):
        raise ValueError(
            "teacher_softcap / teacher_logit_scale describe a teacher head; with teacher_topk "
            "the teacher's log-probs are given as they are"
        )
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return _check_vocab_size(None, None, div, options)  # the head check says what is wrong
    t_weight = teacher[1] if teacher_topk is None else None
    t_vocab = t_weight.shape[0] if isinstance(t_weight, torch.Tensor) and t_weight.dim() else None
    vocab = _check_vocab_size(weight.shape[0], t_vocab, div, options)
    if vocab is not None:  # each bias matches its own head before both are cut to vocab rows
        _check_bias_rows("bias", bias, weight.shape[0])
        if t_vocab is not None:
            _check_bias_rows("teacher_bias", teacher[2], t_vocab)
    return vocab


def _check_bias_rows(name: str, bias: object, rows: int) -> None:
    if isinstance(bias, torch.Tensor) and (bias.dim() != 1 or bias.shape[0] != rows):
        raise ValueError(
            f"{name} must be a floating tensor of shape [{rows}] (its head's rows), got "
            f"{fmt_shape(bias)}"
        )


def _check_teacher_given(teacher, teacher_topk) -> None:
    """Either the teacher's hidden states and head, or ``teacher_topk``; its tensors frozen."""
    t_hidden, t_weight, t_bias = teacher
    dense = t_hidden is not None or t_weight is not None or t_bias is not None
    if teacher_topk is not None:
        if dense:
            raise ValueError(
                "give the teacher either as teacher_hidden and teacher_weight (its head) or as "
                "teacher_topk (its top-k log-probs), not both"
            )
        if not isinstance(teacher_topk, TeacherTopK):
            raise ValueError(
                f"teacher_topk must be a logitless.TeacherTopK(token_ids, logprobs, offsets), "
                f"got {type(teacher_topk).__name__}"
            )
        if isinstance(teacher_topk.logprobs, torch.Tensor) and teacher_topk.logprobs.requires_grad:
            raise _frozen_error("teacher_topk.logprobs")
        return
    if t_hidden is None or t_weight is None:
        raise ValueError(
            "linear_divergence needs a teacher: teacher_hidden [..., H_t] and teacher_weight "
            "[V, H_t] (its head), or teacher_topk=logitless.TeacherTopK(...)"
        )
    for name, t in (("teacher_hidden", t_hidden), ("teacher_weight", t_weight)):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            raise _frozen_error(name)
    if isinstance(t_bias, torch.Tensor) and t_bias.requires_grad:
        raise _frozen_error("teacher_bias")


def _frozen_error(name: str) -> ValueError:
    return ValueError(
        f"{name} requires grad, but the teacher is frozen: linear_divergence returns "
        f"gradients for the student only. Pass {name}.detach() (or compute the teacher under "
        "torch.no_grad())"
    )


def _check_vocab_size(
    v_student, v_teacher, div: DivergenceOptions, options: HeadOptions
) -> int | None:
    """The common vocabulary: the heads' own when they match, else ``vocab_size``, which must
    fit in both (their rows beyond it are padding). Under vocab parallelism the shards are of
    the vocab_parallel vocabulary, and ``vocab_size`` may only restate it."""
    vp, given = options.vocab_parallel, div.vocab_size
    if vp is not None:
        if given is not None and given != vp.vocab_size:
            raise ValueError(
                f"with vocab_parallel, vocab_size must be None or the vocab_parallel vocabulary "
                f"({vp.vocab_size}), got {given}: shard the common vocabulary"
            )
        return None
    if v_student is None:
        return None
    heads = [v_student] if v_teacher is None else [v_student, v_teacher]
    if given is None:
        if len(set(heads)) > 1:
            raise ValueError(
                f"the student's head has {v_student} rows and the teacher's {v_teacher}: pass "
                f"vocab_size= (e.g. {min(heads)}) when they differ only by padding rows"
            )
        return v_student
    if given > min(heads):
        which = "student" if v_student < given else "teacher"
        raise ValueError(
            f"vocab_size={given} is larger than the {which}'s head ({min(heads)} rows): it must "
            "be the vocabulary both heads hold (the rows beyond it are padding)"
        )
    return given


def _check_topk(topk: TeacherTopK, student: HeadCall) -> TopKRows:
    """Shapes, dtypes and values of a sparse teacher (host reads), as padded rows."""
    n, device = student.labels.numel(), student.labels.device
    vp = student.vocab_parallel
    vocab = student.weight.shape[0] if vp is None else vp.vocab_size
    ids, lps, offsets = topk.token_ids, topk.logprobs, topk.offsets
    for name, t in (("token_ids", ids), ("offsets", offsets)):
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype not in INT_DTYPES:
            got = f"shape {fmt_shape(t)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"teacher_topk.{name} must be a 1-D integer tensor, got {got}")
    if not isinstance(lps, torch.Tensor) or lps.shape != ids.shape or not lps.is_floating_point():
        got = f"shape {fmt_shape(lps)}" if isinstance(lps, torch.Tensor) else type(lps).__name__
        raise ValueError(
            f"teacher_topk.logprobs must be a floating tensor shaped like token_ids "
            f"[{ids.numel()}], got {got}"
        )
    check_full_precision(**{"teacher_topk.logprobs": lps})
    for name, t in (("token_ids", ids), ("logprobs", lps), ("offsets", offsets)):
        if t.device != device:
            raise ValueError(f"teacher_topk.{name} must be on labels' device {device}")
    if offsets.numel() != n + 1:
        raise ValueError(
            f"teacher_topk.offsets must have labels.numel() + 1 = {n + 1} entries (one CSR row "
            f"per label position, row-major), got {offsets.numel()}"
        )
    ids, offsets = ids.long(), offsets.long()
    check_csr_ids(ids, offsets, vocab, "teacher_topk")
    return _padded_topk(ids, lps.to(student.compute_dtype), offsets, vocab)


def _check_reverse_tail(rows: TopKRows, student: HeadCall) -> None:
    """Beta 1: KL(student‖teacher) over the buckets is infinite at a position whose teacher
    leaves no mass outside its ids (its top-k mass rounds to 1) while the ids miss part of the
    vocabulary, where the student has mass. One host read, on this path only."""
    vp = student.vocab_parallel
    vocab = student.weight.shape[0] if vp is None else vp.vocab_size
    valid = student.labels.reshape(-1) != student.ignore_index
    bad = valid & (rows.log_tail == -math.inf) & (rows.used.sum(1) < vocab)
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0, 0])
        raise ValueError(
            f"teacher_topk with beta=1: KL(student||teacher) is infinite at position {i}, whose "
            f"teacher probabilities sum to 1 (an empty tail bucket) over {int(rows.used[i].sum())}"
            f" of {vocab} ids, while the student has mass outside them; use beta < 1 (the JSD "
            "stays finite) or log-probs whose mass leaves a tail"
        )


def _padded_topk(ids, lps, offsets, vocab: int) -> TopKRows:
    """CSR -> padded :class:`TopKRows`, after the log-prob values' check (one host read)."""
    n = offsets.numel() - 1
    counts = offsets[1:] - offsets[:-1]
    row = torch.repeat_interleave(torch.arange(n, device=ids.device), counts)
    mass = torch.zeros(n, dtype=torch.float64, device=ids.device).index_add_(
        0, row, lps.double().exp()
    )
    bad_lp = ~torch.isfinite(lps) | (lps > MASS_SLACK)
    rule = "finite log-probabilities (<= 0)"
    width = counts.max() if n else counts.sum()
    (width,) = check_topk_values("teacher_topk", lps, bad_lp, mass, rule, width)
    col = torch.arange(ids.numel(), device=ids.device) - offsets[:-1][row]
    pad_ids = torch.full((n, width), -1, dtype=torch.int64, device=ids.device)
    pad_lps = torch.zeros((n, width), dtype=lps.dtype, device=ids.device)
    pad_ids[row, col], pad_lps[row, col] = ids, lps
    return TopKRows(pad_ids, pad_lps, pad_ids >= 0, _log_tail(pad_lps, pad_ids >= 0, counts, vocab))


def _log_tail(lps: torch.Tensor, used: torch.Tensor, counts: torch.Tensor, vocab: int):
    """``[N]`` log of the teacher's tail mass ``1 - Σ exp(lps)``, without cancellation
    (``log(-expm1(logsumexp))``), clamped at 0 mass; ``-inf`` where the ids are the whole
    vocabulary."""
    lse = (
        torch.where(used, lps, -math.inf).logsumexp(1)
        if lps.shape[1]
        else lps.new_full((lps.shape[0],), -math.inf)
    )
    tail = torch.log(-torch.expm1(lse.clamp(max=0)))
    return torch.where(counts >= vocab, -math.inf, tail)
