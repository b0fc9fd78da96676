"""Input checks shared by the fused head op and the reference.

Every check runs before any FLOP and raises ``ValueError`` naming the argument, what was
expected and what was given. Checks on tensor *values* (label range, temperature sign) are
read on the host together with the number of valid rows: one host sync per call, the price of
never returning a silently wrong number (the kernels need that row count anyway).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ._checks import check_full_precision, positive_finite_float
from ._checks import fmt_shape as _fmt_shape
from .kernels.options import resolve_backend

_INT_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)


@dataclass(frozen=True)
class HeadArgs:
    """Normalized arguments of a head call, flattened to rows.

    hidden: [N, H]; labels: [N] int64; temperature: float or [N] fp32 tensor;
    batch_shape: the leading shape of the caller's ``hidden`` (``labels.shape``); num_valid:
    how many labels are not ``ignore_index``; backend: the resolved ``backend=`` choice.
    """

    hidden: torch.Tensor
    weight: torch.Tensor
    labels: torch.Tensor
    bias: torch.Tensor | None
    temperature: float | torch.Tensor
    softcap: float | None
    head_dtype: torch.dtype
    batch_shape: torch.Size
    num_valid: int  # rows whose label is not ignore_index
    backend: str  # "torch" or "triton": the kernels that run the call


def _is_dtensor(t: object) -> bool:
    return type(t).__name__ == "DTensor"


def check_chunk_size(chunk_size: object) -> int | None:
    if chunk_size is None:
        return None
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be None or an int >= 1, got {chunk_size!r}")
    return chunk_size


def check_head_args(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None,
    temperature: float | torch.Tensor,
    softcap: float | None,
    ignore_index: int,
    head_dtype: torch.dtype | None,
    vocab_parallel: object | None = None,
    backend: object = "torch",
) -> HeadArgs:
    """Validate a head call and return its arguments flattened to rows.

    With ``vocab_parallel`` (a :class:`~logitless.parallel.VocabParallel`), ``weight`` and
    ``bias`` are this rank's shard and labels are checked against the global vocabulary.
    Three steps: the tensors themselves, their shapes / dtypes / devices, then the values (the
    one host sync of a call).
    """
    _check_plain_tensors(hidden=hidden, weight=weight, labels=labels, bias=bias)
    label_vocab = _check_layout(
        hidden, weight, labels, bias, temperature, ignore_index, head_dtype, vocab_parallel
    )
    if softcap is not None:
        softcap = positive_finite_float("softcap", softcap)
    resolved = resolve_backend(backend, weight.device, head_dtype or hidden.dtype)
    head_dtype = head_dtype if head_dtype is not None else hidden.dtype
    stats_dtype = torch.float64 if head_dtype == torch.float64 else torch.float32
    temp, num_valid = _check_values(
        labels, temperature, ignore_index, label_vocab, vocab_parallel, stats_dtype
    )
    return HeadArgs(
        hidden=hidden.reshape(-1, weight.shape[1]),
        weight=weight,
        labels=labels.reshape(-1).long(),
        bias=bias,
        temperature=temp,
        softcap=softcap,
        head_dtype=head_dtype,
        batch_shape=labels.shape,
        num_valid=num_valid,
        backend=resolved,
    )


def _check_plain_tensors(**tensors: object) -> None:
    """Every given argument is a plain tensor (not a DTensor: say how to get one)."""
    for name, t in tensors.items():
        if t is None and name == "bias":
            continue
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if _is_dtensor(t):
            if name in ("weight", "bias"):
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


def _check_layout(
    hidden, weight, labels, bias, temperature, ignore_index, head_dtype, vocab_parallel
) -> int:
    """Shapes, dtypes and devices (no value read); returns the label vocabulary size."""
    if hidden.dim() < 1 or not hidden.is_floating_point():
        raise ValueError(
            f"hidden must be a floating tensor of shape [..., H], got dtype {hidden.dtype} "
            f"and shape {_fmt_shape(hidden)}"
        )
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(
            f"weight must be a floating [V, H] tensor, got dtype {weight.dtype} and shape "
            f"{_fmt_shape(weight)}"
        )
    vocab, dim = weight.shape
    label_vocab = vocab if vocab_parallel is None else _check_shard(weight, vocab_parallel)
    if hidden.shape[-1] != dim:
        transposed = ""
        if vocab == hidden.shape[-1]:
            transposed = "; it looks transposed ([H, V]): pass weight.T (nn.Linear(H, V).weight)"
        raise ValueError(
            f"weight must be [V, H] with H = hidden's last dimension ({hidden.shape[-1]}), got "
            f"weight of shape {_fmt_shape(weight)} and hidden of shape {_fmt_shape(hidden)}"
            f"{transposed}"
        )
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(
            f"labels must have shape {list(hidden.shape[:-1])} (hidden's shape without H), "
            f"got {_fmt_shape(labels)}"
        )
    if labels.dtype not in _INT_DTYPES:
        raise ValueError(f"labels must be an integer tensor (int64), got dtype {labels.dtype}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise ValueError(f"ignore_index must be an int, got {ignore_index!r}")
    devices = {t.device for t in (hidden, weight, labels, bias) if t is not None}
    if isinstance(temperature, torch.Tensor):
        devices.add(temperature.device)
    if len(devices) > 1:
        raise ValueError(
            f"hidden, weight, labels, bias and temperature must be on one device, got "
            f"{sorted(str(d) for d in devices)}"
        )
    if hidden.device.type == "meta":
        raise ValueError(
            "hidden, weight and labels are meta tensors: logitless reads label values (range "
            "check, number of valid rows) before any work, which meta tensors do not have. Run "
            "the head on real tensors (with a meta-initialized model: after materializing its "
            "weights)"
        )
    if head_dtype is not None and (
        not isinstance(head_dtype, torch.dtype) or not head_dtype.is_floating_point
    ):
        raise ValueError(f"head_dtype must be None or a floating torch.dtype, got {head_dtype!r}")
    if head_dtype is None and hidden.dtype != weight.dtype:
        raise ValueError(
            f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must share a dtype, or pass "
            "head_dtype= to run the projection in one dtype"
        )
    if bias is not None:
        if bias.shape != (vocab,) or not bias.is_floating_point():
            raise ValueError(
                f"bias must be a floating tensor of shape [{vocab}] (weight's V), got dtype "
                f"{bias.dtype} and shape {_fmt_shape(bias)}"
            )
        if head_dtype is None and bias.dtype != weight.dtype:
            raise ValueError(
                f"bias ({bias.dtype}) and weight ({weight.dtype}) must share a dtype, or pass "
                "head_dtype="
            )
    return label_vocab


def _check_shard(weight: torch.Tensor, vocab_parallel: object) -> int:
    """``weight`` is this rank's shard of ``vocab_parallel``; returns the global vocabulary."""
    from .parallel.vocab import VocabParallel

    if not isinstance(vocab_parallel, VocabParallel):
        raise ValueError(
            f"vocab_parallel must be a logitless.VocabParallel or None, got "
            f"{type(vocab_parallel).__name__}"
        )
    if weight.shape[0] != vocab_parallel.shard_size:
        raise ValueError(
            f"with vocab_parallel, weight must be this rank's shard of "
            f"{vocab_parallel.shard_size} rows (rows [{vocab_parallel.vocab_start}, "
            f"{vocab_parallel.vocab_end}) of {vocab_parallel.vocab_size}), got "
            f"{_fmt_shape(weight)}; slice it with vocab_parallel.shard(full_weight)"
        )
    return vocab_parallel.vocab_size


