"""The options of a head call, declared once: :class:`HeadOptions` and :class:`SamplerOptions`.

Every public entry point (the op, the fused loss, the reference, the module forms, the HF and
TRL integrations) builds these two objects from its keyword arguments, or stores them (the
modules), and hands them to :func:`~logitless.contract.head.check_head_call`; nothing below
re-lists an option. Their scalar values are checked here, when the object is made (a module
refuses a bad option at construction); tensor-valued options (a per-token temperature, a
sampling mask, per-token sampler parameters) are checked with the call's tensors.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Concatenate, Literal, ParamSpec, TypedDict, TypeVar

import torch

from .checks import (
    check_flag,
    check_optional_int,
    optional_positive_float,
    positive_finite_float,
)
from .sampling import RolloutTopK, SamplingMask
from .vocab import VocabParallel

Backend = Literal["auto", "triton", "torch"]

#: The label of a position without a target (PyTorch's and transformers' convention): the
#: default ``ignore_index`` of every entry point, and the label the integrations write.
IGNORE_INDEX: int = -100

_P = ParamSpec("_P")
_R = TypeVar("_R")


def given_arguments(
    fn: Callable[Concatenate[Mapping[str, Any], _P], _R],
) -> Callable[_P, _R]:
    """A public entry point that reads its options by name: ``fn(given, /, ...)`` is called
    with ``given``, every argument of the call by parameter name (defaults filled in), before
    its own arguments; the function it returns has ``fn``'s signature without ``given``.

    This is what :meth:`HeadOptions.pick` and its kin read. It replaces ``locals()``, which
    ``torch.compile`` cannot trace before torch 2.13 (``Signature.bind`` it can), so the entry
    points compile whole on every supported torch.
    """
    signature = inspect.signature(fn)
    public = signature.replace(parameters=list(signature.parameters.values())[1:])
    return _bound_to(public, fn, lambda given, args, kwargs: fn(given, *args, **kwargs))


def arguments_like(
    source: Callable[_P, _R], *, without: tuple[str, ...] = ()
) -> Callable[[Callable[[Mapping[str, Any]], _R]], Callable[_P, _R]]:
    """A second entry point taking ``source``'s arguments, less the parameters ``without``
    (options only ``source`` has): the decorated ``impl(given)`` is called with every argument
    by name (defaults filled in), and the function it returns has ``source``'s signature less
    ``without``, so the options are declared once, in ``source``. An argument among
    ``without`` raises ``TypeError`` as any unknown keyword does."""
    signature = inspect.signature(source)
    unknown = sorted(set(without) - set(signature.parameters))
    if unknown:
        raise ValueError(f"{source.__name__} has no parameters {unknown}")
    kept = [p for name, p in signature.parameters.items() if name not in without]
    public = signature.replace(parameters=kept)

    def wrap(impl: Callable[[Mapping[str, Any]], _R]) -> Callable[_P, _R]:
        return _bound_to(public, impl, lambda given, args, kwargs: impl(given))

    return wrap


def _bound_to(
    public: inspect.Signature,
    wrapped: Callable[..., _R],
    run: Callable[[Mapping[str, Any], tuple[Any, ...], dict[str, Any]], _R],
) -> Callable[..., _R]:
    """A function with signature ``public`` (and ``wrapped``'s name and docstring) that binds
    each call's arguments to it, fills in the defaults and hands ``run`` the arguments by name
    with the call's own ``args`` and ``kwargs``: a bad call raises ``TypeError`` as Python
    would."""

    @functools.wraps(wrapped)
    def call(*args: Any, **kwargs: Any) -> _R:
        bound = public.bind(*args, **kwargs)
        bound.apply_defaults()
        return run(bound.arguments, args, kwargs)

    call.__signature__ = public  # type: ignore[attr-defined]
    return call


@dataclass(frozen=True, eq=False)
class WeightGradInto:
    """Gradient-accumulation fusion: the weight's gradient is added into ``buffer`` instead of
    being returned to autograd (Megatron DDP's ``param.main_grad``).

    buffer: ``[V, H]`` like the weight (this rank's shard under vocab parallelism), on its
        device, in the compute dtype (fp32 for fp32 / bf16 / fp16 heads): each backward adds
        the weight gradient into it, in that dtype; the weight itself gets no gradient from
        the call (autograd sees None). The log-prob op adds tile by tile (no ``[V, H]``
        gradient exists); the fused loss, whose gradient is taken before the loss's upstream
        gradient is known, keeps its weight gradient in an fp32 scratch until ``backward()``
        and adds it then, scaled.
    on_added: called after each add, once per backward (Megatron: mark the parameter
        ``grad_added_to_main_grad`` for DDP's hook), or None.
    """

    buffer: torch.Tensor
    on_added: Callable[[], None] | None = None

    def added(self) -> None:
        if self.on_added is not None:
            self.on_added()


def _check_backend_name(backend: object) -> None:
    from .backend import BACKENDS

    names = ("auto", *BACKENDS)
    if not isinstance(backend, str) or backend not in names:
        raise ValueError(f"backend must be one of {names}, got {backend!r}")


@dataclass(frozen=True)
class HeadOptions:
    """Everything a head call asks for besides its tensors (the same names and meanings as the
    keyword arguments of :func:`~logitless.linear_logprobs`).

    temperature: float, or a per-token tensor broadcastable to the labels (no gradient).
    softcap: final-logit soft-capping constant ``c`` (``c·tanh(z / c)``), or None.
    logit_scale: a constant the logits are multiplied by after the bias, before softcap and
        temperature (Cohere's ``logit_scale``; Granite's ``1 / logits_scaling``), or None.
    with_entropy: also compute the entropy of each row.
    ignore_index: the label of rows to skip.
    chunk_size: rows per pass (None: the backend's choice).
    head_dtype: the projection's dtype (None: the inputs').
    vocab_parallel: the head's vocabulary shard, or None.
    backend: ``"auto"``, ``"torch"`` or ``"triton"``.
    capturable: no host read and shapes that depend only on the input shapes (CUDA graphs,
        ``torch.compile(fullgraph=True)``): every row is projected and the ignored ones masked,
        value checks become device-side assertions (docs/capturable.md).
    row_capacity: with ``capturable``, project only this many rows: the valid rows, gathered
        in order (more valid rows than this is a device-side error). None: every row.
    batch_invariant: each token's results are the same bits whatever else is in the call (how
        many rows, their values and order, how many are ignored, the caller's chunking, with or
        without gradients; the fused loss runs the log-prob op's forward): fixed row blocks and
        a tile width from the vocabulary and device alone (docs/head.md, "Batch invariance").
    weight_grad_into: a :class:`WeightGradInto` (the weight's gradient added into a
        caller's buffer instead of returned), or None.
    """

    temperature: float | torch.Tensor = 1.0
    softcap: float | None = None
    logit_scale: float | None = None
    with_entropy: bool = False
    ignore_index: int = IGNORE_INDEX
    chunk_size: int | None = None
    head_dtype: torch.dtype | None = None
    vocab_parallel: VocabParallel | None = None
    backend: Backend = "auto"
    capturable: bool = False
    row_capacity: int | None = None
    batch_invariant: bool = False
    weight_grad_into: WeightGradInto | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, torch.Tensor):
            positive_finite_float("temperature", self.temperature)
        optional_positive_float("softcap", self.softcap)
        optional_positive_float("logit_scale", self.logit_scale)
        check_flag("with_entropy", self.with_entropy)
        if isinstance(self.ignore_index, bool) or not isinstance(self.ignore_index, int):
            raise ValueError(f"ignore_index must be an int, got {self.ignore_index!r}")
        check_optional_int("chunk_size", self.chunk_size, minimum=1)
        dt = self.head_dtype
        if dt is not None and (not isinstance(dt, torch.dtype) or not dt.is_floating_point):
            raise ValueError(f"head_dtype must be None or a floating torch.dtype, got {dt!r}")
        if self.vocab_parallel is not None and not isinstance(self.vocab_parallel, VocabParallel):
            raise ValueError(
                f"vocab_parallel must be a logitless.VocabParallel or None, got "
                f"{type(self.vocab_parallel).__name__}"
            )
        _check_backend_name(self.backend)
        check_flag("capturable", self.capturable)
        check_optional_int("row_capacity", self.row_capacity, minimum=1)
        check_flag("batch_invariant", self.batch_invariant)
        into = self.weight_grad_into
        if into is not None and not (
            isinstance(into, WeightGradInto) and isinstance(into.buffer, torch.Tensor)
        ):
            raise ValueError(
                f"weight_grad_into must be a logitless.contract.options.WeightGradInto holding "
                f"a tensor, or None, got {type(into).__name__}"
            )
        if self.row_capacity is not None and not self.capturable:
            raise ValueError(
                "row_capacity needs capturable=True (the default mode selects the valid rows "
                "exactly, reading their number on the host)"
            )

    @classmethod
    def pick(cls, values: Mapping[str, object]) -> HeadOptions:
        """The options among ``values`` (a public function's arguments by name,
        :func:`given_arguments`: its signature declares them under these names), the others
        left at their defaults."""
        return _pick(cls, values)

    def replace(self, **changes: object) -> HeadOptions:
        """A copy with ``changes`` (checked again); None values are left out, so a per-call
        ``temperature=None`` keeps the stored one."""
        given = {k: v for k, v in changes.items() if v is not None}
        return dataclasses.replace(self, **given) if given else self

    def describe(self) -> str:
        """``name=value`` pairs for a module's ``extra_repr`` (options left at None omitted)."""
        shown = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            text = f"tensor{list(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)
            shown.append(f"{f.name}={text}")
        return ", ".join(shown)


@dataclass(frozen=True)
class SamplerOptions:
    """What the rollout engine reports of its sampling (the same names and meanings as the
    keyword arguments of :func:`~logitless.linear_logprobs`): its kept sets, for sampling
    replay (all None: no replay), and its top-k log-probs, for the rollout-mismatch
    diagnostics.

    sampling_mask: the engine's kept ids (a :class:`~logitless.SamplingMask`, or padded
        ``[*labels.shape, K]`` ids), or None.
    top_k, top_p, min_p: the sampler's parameters (a number, or a per-token tensor), replayed on
        the trainer's logits; not together with ``sampling_mask``.
    with_kept_mass: also report ``log_kept_mass``.
    rollout_topk: the engine's top-k log-probs per position (a
        :class:`~logitless.RolloutTopK`, checked with the call's tensors), or None: the call
        then also reports the trainer's distribution against the engine's
        (docs/rollout-mismatch.md).
    """

    sampling_mask: SamplingMask | torch.Tensor | None = None
    top_k: int | torch.Tensor | None = None
    top_p: float | torch.Tensor | None = None
    min_p: float | torch.Tensor | None = None
    with_kept_mass: bool = False
    rollout_topk: RolloutTopK | None = None

    def __post_init__(self) -> None:
        check_flag("with_kept_mass", self.with_kept_mass)
        given = [k for k in ("top_k", "top_p", "min_p") if getattr(self, k) is not None]
        if self.sampling_mask is not None and given:
            raise ValueError(
                f"give sampling_mask or the sampler's parameters ({', '.join(given)}), not "
                "both: a mask is the kept set itself; top_k / top_p / min_p replay the sampler "
                "to find it"
            )
        k, p, mp = self.top_k, self.top_p, self.min_p
        if k is not None and not isinstance(k, torch.Tensor):
            if isinstance(k, bool) or not isinstance(k, int):
                raise ValueError(f"top_k must be an int or an integer tensor, got {k!r}")
            if k < 1:
                raise ValueError(
                    f"top_k must be >= 1 (use a value >= the vocabulary size for no top-k), got {k}"
                )
        if _scalar(p) and (not _number(p) or not 0 < p <= 1):
            raise ValueError(f"top_p must be in (0, 1] (1: no top-p), got {p!r}")
        if _scalar(mp) and (not _number(mp) or not 0 <= mp < 1):
            raise ValueError(f"min_p must be in [0, 1) (0: no min-p), got {mp!r}")

    @classmethod
    def pick(cls, values: Mapping[str, object]) -> SamplerOptions:
        """The sampler options among ``values`` (see :meth:`HeadOptions.pick`)."""
        return _pick(cls, values)

    @property
    def replaying(self) -> bool:
        """Whether a kept set is given (a mask) or replayed (a sampler parameter)."""
        return any(v is not None for v in (self.sampling_mask, self.top_k, self.top_p, self.min_p))

    def for_call(self, owner: str, given: Mapping[str, object]) -> SamplerOptions:
        """The options of one call of a module that stores these; ``given``: the call's own
        sampler arguments (:class:`SamplerCallKwargs`; None: not given), any other name a
        ``TypeError`` of ``owner``'s forward, as Python would raise. A per-call
        ``sampling_mask`` replaces the stored parameters, a per-call ``top_k`` / ``top_p`` /
        ``min_p`` overrides its own; ``with_kept_mass`` applies when the call replays."""
        unknown = sorted(set(given) - set(SamplerCallKwargs.__annotations__))
        if unknown:
            raise TypeError(f"{owner}.forward() got an unexpected keyword argument {unknown[0]!r}")
        mask, topk = given.get("sampling_mask"), given.get("rollout_topk")
        if mask is not None:
            return SamplerOptions(
                sampling_mask=mask, with_kept_mass=self.with_kept_mass, rollout_topk=topk
            )
        params = {}
        for name in ("top_k", "top_p", "min_p"):
            value = given.get(name)
            params[name] = getattr(self, name) if value is None else value
        out = SamplerOptions(**params, rollout_topk=topk)
        return dataclasses.replace(out, with_kept_mass=self.with_kept_mass and out.replaying)

    def describe(self) -> str:
        """``, name=value`` pairs of the settings that are set, for ``extra_repr``."""
        out = ""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None or value is False or f.name == "rollout_topk":
                continue
            shown = f"tensor{list(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)
            out += f", {f.name}={shown}"
        return out


def _pick(cls, values: Mapping[str, object]):
    return cls(**{k: values[k] for k in _FIELD_NAMES[cls] if k in values})


class HeadKwargs(TypedDict, total=False):
    """The options a module form stores (:class:`HeadOptions` and the sampler's settings of
    :class:`SamplerOptions`), as keyword arguments: its constructor's ``**options``."""

    temperature: float
    softcap: float | None
    logit_scale: float | None
    with_entropy: bool
    ignore_index: int
    chunk_size: int | None
    head_dtype: torch.dtype | None
    vocab_parallel: VocabParallel | None
    backend: Backend
    capturable: bool
    row_capacity: int | None
    batch_invariant: bool
    top_k: int | None
    top_p: float | None
    min_p: float | None
    with_kept_mass: bool


class SamplerCallKwargs(TypedDict, total=False):
    """The sampler arguments one call of a module form may give (its ``forward``'s
    ``**sampler``; :meth:`SamplerOptions.for_call` reads them): a per-call sampling mask, or
    per-call ``top_k`` / ``top_p`` / ``min_p`` (a scalar, or a tensor per row), and the
    engine's top-k log-probs of the call's positions (``rollout_topk``)."""

    sampling_mask: SamplingMask | torch.Tensor | None
    top_k: int | torch.Tensor | None
    top_p: float | torch.Tensor | None
    min_p: float | torch.Tensor | None
    rollout_topk: RolloutTopK | None


def stored_options(owner: str, options: Mapping[str, object]) -> tuple[HeadOptions, SamplerOptions]:
    """A module's ``**options`` (:class:`HeadKwargs`) as the two option objects; an unknown
    name raises ``TypeError`` as Python would."""
    unknown = sorted(set(options) - set(HeadKwargs.__annotations__))
    if unknown:
        raise TypeError(f"{owner}() got an unexpected keyword argument {unknown[0]!r}")
    return HeadOptions.pick(options), SamplerOptions.pick(options)


def _scalar(v: object) -> bool:
    """Given, and not a tensor (tensors are checked with the call's tensors)."""
    return v is not None and not isinstance(v, torch.Tensor)


def _number(v: object) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and not math.isnan(v)


# Field names, read once (dataclasses.fields() inside a call would break torch.compile's trace).
_FIELD_NAMES = {
    cls: tuple(f.name for f in dataclasses.fields(cls)) for cls in (HeadOptions, SamplerOptions)
}
