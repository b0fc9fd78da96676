"""TRL's ``GRPOTrainer`` on logitless: the same training, without the ``[tokens, vocab]`` logits.

Switching is one line::

    from logitless.integrations.trl import LogitlessGRPOTrainer as GRPOTrainer

(``LogitlessDistillationTrainer``, TRL's ``DistillationTrainer`` on logitless, is described in
:mod:`logitless.integrations.trl.distillation`.)

``LogitlessGRPOTrainer`` is a ``trl.GRPOTrainer`` whose two log-prob paths run on logitless
(a trainer subclass of your own gets the same from :class:`LogitlessGRPOMixin`):

- the no-grad log-probs of the policy (``old_per_token_logps``) and of the reference model,
  computed when completions are scored: :func:`logitless.integrations.hf.causal_lm_logprobs`;
- the loss: the model's backbone once (``model.model``, as
  :func:`logitless.integrations.hf.causal_lm_hidden_states` runs it), a no-grad head pass on
  those hidden states for the current log-probs and entropies (TRL's metrics, its top-entropy
  mask and, on-policy, the old log-probs: no second backbone forward), then
  :func:`logitless.fused_policy_loss` with the :class:`~logitless.PolicyLossConfig` equivalent
  to the trainer's TRL options (:func:`grpo_loss_config`) and the normalization TRL uses.

Generation, rewards, advantages, logging and the optimizer loop stay TRL's; the trainer logs
the metric names TRL logs (``kl``, ``entropy``, ``clip_ratio/*``, ``cispo_clip_ratio``,
``policy_loss``, ``entropy_coef``). No model code is patched.

**Layout.** TRL's per-token tensors are ``[B, C]`` over the completion; logitless' HF
integration aligns ``[B, P + C]`` like the logits, position ``t`` scoring token ``t + 1``. So
TRL column ``j`` is logitless column ``P - 1 + j`` (``P``: the padded prompt length).

**Normalization** (train mode; ``GA`` gradient-accumulation steps, ``SPG``
``steps_per_generation``, ``P`` processes, ``B`` rows of the micro-batch): ``grpo``/``sapo``
average each row's token mean over ``B · GA`` rows, ``luspo`` its token sum, ``dr_grpo`` divides
the token sum by ``B · GA · max_completion_length``; ``bnpo`` by the micro-batch's tokens
``· GA``; ``dapo``/``cispo`` by ``num_items_in_batch / P · GA / SPG`` (the generation batch's
tokens, per accumulation window). The entropy bonus is always a token mean of the micro-batch
divided by ``GA``. In eval mode ``GA = SPG = 1``.

**Several processes, LoRA, MoE.** The backbone, the head and the loss run inside the wrapped
model's forward (:func:`logitless.integrations.hf.run_in_forward`), so DDP averages the
gradients and FSDP2 gathers and reduce-scatters the parameters as for ``model(...)``; a PEFT
LoRA policy trains its adapters (the reference log-probs with the adapter disabled, as TRL
does); an MoE policy gets TRL's router load-balancing loss from the same backbone call.

**Vision-language models** (the classes :mod:`logitless.integrations.hf` audits: Qwen2-VL,
Qwen2.5-VL, Qwen3-VL and its MoE, Gemma-3, LLaVA): the batch's image inputs (``pixel_values``,
``image_grid_thw``, ``image_sizes``, the type ids) go to the backbone by their own names, sliced
per row as TRL slices them when it scores in chunks (``num_images`` per row); the model's own
multimodal rope positions come from ``mm_token_type_ids``, as in TRL's forward.

**Not supported** (raised by name before training starts, see :func:`check_trainer`): the
``vespo`` loss, ``top_entropy_quantile < 1`` together with an entropy bonus, adaptive entropy
control, ``cast_lm_head_to_fp32``, models outside
:data:`logitless.integrations.hf.SUPPORTED_MODELS` (and the image inputs of the
vision-language classes they include: ``pixel_attention_mask``, ``spatial_shapes``,
``num_tiles``, ``image_position_ids``), FSDP1, DeepSpeed's parameter or optimizer offload and
ZeRO++ partitions (DeepSpeed ZeRO stages 0-3 run: docs/trl.md), ``delta < 1 + epsilon_high``
and ``cispo`` with ``epsilon_high < 1``.

Tested with TRL 1.16 (``pip install -e '.[trl]'`` in a logitless checkout installs it).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, NamedTuple

import torch
from torch import nn

from ...contract.checks import check_flag, check_optional_int
from ...contract.options import HeadOptions, SamplerOptions
from ...contract.rollout import RolloutTopK
from ...losses import LossNormalizer, PolicyLossConfig, rollout_mismatch_metrics
from ...types import RolloutMismatch
from .. import hf, seam
from ..hf import model as hf_model
from ..hf import vlm as hf_vlm
from ..seam import Head, LossInputs, Prepared, Tokens
from . import rollout as trl_rollout
from .common import CompletionLayout, completion_batch, distributed_problem

try:
    import trl
    from trl import GRPOConfig, GRPOTrainer
    from trl.trainer.utils import nanmax, nanmin
except ImportError as e:  # pragma: no cover - exercised only without TRL
    raise ImportError(
        "logitless.integrations.trl needs TRL: pip install -e '.[trl]' in a logitless checkout"
    ) from e

__all__ = [
    "TESTED_TRL",
    "LogitlessGRPOMixin",
    "LogitlessGRPOTrainer",
    "check_trainer",
    "grpo_loss_config",
]

#: The TRL releases the parity tests run against (``>= low, < high``).
TESTED_TRL = ("1.16", "1.17")

# TRL loss_type -> logitless aggregation (the policy term; the entropy bonus is a token mean)
_AGGREGATIONS = {
    "grpo": "seq_mean_token_mean",
    "sapo": "seq_mean_token_mean",
    "bnpo": "token_mean",
    "dapo": "token_mean",
    "cispo": "token_mean",
    "dr_grpo": "seq_mean_token_sum_norm",
    "luspo": "seq_mean_token_sum",
}
# loss types whose loss TRL divides by the accumulation steps (the others: by num_items_in_batch)
_PER_STEP = ("grpo", "sapo", "bnpo", "dr_grpo", "luspo")
_PPO_FAMILY = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
# an open upper bound of an IS weight or band (TRL's clip_max=None): the largest fp32 number
_NO_BOUND = float(torch.finfo(torch.float32).max)


def _version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(p) for p in v.split(".")[:2] if p.isdigit())


if (
    not _version_tuple(TESTED_TRL[0])
    <= _version_tuple(trl.__version__)
    < _version_tuple(TESTED_TRL[1])
):
    warnings.warn(
        f"logitless.integrations.trl is tested with trl>={TESTED_TRL[0]},<{TESTED_TRL[1]}; "
        f"trl {trl.__version__} is installed. Its loss code may differ: check the parity tests "
        "(tests/test_trl.py) against this version.",
        stacklevel=2,
    )


class _Options(NamedTuple):
    """The TRL options the loss reads, as ``GRPOTrainer._compute_loss`` reads them."""

    loss_type: str
    importance_sampling_level: str
    epsilon_low: float
    epsilon_high: float
    delta: float | None
    beta: float
    use_bias_correction_kl: bool
    sapo_temperature_pos: float
    sapo_temperature_neg: float
    max_completion_length: int | None
    temperature: float
    top_entropy_quantile: float
    entropy_coef: float
    use_adaptive_entropy: bool
    use_vllm: bool
    vllm_importance_sampling_correction: bool
    vllm_importance_sampling_mode: str
    vllm_importance_sampling_clip_min: float | None
    vllm_importance_sampling_clip_max: float | None

    @classmethod
    def of(cls, source: GRPOTrainer | GRPOConfig) -> _Options:
        if isinstance(source, GRPOConfig):  # as GRPOTrainer.__init__ derives them
            args, live = source, source
            eps_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
            eps_low = args.epsilon
        else:  # the trainer's attributes, which its loss reads (and a caller may change)
            args, live = source.args, source
            eps_low, eps_high = source.epsilon_low, source.epsilon_high
        return cls(
            loss_type=live.loss_type,
            importance_sampling_level=live.importance_sampling_level,
            epsilon_low=eps_low,
            epsilon_high=eps_high,
            delta=args.delta,
            beta=live.beta,
            use_bias_correction_kl=args.use_bias_correction_kl,
            sapo_temperature_pos=args.sapo_temperature_pos,
            sapo_temperature_neg=args.sapo_temperature_neg,
            max_completion_length=live.max_completion_length,
            temperature=live.temperature,
            top_entropy_quantile=live.top_entropy_quantile,
            entropy_coef=live.entropy_coef,
            use_adaptive_entropy=live.use_adaptive_entropy,
            use_vllm=live.use_vllm,
            vllm_importance_sampling_correction=live.vllm_importance_sampling_correction,
            vllm_importance_sampling_mode=live.vllm_importance_sampling_mode,
            vllm_importance_sampling_clip_min=live.vllm_importance_sampling_clip_min,
            vllm_importance_sampling_clip_max=live.vllm_importance_sampling_clip_max,
        )

    @property
    def entropy_bonus(self) -> bool:
        return self.entropy_coef != 0.0 or self.use_adaptive_entropy

    @property
    def vllm_is(self) -> bool:
        return self.use_vllm and self.vllm_importance_sampling_correction


def _unsupported(option: str, reason: str) -> ValueError:
    return ValueError(
        f"LogitlessGRPOTrainer cannot honour {option}: {reason}. Use trl.GRPOTrainer for this "
        "run, or change the option."
    )


def _mismatch_options(o: _Options) -> dict[str, Any]:
    """TRL's vLLM importance-sampling correction as PolicyLossConfig options."""
    if not o.vllm_is:
        return {}
    mode = o.vllm_importance_sampling_mode
    low = o.vllm_importance_sampling_clip_min
    high = (
        _NO_BOUND
        if o.vllm_importance_sampling_clip_max is None
        else (o.vllm_importance_sampling_clip_max)
    )
    level, kind = mode.split("_") if mode.count("_") == 1 else (None, None)
    if level not in ("token", "sequence") or kind not in ("truncate", "mask"):
        raise _unsupported(f"vllm_importance_sampling_mode={mode!r}", "an unknown mode")
    # A bound at or below 0 never binds a positive ratio: no floor (TRL accepts clip_min=0).
    low = None if low is None or low <= 0 else low
    out: dict[str, Any] = {"mismatch_is": level, "mismatch_is_cap": high}
    if kind == "truncate":  # clamp(ρ, C_min, C_max)
        out["mismatch_is_floor"] = low
    elif level == "token":  # ρ_t · [C_min <= ρ_t <= C_max]
        out["mismatch_token_mask"] = (low or 0.0, high)
    else:  # Π ρ · [C_min <= Π ρ <= C_max]
        out["mismatch_seq_mask"] = "product"
        out["mismatch_seq_mask_range"] = (low or 0.0, high)
    return out