def _check_values(
    labels: torch.Tensor,
    temperature: float | torch.Tensor,
    ignore_index: int,
    label_vocab: int,
    vocab_parallel: object | None,
    stats_dtype: torch.dtype,
) -> tuple[float | torch.Tensor, int]:
    """Label range and temperature values, read with the valid-row count in one host transfer
    (the one sync of a call). Returns the temperature (float, or ``[N]`` in ``stats_dtype``) and
    the number of valid rows. Labels of every integer dtype are compared as int64 (a Python
    bound would wrap in uint8 / int8 / int16)."""
    flat_labels = labels.reshape(-1).long()
    valid = flat_labels != ignore_index
    bad = valid & ((flat_labels < 0) | (flat_labels >= label_vocab))
    temp: float | torch.Tensor
    bad_temp = None
    if isinstance(temperature, torch.Tensor):
        if not temperature.is_floating_point():
            raise ValueError(f"temperature tensor must be floating, got dtype {temperature.dtype}")
        check_full_precision(temperature=temperature)
        if temperature.requires_grad:
            raise ValueError(
                "temperature must not require grad: logitless treats it as a constant and "
                "returns no gradient for it (detach it first)"
            )
        try:
            torch.broadcast_shapes(temperature.shape, labels.shape)
            temp = temperature.to(stats_dtype).expand(labels.shape).reshape(-1)
        except RuntimeError:
            raise ValueError(
                f"temperature of shape {_fmt_shape(temperature)} is not broadcastable to "
                f"labels' shape {list(labels.shape)}"
            ) from None
        bad_temp = (~(torch.isfinite(temp) & (temp > 0))).sum()
    else:
        temp = positive_finite_float("temperature", temperature)

    counts = [valid.sum(), bad.sum()] + ([] if bad_temp is None else [bad_temp])
    num_valid, n_bad, *rest = torch.stack(counts).tolist() if flat_labels.numel() else [0, 0]
    if n_bad:
        first = flat_labels[bad][0].item()
        where = " (the global vocabulary of vocab_parallel)" if vocab_parallel else ""
        raise ValueError(
            f"labels must be in [0, {label_vocab}){where} or equal "
            f"ignore_index={ignore_index}; {n_bad} label(s) are not, e.g. {first}"
        )
    if rest and rest[0]:
        raise ValueError("temperature must be finite and > 0 everywhere")
    return temp, int(num_valid)


