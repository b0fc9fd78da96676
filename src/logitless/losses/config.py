"""``PolicyLossConfig``: every option of :func:`logitless.losses.policy_loss`, validated once.

The config is a frozen dataclass; every field is checked in ``__post_init__`` and a bad value
raises ``ValueError`` naming the field, what was expected and what was given. Names of modes
are plain strings so a config round-trips through YAML/JSON unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..contract.checks import finite_number
from .aggregation import AGGREGATIONS as _AGGREGATIONS
from .kl import KL_ESTIMATORS as _KL_ESTIMATORS
from .mismatch import SEQUENCE_STATISTICS as _SEQUENCE_STATISTICS
from .surrogates import SURROGATES as _SURROGATES

# The accepted names, read off the implementations (one registry each).
SURROGATES = tuple(_SURROGATES)
RATIO_LEVELS = ("token", "sequence", "sequence_mean")
AGGREGATIONS = tuple(_AGGREGATIONS)
KL_ESTIMATORS = tuple(_KL_ESTIMATORS)
MISMATCH_IS = (None, "token", "sequence")
MISMATCH_SEQ_MASKS = (None, *_SEQUENCE_STATISTICS)


# (low, high) fields, stored as tuples
_BANDS = (
    "mismatch_token_mask",
    "mismatch_seq_mask_range",
    "ratio_token_mask",
    "ratio_seq_mask_range",
)


def _choice(field: str, value: object, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{field} must be one of {list(choices)}, got {value!r}")


def _number(
    field: str, value: object, *, minimum: float | None = None, strict: bool = False
) -> None:
    if not finite_number(value):
        raise ValueError(f"{field} must be a finite number, got {value!r}")
    if minimum is not None and (value <= minimum if strict else value < minimum):
        op = ">" if strict else ">="
        raise ValueError(f"{field} must be {op} {minimum}, got {value!r}")


def _optional_positive(field: str, value: object) -> None:
    if value is not None:
        _number(field, value, minimum=0.0, strict=True)


def _band(field: str, value: object) -> None:
    """A ``(low, high)`` pair of finite numbers with ``0 <= low < high``."""
    if (
        not isinstance(value, (tuple, list))
        or len(value) != 2
        or not all(finite_number(v) for v in value)
        or not 0 <= value[0] < value[1]
    ):
        raise ValueError(f"{field} must be a pair (low, high) with 0 <= low < high, got {value!r}")


@dataclass(frozen=True)
class PolicyLossConfig:
    """Options of :func:`logitless.losses.policy_loss` (formulas: the README's "Policy losses").

    Surrogate
        surrogate: ``"ppo_clip" | "cispo" | "sapo" | "gmpo" | "reinforce" | "dppo"``.
        clip_low, clip_high: ``ε_low, ε_high >= 0``. PPO / CISPO clip the ratio to
            ``[1 - ε_low, 1 + ε_high]`` (DAPO "clip-higher": ``ε_high > ε_low``); GMPO clips the
            *log* ratio to ``[-ε_low, ε_high]``; DPPO uses them as the probability-difference
            (total-variation) thresholds ``δ_low, δ_high``.
        dual_clip: PPO dual-clip constant ``c > 1`` (Ye et al. 2020), or ``None``.
        sapo_tau_pos, sapo_tau_neg: SAPO gate temperatures for ``A > 0`` / ``A <= 0``.
        dppo_ratio_cap: DPPO truncates the (stop-gradient) ratio at this value.
    Ratio
        ratio_level: ``"token"``, ``"sequence"`` or ``"sequence_mean"``. Both sequence levels
            are GSPO's: every token of a document carries the geometric mean ``s_d`` of its
            token ratios. ``"sequence"`` is GSPO-token's gradient, each token's through its own
            log-prob (``sg(s_d) · π/sg(π)``); ``"sequence_mean"`` differentiates ``s_d``
            through the mean, so a token's gradient is ``1/n_d`` of the sum over its document's
            tokens of their loss's derivative in ``log s_d`` (slime's GSPO; under context
            parallelism one all-reduce of ``[D]`` in backward). The two agree when the advantage
            and every factor of the policy term (IS weights, masks) are constant over each
            document.
    Aggregation
        aggregation: ``"token_mean" | "seq_mean_token_mean" | "seq_mean_token_sum" |
            "seq_mean_token_sum_norm" | "token_sum"``.
        norm_length: Dr.GRPO's constant ``L`` for ``"seq_mean_token_sum_norm"`` (typically the
            maximum response length). ``None`` uses ``T`` of a ``[B, T]`` input; a packed
            ``[N]`` input then needs it set.
    KL to a reference policy
        kl_coef: ``β >= 0``; the per-token KL is added to the loss before aggregation.
        kl_estimator: ``"k1" | "k2" | "k3" | "k3+"`` (``"k3+"``: k3 value, k2 gradient).
        kl_log_ratio_clamp: ``|log π_ref − log π|`` is clamped to this before ``exp`` in
            k3/k3+ (``None``: no clamp).
        kl_value_clamp: k3/k3+ values are clamped to ``[-c, c]`` (``None``: no clamp).
        kl_importance_weight: multiply each token's KL by the importance ratio ``r_t``
            (``s_d``, the sequence ratio, at a sequence ``ratio_level``), *with* its gradient:
            ``r · KL`` estimates KL(π_θ ‖ π_ref) from samples of π_old, and its gradient is the
            unbiased reverse-KL gradient (DeepSeek-V3.2's unbiased KL estimate; TRL's
            ``use_bias_correction_kl``). It changes the gradient even where ``r = 1``.
    Entropy
        entropy_coef: the loss gets ``- entropy_coef · H`` per token (a bonus when > 0).
        entropy_aggregation: how the entropy term is aggregated: ``None`` (like the loss, with
            its ``aggregation``) or one of the ``aggregation`` names, with the same counts
            (e.g. ``"token_mean"``: a token mean whatever the loss's aggregation, as TRL does).
    Distillation (docs/distillation.md)
        distill_coef: the loss gets ``+ distill_coef · D_t`` per token, ``D_t`` the divergence
            from a teacher's next-token distribution (``divergence=`` of
            :func:`~logitless.policy_loss`, computed by :func:`~logitless.fused_policy_loss`
            from ``teacher=``); ``D`` is reported as ``distill_divergence`` whenever given.
        distill_beta: which divergence the fused loss computes, TRL's convention (0:
            KL(teacher‖student), 1: KL(student‖teacher), else the generalized JSD); unused
            when the divergence is given.
        distill_aggregation: how the distillation term is aggregated: ``None`` (like the
            loss) or one of the ``aggregation`` names.
    Train/inference mismatch (needs ``rollout_logprobs``; ``ρ = π_old / π_rollout``)
        mismatch_is: truncated importance sampling, ``"token"`` (``min(ρ_t, cap)``) or
            ``"sequence"`` (``min(Π_t ρ_t, cap)``), or ``None``.
        mismatch_is_cap: the truncation cap (> 0).
        mismatch_is_floor: a lower truncation of the same weight: ``max(w, floor)`` (TRL's
            ``vllm_importance_sampling_clip_min`` in its ``*_truncate`` modes), or ``None``.
        mismatch_token_mask: ``(low, high)``: tokens with ``ρ_t`` outside are dropped from the
            policy term (masked IS / IcePop), or ``None``.
        mismatch_seq_mask: ``"geometric"`` (``exp(mean_t log ρ_t)``) or ``"product"``
            (``Π_t ρ_t``): whole documents whose statistic is outside
            ``mismatch_seq_mask_range`` are dropped from the policy term, or ``None``.
        mismatch_seq_mask_range: ``(low, high)`` for ``mismatch_seq_mask``.
        ratio_token_mask: ``(low, high)``: tokens whose *current* ratio ``π_θ/π_old``
            (stop-gradient) is outside the band are dropped from the policy term (prime-rl's
            ``token_mask_low/high``), or ``None``.
        ratio_seq_mask: ``"geometric"`` or ``"product"`` of the current token ratios per
            document; documents outside ``ratio_seq_mask_range`` are dropped from the policy
            term (prime-rl's sequence masks), or ``None``.
        ratio_seq_mask_range: ``(low, high)`` for ``ratio_seq_mask``.
        opsm_delta: off-policy sequence masking (DeepSeek-V3.2): the tokens with ``A < 0`` of
            a document whose mean ``log π_old − log π_θ`` over its valid tokens exceeds
            ``δ`` leave the policy term (stop-gradient), or ``None``.
    """

    surrogate: str = "ppo_clip"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    dppo_ratio_cap: float = 20.0
    ratio_level: str = "token"
    aggregation: str = "token_mean"
    norm_length: int | None = None
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_log_ratio_clamp: float | None = 20.0
    kl_value_clamp: float | None = 10.0
    entropy_coef: float = 0.0
    mismatch_is: str | None = None
    mismatch_is_cap: float = 2.0
    mismatch_token_mask: tuple[float, float] | None = None
    mismatch_seq_mask: str | None = None
    mismatch_seq_mask_range: tuple[float, float] = (0.5, 2.0)
    ratio_token_mask: tuple[float, float] | None = None
    ratio_seq_mask: str | None = None
    ratio_seq_mask_range: tuple[float, float] = (0.5, 2.0)
    # added after the first release: kept last so positional construction is unchanged
    kl_importance_weight: bool = False
    entropy_aggregation: str | None = None
    mismatch_is_floor: float | None = None
    distill_coef: float = 0.0
    distill_beta: float = 0.0
    distill_aggregation: str | None = None
    opsm_delta: float | None = None

    def __post_init__(self) -> None:
        _choice("surrogate", self.surrogate, SURROGATES)
        _choice("ratio_level", self.ratio_level, RATIO_LEVELS)
        _choice("aggregation", self.aggregation, AGGREGATIONS)
        _choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        _choice("mismatch_is", self.mismatch_is, MISMATCH_IS)
        _choice("mismatch_seq_mask", self.mismatch_seq_mask, MISMATCH_SEQ_MASKS)
        _number("clip_low", self.clip_low, minimum=0.0)
        _number("clip_high", self.clip_high, minimum=0.0)
        if self.dual_clip is not None:
            _number("dual_clip", self.dual_clip, minimum=1.0, strict=True)
            if self.surrogate != "ppo_clip":
                raise ValueError(
                    f"dual_clip only applies to surrogate='ppo_clip', got surrogate="
                    f"{self.surrogate!r} with dual_clip={self.dual_clip!r}"
                )
        _number("sapo_tau_pos", self.sapo_tau_pos, minimum=0.0, strict=True)
        _number("sapo_tau_neg", self.sapo_tau_neg, minimum=0.0, strict=True)
        _number("dppo_ratio_cap", self.dppo_ratio_cap, minimum=0.0, strict=True)
        if self.ratio_level != "token" and _SURROGATES[self.surrogate].token_only:
            raise ValueError(
                f"ratio_level={self.ratio_level!r} is not defined for surrogate="
                f"{self.surrogate!r} "
                f"(it builds its own ratio); use ratio_level='token'"
            )
        if self.norm_length is not None and (
            isinstance(self.norm_length, bool)
            or not isinstance(self.norm_length, int)
            or self.norm_length < 1
        ):
            raise ValueError(f"norm_length must be None or an int >= 1, got {self.norm_length!r}")
        _number("kl_coef", self.kl_coef, minimum=0.0)
        _optional_positive("kl_log_ratio_clamp", self.kl_log_ratio_clamp)
        _optional_positive("kl_value_clamp", self.kl_value_clamp)
        if not isinstance(self.kl_importance_weight, bool):
            raise ValueError(
                f"kl_importance_weight must be a bool, got {self.kl_importance_weight!r}"
            )
        _number("entropy_coef", self.entropy_coef)
        _choice("entropy_aggregation", self.entropy_aggregation, (None, *AGGREGATIONS))
        _number("distill_coef", self.distill_coef, minimum=0.0)
        _number("distill_beta", self.distill_beta, minimum=0.0)
        if self.distill_beta > 1.0:
            raise ValueError(
                f"distill_beta must be in [0, 1] (0: KL(teacher||student), 1: "
                f"KL(student||teacher), else the generalized JSD), got {self.distill_beta!r}"
            )
        _choice("distill_aggregation", self.distill_aggregation, (None, *AGGREGATIONS))
        _number("mismatch_is_cap", self.mismatch_is_cap, minimum=0.0, strict=True)
        if self.mismatch_is_floor is not None:
            _number("mismatch_is_floor", self.mismatch_is_floor, minimum=0.0, strict=True)
            if self.mismatch_is is None or self.mismatch_is_floor >= self.mismatch_is_cap:
                raise ValueError(
                    "mismatch_is_floor must be < mismatch_is_cap and needs mismatch_is set, got "
                    f"mismatch_is_floor={self.mismatch_is_floor!r}, mismatch_is_cap="
                    f"{self.mismatch_is_cap!r}, mismatch_is={self.mismatch_is!r}"
                )
        if self.mismatch_token_mask is not None:
            _band("mismatch_token_mask", self.mismatch_token_mask)
        _band("mismatch_seq_mask_range", self.mismatch_seq_mask_range)
        _choice("ratio_seq_mask", self.ratio_seq_mask, MISMATCH_SEQ_MASKS)
        if self.ratio_token_mask is not None:
            _band("ratio_token_mask", self.ratio_token_mask)
        _band("ratio_seq_mask_range", self.ratio_seq_mask_range)
        if self.opsm_delta is not None:
            _number("opsm_delta", self.opsm_delta)
        # JSON has no tuples: a band read back as a list is stored as the tuple it was.
        for name in _BANDS:
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))

    # --- what the config needs of whole documents: decided here, used by the losses, the
    # document statistics and the fused loss alike.

    @property
    def sums_log_ratio(self) -> bool:
        """Needs each document's sum of ``log π_θ − log π_old`` (GSPO ratio, ratio_seq_mask,
        opsm_delta)."""
        return (
            self.ratio_level != "token"
            or self.ratio_seq_mask is not None
            or self.opsm_delta is not None
        )

    @property
    def sums_clipped_log_ratio(self) -> bool:
        """Needs each document's sum of the surrogate's clipped log-ratio (GMPO)."""
        return _SURROGATES[self.surrogate].document_mean

    def sums_log_rho(self, rollout_given: bool) -> bool:
        """Needs each document's sum of ``log π_old − log π_rollout`` (sequence mismatch IS or
        mask); only when ``rollout_logprobs`` is given."""
        return rollout_given and (
            self.mismatch_is == "sequence" or self.mismatch_seq_mask is not None
        )

    @property
    def is_token_local(self) -> bool:
        """True when each token's loss gradient depends on its own log-prob only.

        Whole-document statistics of ``π_θ`` (GSPO's sequence ratio, GMPO's mean, a sequence
        mask on the current ratio) make every token's gradient depend on its document's other
        tokens; statistics of ``π_old`` / ``π_rollout`` alone are constants and keep it local.
        The fused loss computes a token-local loss's gradient chunk by chunk during the head's
        forward; any other loss needs the log-probs of every row first.
        """
        return not (self.sums_log_ratio or self.sums_clipped_log_ratio)

    @property
    def uses_rollout(self) -> bool:
        """True when a train/inference mismatch correction needs ``rollout_logprobs``."""
        return (
            self.mismatch_is is not None
            or self.mismatch_token_mask is not None
            or self.mismatch_seq_mask is not None
        )