# PolicyLossConfig field -> the TRL options it is made of (named when a value is refused).
_TRL_SOURCES = {
    "clip_low": ("epsilon",),
    "clip_high": ("epsilon_high",),
    "dual_clip": ("delta",),
    "sapo_tau_pos": ("sapo_temperature_pos",),
    "sapo_tau_neg": ("sapo_temperature_neg",),
    "norm_length": ("max_completion_length",),
    "kl_coef": ("beta",),
    "entropy_coef": ("entropy_coef",),
    "mismatch_is_cap": ("vllm_importance_sampling_clip_max",),
    "mismatch_is_floor": (
        "vllm_importance_sampling_clip_min",
        "vllm_importance_sampling_clip_max",
    ),
    "mismatch_token_mask": (
        "vllm_importance_sampling_clip_min",
        "vllm_importance_sampling_clip_max",
    ),
    "mismatch_seq_mask_range": (
        "vllm_importance_sampling_clip_min",
        "vllm_importance_sampling_clip_max",
    ),
}


def _trl_config(o: _Options, kw: dict[str, Any]) -> PolicyLossConfig:
    """``PolicyLossConfig(**kw)``; a value it refuses is reported as the TRL option(s) it
    came from, with their values (the user never set the logitless field)."""
    try:
        return PolicyLossConfig(**kw)
    except ValueError as e:
        field = next((f for f in _TRL_SOURCES if str(e).startswith(f)), None)
        if field is None:
            raise
        sources = _TRL_SOURCES[field]
        if field in ("clip_low", "clip_high") and o.loss_type == "cispo":
            sources = ("epsilon_high",)
        named = ", ".join(f"{name}={_trl_value(o, name)!r}" for name in sources)
        raise _unsupported(named, f"it maps to an invalid logitless value ({e})") from None