def with_hidden(args: HeadArgs, hidden: object, head_dtype: torch.dtype | None) -> HeadArgs:
    """``args`` (checked on a placeholder of the hidden states, e.g. before a model's backbone
    ran) with the real ``hidden`` in its place, after the checks that concern ``hidden`` alone:
    type, shape, device, dtype. No value check and no host sync: those ran on ``args``.
    ``head_dtype``: the caller's own argument (None: hidden must share the weight's dtype).
    """
    if not isinstance(hidden, torch.Tensor) or _is_dtensor(hidden):
        raise ValueError(f"hidden must be a plain torch.Tensor, got {type(hidden).__name__}")
    dim = args.weight.shape[1]
    if hidden.shape != (*args.batch_shape, dim) or not hidden.is_floating_point():
        raise ValueError(
            f"hidden must be a floating tensor of shape {[*args.batch_shape, dim]}, got dtype "
            f"{hidden.dtype} and shape {_fmt_shape(hidden)}"
        )
    if hidden.device != args.weight.device:
        raise ValueError(f"hidden must be on {args.weight.device}, got {hidden.device}")
    if head_dtype is None and hidden.dtype != args.weight.dtype:
        raise ValueError(
            f"hidden ({hidden.dtype}) and weight ({args.weight.dtype}) must share a dtype, or "
            "pass head_dtype= to run the projection in one dtype"
        )
    return replace(args, hidden=hidden.reshape(-1, dim))


def check_head_call(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    vocab_parallel: object | None,
    **options,
) -> HeadArgs:
    """:func:`check_head_args`, made collective when the head is vocab-parallel (the one
    check of the head contract per call).

    With ``vocab_parallel``, every rank takes part in one agreement all-reduce whether or not
    its own inputs passed, so that a bad input on one rank raises on all of them instead of
    leaving the others waiting in a collective.
    """
    if vocab_parallel is None:
        return check_head_args(hidden, weight, labels, vocab_parallel=None, **options)
    from .parallel.vocab import VocabParallel

    if not isinstance(vocab_parallel, VocabParallel):
        raise ValueError(
            f"vocab_parallel must be a logitless.VocabParallel or None, got "
            f"{type(vocab_parallel).__name__}"
        )
    args, error = None, None
    try:
        args = check_head_args(hidden, weight, labels, vocab_parallel=vocab_parallel, **options)
    except ValueError as e:
        error = e
    vocab_parallel.agree(None if args is None else args.labels, error)
    return args
