"""The head contract: :class:`HeadCall`, the checked call, built by :func:`check_head_call`.

Every public head entry point (the op, the fused loss, the reference, the modules, the HF
integration) turns its arguments into a :class:`~logitless.contract.options.HeadOptions` and a
:class:`~logitless.contract.options.SamplerOptions` and calls :func:`check_head_call` once;
everything below takes the :class:`HeadCall` it returns. Every check runs before any FLOP and
raises ``ValueError`` naming the argument, what was expected and what was given. The checks on
tensor *values* (label range, temperature sign, the sampler's kept sets) are read on the host
together with the number of valid rows: the price of never returning a silently wrong number
(the kernels need that row count anyway).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..transform import LogitTransform, compute_dtype
from .backend import resolve_backend
from .checks import (
    INT_DTYPES,
    check_full_precision,
    check_gathered,
    fmt_shape,
    is_dtensor,
    per_position,
)
from .collectives import check_then_agree
from .options import HeadOptions, SamplerOptions, WeightGradInto
from .replay import ReplayArgs, check_sampler
from .rollout import RolloutRows, check_rollout_topk
from .vocab import VocabParallel


class ArgNames(NamedTuple):
    """The names a call's tensors go by in its error messages: the public arguments they
    were given as (a divergence's teacher head: ``teacher_hidden``, ``teacher_weight``,
    ``teacher_bias``)."""

    hidden: str = "hidden"
    weight: str = "weight"
    bias: str = "bias"


#: The argument names of a head call, and of a divergence's teacher head.
HEAD_ARGS = ArgNames()
TEACHER_ARGS = ArgNames("teacher_hidden", "teacher_weight", "teacher_bias")


@dataclass(frozen=True)
class HeadCall:
    """One head call, checked: its tensors flattened to rows and every option, resolved.

    hidden ``[N, H]``; weight ``[V, H]`` (this rank's shard under vocab parallelism); bias
    ``[V]`` or None; labels ``[N]`` int64 (global ids); temperature ``[N]`` per-row
    temperatures in the compute dtype, or None when it is one scalar (then in ``transform``);
    transform: logit scale, softcap and scalar temperature; head_dtype: the projection's
    dtype; backend: the kernels that run it (``"torch"`` or ``"triton"``); batch_shape: the
    caller's ``labels.shape``; num_valid: rows whose label is not ``ignore_index`` (None in
    the capturable mode, which never reads it); capturable / row_capacity: the capturable mode
    (:class:`~.options.HeadOptions`); batch_invariant: the batch-invariant schedule
    (:class:`~.options.HeadOptions`); replay: the checked sampler (None: no sampling replay);
    weight_grad_into: where the weight's gradient is added instead of returned (checked
    against the weight), or None; rollout: the rollout engine's checked top-k log-probs (the
    rollout-mismatch diagnostics), or None.
    """

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    labels: torch.Tensor
    temperature: torch.Tensor | None
    transform: LogitTransform
    head_dtype: torch.dtype
    with_entropy: bool
    ignore_index: int
    chunk_size: int | None
    vocab_parallel: VocabParallel | None
    backend: str
    batch_shape: torch.Size
    num_valid: int | None
    replay: ReplayArgs | None
    capturable: bool = False
    row_capacity: int | None = None
    batch_invariant: bool = False
    weight_grad_into: WeightGradInto | None = None
    rollout: RolloutRows | None = None

    @property
    def compute_dtype(self) -> torch.dtype:
        return compute_dtype(self.head_dtype)

    @property
    def tracked(self) -> bool:
        """Whether autograd wants a gradient of this call (grad mode on and an input that
        requires one)."""
        tensors = (self.hidden, self.weight, self.bias)
        return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)

    def replace(self, **changes: object) -> HeadCall:
        return dataclasses.replace(self, **changes)


def check_head_call(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None,
    options: HeadOptions,
    sampler: SamplerOptions | None = None,
    *,
    values_of: HeadCall | None = None,
    names: ArgNames = HEAD_ARGS,
) -> HeadCall:
    """The one check of a head call (and of its sampling replay), or ``ValueError``.

    Three steps: the tensors themselves, their shapes / dtypes / devices, then the values (one
    host read). With ``options.vocab_parallel`` ``weight`` and ``bias`` are this rank's shard,
    labels and kept ids are checked against the global vocabulary, and the call is collective:
    every rank joins one agreement whether or not its own inputs passed, so a bad input on one
    rank raises on all of them instead of leaving the others waiting.

    ``values_of``: a call already checked on the same ``labels`` and temperature (a second
    head over the same positions, e.g. a divergence's teacher): its value checks stand, so
    this call reads nothing from the device (its labels must be in its own vocabulary too).
    ``names``: what the error messages call the tensors (the public arguments' names).
    """
    sampler = sampler if sampler is not None else SamplerOptions()

    def check() -> HeadCall:
        return _check(hidden, weight, labels, bias, options, sampler, values_of, names)

    vp = options.vocab_parallel
    if vp is None or options.capturable:  # capturable: no agreement (it reads the device)
        return check()
    call, _ = check_then_agree(check, lambda c, e: vp.agree(None if c is None else c.labels, e))
    return call


def _check(
    hidden, weight, labels, bias, options: HeadOptions, sampler, values_of: HeadCall | None,
    names: ArgNames,
):  # fmt: skip
    given = {names.hidden: hidden, names.weight: weight, "labels": labels, names.bias: bias}
    _check_plain_tensors(given, names)
    label_vocab = _check_layout(hidden, weight, labels, bias, options, names)
    head_dtype = options.head_dtype if options.head_dtype is not None else hidden.dtype
    backend = resolve_backend(options.backend, weight.device, head_dtype)
    if values_of is not None:
        temp, num_valid = _reused_values(values_of, label_vocab, compute_dtype(head_dtype))
    else:
        check = _assert_values if options.capturable else _check_values
        temp, num_valid = check(labels, options, label_vocab, compute_dtype(head_dtype))
    flat = labels.reshape(-1).long()
    if options.capturable and sampler.replaying:
        raise ValueError(
            "sampling replay is not capturable: the kept sets have data-dependent sizes; "
            "use capturable=False with sampling_mask / top_k / top_p / min_p"
        )
    rollout = None
    if sampler.rollout_topk is not None:
        if options.capturable:
            raise ValueError(
                "rollout_topk is not capturable (its checks read the engine's ids and "
                "log-probs on the host): use capturable=False with rollout_topk"
            )
        rollout = check_rollout_topk(sampler.rollout_topk, labels.shape, labels.device, label_vocab)
    scalar_t = None if isinstance(options.temperature, torch.Tensor) else options.temperature
    if scalar_t is not None:
        _check_scalar_temperature(scalar_t, compute_dtype(head_dtype))
    _check_grad_into(options.weight_grad_into, weight, compute_dtype(head_dtype), names, sampler)
    return HeadCall(
        hidden=hidden.reshape(-1, weight.shape[1]),
        weight=weight,
        bias=bias,
        labels=flat,
        temperature=temp,
        transform=LogitTransform(options.logit_scale, options.softcap, scalar_t),
        head_dtype=head_dtype,
        with_entropy=options.with_entropy,
        ignore_index=options.ignore_index,
        chunk_size=options.chunk_size,
        vocab_parallel=options.vocab_parallel,
        backend=backend,
        batch_shape=labels.shape,
        num_valid=num_valid,
        replay=check_sampler(sampler, flat, labels.shape, options.ignore_index, label_vocab),
        capturable=options.capturable,
        row_capacity=options.row_capacity,
        batch_invariant=options.batch_invariant,
        weight_grad_into=options.weight_grad_into,
        rollout=rollout,
    )


def _check_grad_into(
    into: WeightGradInto | None,
    weight: torch.Tensor,
    dtype: torch.dtype,
    names: ArgNames,
    sampler: SamplerOptions,
) -> None:
    """The buffer a weight gradient is added into: the weight's shape and device, the compute
    dtype, one dense block, not the weight itself; not with sampling replay (its backward
    returns the weight gradient its own way)."""
    if into is None:
        return
    buf, w = into.buffer, names.weight
    if buf.shape != weight.shape or buf.dtype != dtype or buf.device != weight.device:
        raise ValueError(
            f"weight_grad_into.buffer must be a {dtype} tensor of {w}'s shape "
            f"{fmt_shape(weight)} on {weight.device} (Megatron's main_grad with fp32 "
            f"gradients), got {buf.dtype} of shape {fmt_shape(buf)} on {buf.device}"
        )
    if not buf.is_contiguous() or buf.requires_grad or buf is weight:
        raise ValueError(
            f"weight_grad_into.buffer must be a contiguous tensor that does not require grad "
            f"and is not {w} itself"
        )
    if sampler.replaying:
        raise ValueError(
            "weight_grad_into is not supported with sampling replay (sampling_mask / top_k / "
            "top_p / min_p): the replay backward returns the weight gradient itself"
        )


def _check_plain_tensors(tensors: dict[str, object], names: ArgNames) -> None:
    """Every given argument is a plain tensor (not a DTensor: say how to get one)."""
    for name, t in tensors.items():
        if t is None and name == names.bias:
            continue
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if is_dtensor(t):
            if name in (names.weight, names.bias):
                advice = (
                    "with FSDP2, call the head inside a sharded module's forward so the weight "
                    "is gathered (logitless.LogprobHead / PolicyLossHead); with tensor "
                    "parallelism, pass this rank's vocab shard (`.to_local()`) together with "
                    "vocab_parallel=logitless.VocabParallel(...). A plain `.to_local()` shard "
                    "alone would be a softmax over part of the vocabulary"
                )
            else:
                advice = "pass this rank's rows as a plain tensor (`.to_local()`)"
            raise ValueError(f"{name} is a DTensor; logitless takes plain tensors: {advice}")
        check_gathered(name, t)


def _check_hidden_against_weight(
    hidden: torch.Tensor, weight: torch.Tensor, names: ArgNames = HEAD_ARGS
) -> None:
    """``hidden [..., H]`` floating, ``weight [V, H]`` (the rule the HF path checks again on
    the backbone's real hidden states)."""
    h, w = names.hidden, names.weight
    if hidden.dim() < 1 or not hidden.is_floating_point():
        raise ValueError(
            f"{h} must be a floating tensor of shape [..., H], got dtype {hidden.dtype} "
            f"and shape {fmt_shape(hidden)}"
        )
    vocab, dim = weight.shape
    if hidden.shape[-1] != dim:
        transposed = ""
        if vocab == hidden.shape[-1]:
            transposed = f"; it looks transposed ([H, V]): pass {w}.T (nn.Linear(H, V).weight)"
        raise ValueError(
            f"{w} must be [V, H] with H = {h}'s last dimension ({hidden.shape[-1]}), got "
            f"{w} of shape {fmt_shape(weight)} and {h} of shape {fmt_shape(hidden)}"
            f"{transposed}"
        )


def _check_dtypes(
    hidden: torch.Tensor, weight: torch.Tensor, options: HeadOptions, names: ArgNames = HEAD_ARGS
) -> None:
    if options.head_dtype is None and hidden.dtype != weight.dtype:
        raise ValueError(
            f"{names.hidden} ({hidden.dtype}) and {names.weight} ({weight.dtype}) must share a "
            "dtype, or pass head_dtype= to run the projection in one dtype"
        )


def _check_layout(hidden, weight, labels, bias, options: HeadOptions, names: ArgNames) -> int:
    """Shapes, dtypes and devices (no value read); returns the label vocabulary size."""
    h, w, b = names
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(
            f"{w} must be a floating [V, H] tensor, got dtype {weight.dtype} and shape "
            f"{fmt_shape(weight)}"
        )
    vp = options.vocab_parallel
    vocab = weight.shape[0]
    label_vocab = vocab if vp is None else _check_shard(weight, vp, w)
    _check_hidden_against_weight(hidden, weight, names)
    if labels.shape != hidden.shape[:-1]:
        if h != "hidden":  # a second head over the call's labels (a teacher): its rows are off
            want = [*labels.shape, weight.shape[1]]
            raise ValueError(
                f"{h} must have one row per label position, shape {want} (labels' shape plus "
                f"its hidden width), got {fmt_shape(hidden)}"
            )
        raise ValueError(
            f"labels must have shape {list(hidden.shape[:-1])} (hidden's shape without H), "
            f"got {fmt_shape(labels)}"
        )
    if labels.dtype not in INT_DTYPES:
        raise ValueError(f"labels must be an integer tensor (int64), got dtype {labels.dtype}")
    devices = {t.device for t in (hidden, weight, labels, bias) if t is not None}
    if isinstance(options.temperature, torch.Tensor):
        devices.add(options.temperature.device)
    if len(devices) > 1:
        raise ValueError(
            f"{h}, {w}, labels, {b} and temperature must be on one device, got "
            f"{sorted(str(d) for d in devices)}"
        )
    if hidden.device.type == "meta":
        raise ValueError(
            f"{h}, {w} and labels are meta tensors: logitless reads label values (range "
            "check, number of valid rows) before any work, which meta tensors do not have. Run "
            "the head on real tensors (with a meta-initialized model: after materializing its "
            "weights)"
        )
    _check_dtypes(hidden, weight, options, names)
    if bias is not None:
        if bias.shape != (vocab,) or not bias.is_floating_point():
            raise ValueError(
                f"{b} must be a floating tensor of shape [{vocab}] ({w}'s V), got dtype "
                f"{bias.dtype} and shape {fmt_shape(bias)}"
            )
        if options.head_dtype is None and bias.dtype != weight.dtype:
            raise ValueError(
                f"{b} ({bias.dtype}) and {w} ({weight.dtype}) must share a dtype, or pass "
                "head_dtype="
            )
    return label_vocab


def _check_shard(weight: torch.Tensor, vp: VocabParallel, name: str = "weight") -> int:
    """``weight`` is this rank's shard of ``vp``; returns the global vocabulary."""
    if weight.shape[0] != vp.shard_size:
        raise ValueError(
            f"with vocab_parallel, {name} must be this rank's shard of {vp.shard_size} rows "
            f"(rows [{vp.vocab_start}, {vp.vocab_end}) of {vp.vocab_size}), got "
            f"{fmt_shape(weight)}; slice it with vocab_parallel.shard(full_weight)"
        )
    return vp.vocab_size


def _temperature_rows(labels, options: HeadOptions, stats_dtype) -> torch.Tensor | None:
    """The per-row temperatures ``[N]`` in ``stats_dtype`` (None for a scalar), after the
    checks that need no value."""
    t = options.temperature
    if not isinstance(t, torch.Tensor):
        return None
    if not t.is_floating_point():
        raise ValueError(f"temperature tensor must be floating, got dtype {t.dtype}")
    check_full_precision(temperature=t)
    return per_position("temperature", t, labels.shape, labels.device, integer=False).to(
        stats_dtype
    )


def _label_message(options: HeadOptions, label_vocab: int) -> str:
    where = " (the global vocabulary of vocab_parallel)" if options.vocab_parallel else ""
    return (
        f"labels must be in [0, {label_vocab}){where} or equal ignore_index={options.ignore_index}"
    )


_TEMPERATURE_MESSAGE = (
    "temperature must be finite and > 0 everywhere, and no smaller than the reciprocal of the "
    "largest number of the logits' compute dtype (the logits are divided by it)"
)


def _check_scalar_temperature(t: float, stats_dtype: torch.dtype) -> None:
    """A scalar temperature whose reciprocal overflows the compute dtype (logits / t would be
    infinite): refused. Smaller-than-usual ones that do not overflow are the exact
    distribution at that temperature (docs/head.md, "Temperature")."""
    if 1.0 / t > torch.finfo(stats_dtype).max:
        raise ValueError(f"{_TEMPERATURE_MESSAGE}: got {t!r} for {stats_dtype} logits")


def _label_flags(labels: torch.Tensor, options: HeadOptions, label_vocab: int):
    """``[N]`` int64 labels, and where they are valid (not ``ignore_index``) and out of
    ``[0, label_vocab)`` though valid."""
    flat = labels.reshape(-1).long()
    valid = flat != options.ignore_index
    return flat, valid, valid & ((flat < 0) | (flat >= label_vocab))


def _good_temperature(temp: torch.Tensor) -> torch.Tensor:
    return torch.isfinite(temp) & (temp > 0) & torch.isfinite(temp.reciprocal())


def _assert_values(
    labels: torch.Tensor, options: HeadOptions, label_vocab: int, stats_dtype: torch.dtype
) -> tuple[torch.Tensor | None, None]:
    """The capturable mode's value checks: device-side assertions with the messages of
    :func:`_check_values` (a ``RuntimeError`` on CPU, a device-side assert on CUDA), no host
    read; the number of valid rows stays unknown (None)."""
    _, _, bad = _label_flags(labels, options, label_vocab)
    torch._assert_async(~bad.any(), _label_message(options, label_vocab))
    temp = _temperature_rows(labels, options, stats_dtype)
    if temp is not None:
        torch._assert_async(_good_temperature(temp).all(), _TEMPERATURE_MESSAGE)
    return temp, None


def _check_values(
    labels: torch.Tensor, options: HeadOptions, label_vocab: int, stats_dtype: torch.dtype
) -> tuple[torch.Tensor | None, int]:
    """Label range and temperature values, read with the valid-row count in one host transfer
    (the one sync of a call). Returns the per-row temperature (``[N]`` in ``stats_dtype``, or
    None for a scalar) and the number of valid rows. Labels of every integer dtype are compared
    as int64 (a Python bound would wrap in uint8 / int8 / int16)."""
    flat, valid, bad = _label_flags(labels, options, label_vocab)
    counts = [valid.sum(), bad.sum()]
    temp = _temperature_rows(labels, options, stats_dtype)
    if temp is not None:
        counts.append((~_good_temperature(temp)).sum())
    num_valid, n_bad, *rest = torch.stack(counts).tolist() if flat.numel() else [0, 0]
    if n_bad:
        first = flat[bad][0].item()
        raise ValueError(
            f"{_label_message(options, label_vocab)}; {n_bad} label(s) are not, e.g. {first}"
        )
    if rest and rest[0]:
        raise ValueError(_TEMPERATURE_MESSAGE)
    return temp, int(num_valid)


def _reused_values(checked: HeadCall, label_vocab: int, stats_dtype: torch.dtype):
    """The per-row temperature (in ``stats_dtype``) and valid-row count of a call already
    checked on the same labels, whose label vocabulary must not exceed this head's."""
    vp = checked.vocab_parallel
    checked_vocab = checked.weight.shape[0] if vp is None else vp.vocab_size
    if checked_vocab > label_vocab:
        raise ValueError(
            f"the heads' label vocabularies differ: {checked_vocab} checked, this head has "
            f"{label_vocab} rows"
        )
    temp = checked.temperature
    return (None if temp is None else temp.to(stats_dtype)), checked.num_valid


def with_hidden(call: HeadCall, hidden: object, options: HeadOptions) -> HeadCall:
    """``call`` (checked on a placeholder of the hidden states, e.g. before a model's backbone
    ran) with the real ``hidden`` in its place, after the checks that concern ``hidden`` alone:
    type, shape, device, dtype; and that the call's weight and bias (the real parameters, put
    in place of stand-ins) are not a ZeRO-3 partition. No value check and no host sync: those
    ran on ``call``.
    ``options``: the call's options (``head_dtype=None``: hidden must share the weight's dtype).
    """
    if not isinstance(hidden, torch.Tensor) or is_dtensor(hidden):
        raise ValueError(f"hidden must be a plain torch.Tensor, got {type(hidden).__name__}")
    check_gathered(HEAD_ARGS.weight, call.weight)  # the real weight replaced a stand-in
    check_gathered(HEAD_ARGS.bias, call.bias)
    dim = call.weight.shape[1]
    if hidden.shape != (*call.batch_shape, dim) or not hidden.is_floating_point():
        raise ValueError(
            f"hidden must be a floating tensor of shape {[*call.batch_shape, dim]}, got dtype "
            f"{hidden.dtype} and shape {fmt_shape(hidden)}"
        )
    if hidden.device != call.weight.device:
        raise ValueError(f"hidden must be on {call.weight.device}, got {hidden.device}")
    _check_dtypes(hidden, call.weight, options)
    return call.replace(hidden=hidden.reshape(-1, dim))