def _trl_value(o: _Options, name: str) -> Any:
    """The value of TRL option ``name`` in ``o`` (``epsilon`` is stored as epsilon_low)."""
    return o.epsilon_low if name == "epsilon" else getattr(o, name)


def grpo_loss_config(source: GRPOTrainer | GRPOConfig) -> PolicyLossConfig:
    """The :class:`~logitless.PolicyLossConfig` of a TRL GRPO trainer's (or config's) loss.

    Reproduces ``GRPOTrainer._compute_loss`` of TRL 1.16 per token: the surrogate of
    ``loss_type`` with ``epsilon`` / ``epsilon_high`` (``delta`` as the dual clip), the ratio
    level, the k3 KL with ``beta`` (weighted by the differentiable ratio with
    ``use_bias_correction_kl``), the vLLM importance-sampling correction (all four modes,
    ``clip_min`` / ``clip_max``) and the entropy bonus as a token mean. The *counts* TRL
    normalizes by come per micro-batch (see the module doc); :class:`LogitlessGRPOTrainer`
    passes them as a :class:`~logitless.LossNormalizer` and rescales ``entropy_coef`` per
    micro-batch (TRL's bonus is a per-micro-batch mean).

    Raises:
        ValueError: naming the TRL option that has no logitless equivalent.

    >>> import trl
    >>> args = trl.GRPOConfig(output_dir="out", loss_type="dapo", epsilon_high=0.28, bf16=False)
    >>> cfg = grpo_loss_config(args)
    >>> cfg.surrogate, cfg.clip_low, cfg.clip_high, cfg.aggregation
    ('ppo_clip', 0.2, 0.28, 'token_mean')
    """
    o = source if isinstance(source, _Options) else _Options.of(source)
    _refuse_unreproduced(o)
    kw: dict[str, Any] = {
        "aggregation": _AGGREGATIONS[o.loss_type],
        "ratio_level": o.importance_sampling_level,
        **_surrogate_options(o),
    }
    if o.loss_type == "dr_grpo":
        if not o.max_completion_length:
            raise _unsupported(
                "loss_type='dr_grpo' with max_completion_length=None", "it has no constant"
            )
        kw["norm_length"] = int(o.max_completion_length)
    if o.beta > 0:
        kw.update(
            kl_coef=o.beta,
            kl_estimator="k3",
            kl_log_ratio_clamp=None,
            kl_value_clamp=None,
            kl_importance_weight=bool(o.use_bias_correction_kl),
        )
    if o.entropy_bonus:
        kw.update(entropy_coef=o.entropy_coef, entropy_aggregation="token_mean")
    kw.update(_mismatch_options(o))
    return _trl_config(o, kw)


def _refuse_unreproduced(o: _Options) -> None:
    """Raise for the GRPO options whose loss logitless does not reproduce."""
    if o.loss_type not in _AGGREGATIONS:
        raise _unsupported(
            f"loss_type={o.loss_type!r}",
            f"logitless reproduces {sorted(_AGGREGATIONS)} (VESPO's gamma weighting of "
            "sequence ratios has no logitless surrogate)",
        )
    if o.use_adaptive_entropy:
        raise _unsupported(
            "use_adaptive_entropy=True", "adaptive entropy control is not reproduced"
        )
    if o.top_entropy_quantile < 1.0 and o.entropy_bonus:
        raise _unsupported(
            f"top_entropy_quantile={o.top_entropy_quantile} with entropy_coef={o.entropy_coef}",
            "TRL restricts the entropy bonus to the high-entropy tokens, and logitless' entropy "
            "term covers every token of the loss mask",
        )
    if o.beta < 0:
        raise _unsupported(f"beta={o.beta}", "the KL coefficient must be >= 0")


def _surrogate_options(o: _Options) -> dict[str, Any]:
    """The surrogate's :class:`~logitless.PolicyLossConfig` fields of ``loss_type``."""
    kw: dict[str, Any] = {}
    if o.loss_type == "cispo":  # weight min(r, ε_high) = clip(r, 1 - 1, 1 + (ε_high - 1))
        if o.epsilon_high < 1.0:
            raise _unsupported(
                f"loss_type='cispo' with epsilon_high={o.epsilon_high}",
                "a cap below 1 on the IS weight (TRL's default when epsilon_high is unset) "
                "has no logitless equivalent; set epsilon_high >= 1 (ScaleRL recommends 5.0)",
            )
        kw.update(surrogate="cispo", clip_low=1.0, clip_high=o.epsilon_high - 1.0)
    elif o.loss_type == "sapo":
        kw.update(
            surrogate="sapo",
            sapo_tau_pos=o.sapo_temperature_pos,
            sapo_tau_neg=o.sapo_temperature_neg,
        )
    else:
        kw.update(surrogate="ppo_clip", clip_low=o.epsilon_low, clip_high=o.epsilon_high)
        if o.delta is not None:
            # min(min(r, δ)·A, clip(r)·A) is the dual clip when δ bounds clip(r) from above
            if not o.delta > 1.0 or o.delta < 1.0 + o.epsilon_high:
                raise _unsupported(
                    f"delta={o.delta} with epsilon_high={o.epsilon_high}",
                    "logitless' dual clip equals TRL's two-sided clip only for "
                    "delta >= 1 + epsilon_high (and delta > 1)",
                )
            kw["dual_clip"] = o.delta
    return kw


def _model_problem(model: nn.Module) -> str | None:
    """Why logitless cannot run this policy (wrapped or not), or None."""
    try:
        hf.check_model(model)
    except ValueError as e:
        return str(e)
    return None


def check_trainer(trainer: GRPOTrainer) -> PolicyLossConfig:
    """Every check of a trainer's options and model; returns its loss config.

    Raises ``ValueError`` naming the first TRL option (or model property) that logitless
    cannot honour. :class:`LogitlessGRPOMixin` calls it at the end of ``__init__`` and at each
    loss, so a run never starts (or continues) with different numbers.
    """
    config = grpo_loss_config(trainer)
    args = trainer.args
    if getattr(args, "cast_lm_head_to_fp32", False):
        raise _unsupported(
            "cast_lm_head_to_fp32=True",
            "TRL replaces lm_head.forward, which logitless reads as a plain nn.Linear; pass "
            "a model whose lm_head is already float32 instead",
        )
    problem = distributed_problem(trainer.accelerator)
    if problem is not None:
        raise _unsupported("this distributed setup", problem)
    for name, model in (("model", trainer.model), ("ref_model", trainer.ref_model)):
        if model is None:
            continue
        problem = _model_problem(model)
        if problem is not None:
            raise _unsupported(f"this {name}", problem)
    return config


# The multimodal fields TRL 1.16's GRPOTrainer passes to its forward
# (_get_per_token_logps_and_entropies), and those of the classes logitless audits.
_TRL_MULTIMODAL = (
    "pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes",
    "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids",
)  # fmt: skip
_AUDITED_MULTIMODAL = ("pixel_values", "image_grid_thw", "num_images", "image_sizes")
_AUDITED_MULTIMODAL += ("token_type_ids", "mm_token_type_ids")


def _check_multimodal(fields: dict[str, Any]) -> dict[str, Any]:
    """TRL's multimodal fields of a batch; those of classes logitless does not audit (tiled
    or patch-packed images: LFM2-VL, InternVL, SmolVLM, ...) refused by name."""
    other = sorted(k for k, v in fields.items() if v is not None and k not in _AUDITED_MULTIMODAL)
    if other:
        raise _unsupported(
            ", ".join(other),
            "these image inputs belong to vision-language classes logitless does not audit "
            f"(it runs {', '.join(sorted(hf_vlm.AUDITED))})",
        )
    return {k: v for k, v in fields.items() if v is not None}


def _image_rows(fields: dict[str, Any], rows: slice) -> dict[str, Any]:
    """The model's image inputs of batch rows ``rows`` from TRL's batch fields (``num_images``
    per row; Qwen's ``pixel_values`` one row per patch of ``image_grid_thw``, the others' one
    image per row; the type ids per token), as GRPOTrainer slices them for its forward."""
    out: dict[str, Any] = {}
    num_images = fields.get("num_images")
    pixels, grid = fields.get("pixel_values"), fields.get("image_grid_thw")
    if pixels is not None:
        if num_images is None:
            raise ValueError("pixel_values without num_images (images per row) in the batch")
        first = sum(num_images[: rows.start])
        last = first + sum(num_images[rows])
        if grid is not None:  # one row of pixel_values per patch
            patches = [0, *grid.prod(-1).cumsum(0).tolist()]
            out["pixel_values"] = pixels[patches[first] : patches[last]]
            out["image_grid_thw"] = grid[first:last]
        else:
            out["pixel_values"] = pixels[first:last]
        if fields.get("image_sizes") is not None:
            out["image_sizes"] = fields["image_sizes"][first:last]
        if not out["pixel_values"].shape[0]:  # text-only rows
            out = {}
    for name in ("token_type_ids", "mm_token_type_ids"):
        if fields.get(name) is not None:
            out[name] = fields[name][rows]
    return out


class _Step(NamedTuple):
    """What one micro-batch's forward returns: the loss (the MoE router loss apart, TRL adds
    it with its own weight) and the no-grad ``[B, C]`` tensors TRL logs from."""

    loss: torch.Tensor | None  # None until the head step fills it (as logps, old, ...)
    aux_loss: torch.Tensor | None
    logps: torch.Tensor | None
    old: torch.Tensor | None
    advantages: torch.Tensor  # [B, 1] per sequence, or [B, C]
    mask: torch.Tensor
    ref: torch.Tensor | None
    entropies: torch.Tensor | None
    mismatch: RolloutMismatch | None = None  # [B, C] diagnostics (rollout_topk), or None


class _HeadStep(NamedTuple):
    """What the head's part of one micro-batch reads besides the hidden states and the head:
    the call prepared before the backbone (log-probs and entropies, TRL's temperature), TRL's
    batch and options, the loss config, the mode, the completion layout, and the step so far
    (mask, advantages, the MoE router loss)."""

    prep: Prepared
    inputs: dict
    opts: _Options
    config: PolicyLossConfig
    mode: str
    layout: CompletionLayout
    step: _Step


class LogitlessGRPOMixin:
    """Put before ``trl.GRPOTrainer`` (or your subclass of it) in the bases to run its
    log-probs and loss on logitless::

        class MyTrainer(LogitlessGRPOMixin, MyGRPOTrainer): ...

    It overrides ``_get_per_token_logps_and_entropies`` and ``_compute_loss``; everything
    else (generation, rewards, advantages, logging) is the trainer's own.

    Two keywords of its own: ``batch_invariant=True`` runs every head call (the old policy's
    and the reference's scoring, the loss) in logitless's batch-invariant mode, so a token's
    log-prob does not depend on the batch it is scored in and the ratio on unchanged weights
    is exactly 1.0 (docs/head.md#batch-invariance; the backbone's own invariance is the
    model's). ``rollout_topk=k``: vLLM returns its top ``k`` log-probs of every generated
    position (TRL's ``VLLMGeneration(logprobs=k)``; TRL itself asks for 0), and each loss step
    logs how the policy's distribution differs from vLLM's (``rollout_mismatch/*``,
    docs/rollout-mismatch.md), from the no-grad head pass it already makes; needs
    ``use_vllm=True``, no ``rollout_func``, no tools.
    """

    def __init__(
        self,
        *args: Any,
        batch_invariant: bool = False,
        rollout_topk: int | None = None,
        **kwargs: Any,
    ) -> None:
        self.logitless_batch_invariant = check_flag("batch_invariant", batch_invariant)
        self.logitless_rollout_topk = check_optional_int("rollout_topk", rollout_topk, minimum=1)
        self._logitless_topk: tuple[list, list] | None = None
        super().__init__(*args, **kwargs)
        check_trainer(self)
        if rollout_topk is not None and (self.tools or self.environment_factories):
            raise _unsupported(
                "rollout_topk with tools", "tool calls splice tokens the engine did not sample"
            )

    # ---- the rollout engine's top-k (rollout_topk): recorded where TRL calls vLLM

    def _generate_single_turn(self, *args: Any, **kwargs: Any):
        k = self.logitless_rollout_topk
        if k is None:
            return super()._generate_single_turn(*args, **kwargs)
        if not self.use_vllm:
            raise _unsupported(
                "rollout_topk without use_vllm",
                "only TRL's vLLM generation returns top-k log-probs",
            )
        with trl_rollout.recording(self.vllm_generation, k) as seen:
            out = super()._generate_single_turn(*args, **kwargs)
        self._logitless_topk = seen[-1]
        return out

    def _generate_and_score_completions(self, inputs):
        self._logitless_topk = None
        output = super()._generate_and_score_completions(inputs)
        if self.logitless_rollout_topk is None:
            return output
        if self._logitless_topk is None:
            raise _unsupported(
                "rollout_topk with a rollout_func",
                "TRL 1.16 hands a rollout function's extra fields to the reward functions only",
            )
        completions = output["completion_ids"]
        ids, lps = trl_rollout.topk_tensors(*self._logitless_topk, completions.shape,
                                            completions.device)  # fmt: skip
        output["rollout_topk_ids"], output["rollout_topk_logprobs"] = ids, lps
        return output

    # ---- the no-grad log-probs TRL takes when it scores completions (old policy, reference)

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **multimodal,
    ):
        if compute_aux_loss:
            raise _unsupported("compute_aux_loss", "the scoring passes take no router loss")
        _check_multimodal(multimodal)
        total = input_ids.shape[1]
        layout = CompletionLayout(total - logits_to_keep, logits_to_keep)
        response = attention_mask.bool().clone()
        response[:, : layout.prompt] = False
        batch_size = batch_size or input_ids.shape[0]
        logps, entropies = [], []
        for start in range(0, input_ids.shape[0], batch_size):
            rows = slice(start, start + batch_size)
            with self.accelerator.autocast():
                out = hf.causal_lm_logprobs(  # inside the DDP / FSDP2 wrapper's forward
                    model,
                    input_ids[rows],
                    attention_mask=attention_mask[rows],
                    response_mask=response[rows],
                    with_entropy=compute_entropy,
                    temperature=self.temperature,
                    batch_invariant=self.logitless_batch_invariant,
                    **_image_rows(multimodal, rows),
                )
            logps.append(layout.to_trl(out.logprobs))
            if compute_entropy:
                entropies.append(layout.to_trl(out.entropy))
        return torch.cat(logps), torch.cat(entropies) if compute_entropy else None, None

    # ---- the loss

    def _compute_loss(self, model, inputs):
        opts = _Options.of(self)
        config = check_trainer(self)
        mode = "train" if self.model.training else "eval"
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1

        prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
        layout = CompletionLayout(prompt_ids.shape[1], completion_ids.shape[1])
        if layout.prompt < 1:
            raise ValueError("LogitlessGRPOTrainer needs at least one prompt token per row")
        # The backbone, the head and the loss run inside the wrapper's forward (DDP arms its
        # reducer there; FSDP2 gathers the root's parameters, the head's among them).
        step = hf.run_in_forward(model, self._logitless_step, inputs, opts, config, mode, layout)
        loss = step.loss
        if step.aux_loss is not None:  # TRL: the MoE router loss, per accumulation step
            loss = loss + self.router_aux_loss_coef * step.aux_loss / accumulation
            aux = self.accelerator.gather_for_metrics(step.aux_loss.detach())
            self._metrics[mode]["aux_loss"].append(aux.mean().item())
        self._logitless_log(opts, mode, loss, step, accumulation)
        return loss

    def _logitless_step(
        self, lm, inputs, opts: _Options, config, mode: str, layout: CompletionLayout
    ):
        """One micro-batch's loss on the unwrapped model ``lm``, inside the wrapper's forward:
        the head call prepared (checked) first, the backbone once, then a no-grad head pass for
        the current log-probs and entropies (TRL's metrics and masks, and the old log-probs
        on-policy) and the fused loss, as ``lm_head``'s forward."""
        input_ids, attention_mask, mask = completion_batch(inputs)
        labels = hf.causal_lm_labels(
            input_ids, attention_mask=attention_mask, response_mask=layout.response_mask(mask)
        )
        with self.accelerator.autocast():
            head = hf_model.head_for_checks(lm)
            options = HeadOptions(
                temperature=float(opts.temperature),
                with_entropy=True,
                head_dtype=hf_model.autocast_dtype(head.weight.device),  # lm_head's dtype
                batch_invariant=self.logitless_batch_invariant,
            )
            sampler = None
            if "rollout_topk_ids" in inputs:  # rollout_topk: the engine's top-k, [B, P + C, k]
                topk = RolloutTopK(layout.to_full(inputs["rollout_topk_ids"], fill=-1),
                                   layout.to_full(inputs["rollout_topk_logprobs"]))  # fmt: skip
                sampler = SamplerOptions(rollout_topk=topk)
            prep = seam.prepare(labels, head, options, sampler)  # before the backbone
            images = _check_multimodal({k: inputs.get(k) for k in _TRL_MULTIMODAL})
            images = _image_rows(images, slice(0, input_ids.shape[0]))
            backbone_in = hf_vlm.BackboneInputs(input_ids, attention_mask, None, images)
            out = hf_model.run_backbone(lm, backbone_in, router_logits=self.aux_loss_enabled)
        aux = None
        if out.router_logits is not None:
            aux = hf_model.router_aux_loss(lm, out.router_logits, attention_mask)
        step = _Step(None, aux, None, None, inputs["advantages"], mask, None, None)
        args = _HeadStep(prep, inputs, opts, config, mode, layout, step)
        # the head's parameters gathered (FSDP2's lm_head unit, ZeRO-3) for the head's calls
        return hf_model.with_head(
            lm,
            lambda tokens, head: self._logitless_head_step(tokens, head, args),
            Tokens(out.hidden, labels),
        )

    def _logitless_head_step(self, tokens: Tokens, head: Head, args: _HeadStep) -> _Step:
        """The head's part of :meth:`_logitless_step`: a no-grad pass, TRL's masks, the loss."""
        opts, layout, inputs, step = args.opts, args.layout, args.inputs, args.step
        with torch.no_grad():  # current log-probs and entropies: one head pass, no grad
            now = seam.logprobs(args.prep, Tokens(tokens.hidden.detach(), tokens.labels), head)
        logps = layout.to_trl(now.logprobs)  # [B, C]
        entropies = layout.to_trl(now.entropy)  # [B, C]
        mismatch = None
        if now.mismatch is not None:
            mismatch = RolloutMismatch(*(layout.to_trl(t) for t in now.mismatch))
        old = inputs.get("old_per_token_logps")
        old = logps if old is None else old  # on-policy: π_old = sg(π_θ)
        advantages = step.advantages
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1)
        token_advantages = self._logitless_advantages(
            opts, inputs, advantages, logps, old, entropies, step.mask
        )
        rollout = None
        if opts.vllm_is:  # vLLM could not score some tokens (NaN): no correction there
            sampling = inputs["sampling_per_token_logps"]
            rollout = layout.to_full(torch.where(torch.isnan(sampling), old, sampling))
        ref = inputs.get("ref_per_token_logps") if opts.beta != 0.0 else None

        normalizer, entropy_scale = self._logitless_normalizer(opts, inputs, step.mask, args.mode)
        config = args.config
        if opts.entropy_bonus:
            config = dataclasses.replace(config, entropy_coef=self.entropy_coef * entropy_scale)
        loss_inputs = LossInputs(
            layout.to_full(old.float()),
            layout.to_full(token_advantages),
            ref_logprobs=None if ref is None else layout.to_full(ref.float()),
            rollout_logprobs=rollout,
        )
        prep = dataclasses.replace(args.prep, call=args.prep.call.replace(rollout=None))
        prep = prep.with_loss(loss_inputs, config, normalizer)
        loss, _ = seam.policy_loss(prep, tokens, head)
        return step._replace(
            loss=loss, logps=logps, old=old, advantages=advantages, ref=ref, entropies=entropies,
            mismatch=mismatch,
        )  # fmt: skip

    def _logitless_advantages(
        self, opts: _Options, inputs, advantages, logps, old, entropies, mask
    ):
        """``[B, C]`` per-token advantages with TRL's masks on the policy term folded in: every
        surrogate is -A·f(r) up to where A's sign is read, so A·keep drops the term."""
        keep = torch.ones_like(mask, dtype=logps.dtype)
        if opts.top_entropy_quantile < 1.0:
            keep = keep * self.get_high_entropy_mask(entropies, mask, 1 - opts.top_entropy_quantile)
        if self.off_policy_mask_threshold is not None:
            sampling = inputs.get("sampling_per_token_logps", old)
            keep = keep * self.get_off_policy_mask(
                advantages=advantages,
                per_token_logps=logps,
                sampling_per_token_logps=sampling,
                mask=mask,
                off_policy_threshold=self.off_policy_mask_threshold,
            )
        return (advantages * keep).float()

    def _logitless_normalizer(self, opts: _Options, inputs, mask, mode):
        """TRL's denominators of this micro-batch as a LossNormalizer, and the factor that
        turns the bonus's token mean over the normalizer's count into TRL's per-micro-batch
        mean divided by the accumulation steps."""
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
        local_tokens = mask.sum().clamp(min=1.0).float()
        rows = float(mask.shape[0]) * accumulation
        if opts.loss_type in ("dapo", "cispo"):
            tokens = inputs["num_items_in_batch"].clamp(min=1.0).float()
            tokens = tokens / self.accelerator.num_processes
            if mode == "train":  # per accumulation window of the generation batch
                tokens = tokens * accumulation / self.args.steps_per_generation
        else:
            tokens = local_tokens * accumulation
        own = local_tokens * accumulation
        entropy_scale = float(tokens / own)  # 1.0 but for dapo/cispo
        # TRL's dapo/cispo denominator can be smaller than this micro-batch's own token count
        # (num_items_in_batch spread over steps_per_generation): a normalizer may not count
        # fewer tokens than its call holds, so count `own` and scale the loss by own / tokens.
        scale = float(own / tokens) if float(tokens) < float(own) else 1.0
        count = own if scale != 1.0 else tokens
        return LossNormalizer(num_tokens=count, num_sequences=rows, loss_scale=scale), entropy_scale

    def _logitless_log(self, opts: _Options, mode: str, loss, step: _Step, accumulation: int):
        """The metrics ``GRPOTrainer._compute_loss`` logs, from the no-grad log-probs."""
        logps, old, advantages, mask = step.logps, step.old, step.advantages, step.mask
        ref, entropies = step.ref, step.entropies
        metrics = self._metrics[mode]
        maskf = mask.float()
        log_ratio = logps - old
        if opts.importance_sampling_level == "sequence":
            seq = (log_ratio * maskf).sum(-1) / maskf.sum(-1).clamp(min=1.0)
            ratio = seq.exp().unsqueeze(-1)  # [B, 1]
        else:
            ratio = log_ratio.exp()  # [B, C]

        def global_mean(x: torch.Tensor) -> float:
            if x.shape[1] == 1:  # one value per sequence
                total, count = x.sum(), torch.tensor(float(x.shape[0]), device=x.device)
            else:
                total, count = (x * maskf).sum(), maskf.sum()
            totals = self.accelerator.reduce(torch.stack([total, count]), reduction="sum")
            return (totals[0] / totals[1].clamp(min=1.0)).item()

        def seq_mean(x: torch.Tensor) -> torch.Tensor:
            return x.squeeze(1) if x.shape[1] == 1 else (x * maskf).sum(-1) / maskf.sum(-1)

        if opts.entropy_bonus:
            bonus = (entropies * maskf).sum() / maskf.sum().clamp(min=1.0) / accumulation
            policy = loss.detach() + self.entropy_coef * bonus
            if opts.loss_type in _PER_STEP:
                policy = policy * accumulation
            metrics["policy_loss"].append(self.accelerator.gather(policy).nanmean().item())
            if mode == "train" and self.accelerator.sync_gradients:
                metrics["entropy_coef"].append(self.entropy_coef)
        if opts.beta != 0.0:
            x = ref - logps
            kl = torch.exp(x) - x - 1
            if opts.use_bias_correction_kl:
                kl = kl * ratio
            metrics["kl"].append(global_mean(kl))
        metrics["entropy"].append(global_mean(entropies))
        if opts.loss_type in _PPO_FAMILY:
            low = ((ratio < 1 - opts.epsilon_low) & (advantages < 0)).float()
            high = ((ratio > 1 + opts.epsilon_high) & (advantages > 0)).float()
            metrics["clip_ratio/low_mean"].append(global_mean(low))
            metrics["clip_ratio/high_mean"].append(global_mean(high))
            metrics["clip_ratio/region_mean"].append(global_mean(((low + high) > 0).float()))
            gathered_low = self.accelerator.gather(seq_mean(low))
            metrics["clip_ratio/low_min"].append(nanmin(gathered_low).item())
            gathered_high = self.accelerator.gather(seq_mean(high))
            metrics["clip_ratio/high_max"].append(nanmax(gathered_high).item())
        elif opts.loss_type == "cispo":
            clipped = ((ratio > opts.epsilon_high) & (advantages > 0)).float()
            metrics["cispo_clip_ratio"].append(global_mean(clipped))
        if step.mismatch is not None:
            self._logitless_log_mismatch(metrics, step.mismatch, mask)

    def _logitless_log_mismatch(self, metrics, mismatch: RolloutMismatch, mask) -> None:
        """``rollout_mismatch/*``: token means over every process's compared tokens, the worst
        sequence of every process (:func:`logitless.losses.rollout_mismatch_metrics`)."""
        found = rollout_mismatch_metrics(mismatch, mask.bool())
        count = found.metrics["rollout_mismatch/tokens"]
        for name, value in found.metrics.items():
            if name.endswith("_seq_max"):
                metrics[name].append(self.accelerator.gather(value[None]).max().item())
            elif name.endswith("/tokens"):
                metrics[name].append(self.accelerator.reduce(count, reduction="sum").item())
            else:
                totals = self.accelerator.reduce(torch.stack([value * count, count]), "sum")
                metrics[name].append((totals[0] / totals[1].clamp(min=1.0)).item())


class LogitlessGRPOTrainer(LogitlessGRPOMixin, GRPOTrainer):
    """``trl.GRPOTrainer`` with its log-probs and loss computed by logitless.

    Same constructor, options, training loop and logged metrics; see the module doc for what
    changes (no ``[tokens, vocab]`` logits) and what is refused.
    """
