"""slime's arguments as one :class:`~logitless.PolicyLossConfig`, or a ``ValueError`` that
names the option.

Part of :mod:`logitless.integrations.slime`. :func:`loss_config` is the one place slime's
options meet logitless's: each option of slime's ``policy_loss_function``
(``slime/backends/megatron_utils/loss.py`` and ``slime/utils/ppo_utils.py``, the pinned commit
of ``../shared/peers/README.md``) becomes the config field with the same semantics, and an
option logitless cannot follow exactly is refused by its slime name. slime's arguments are the
same on every rank (one command line), so every rank raises the same error without a
collective.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from ...losses import PolicyLossConfig

__all__ = ["MODEL_PROVIDER", "POLICY_LOSS", "check_switch", "loss_config", "mismatch_active"]

#: The two values of slime's command line that switch its policy loss to logitless.
MODEL_PROVIDER = "logitless.integrations.slime.model_provider"
POLICY_LOSS = "logitless.integrations.slime.policy_loss"

# slime's TIS functions (--custom-tis-function-path) that logitless follows.
_TIS = "slime.backends.megatron_utils.loss.vanilla_tis_function"
_ICEPOP = "slime.backends.megatron_utils.loss.icepop_function"

_ESTIMATORS = (
    "grpo",
    "gspo",
    "cispo",
    "ppo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
)
# slime's kl_loss_type -> (logitless's estimator, value clamp); slime clamps no log-ratio
_KL = {"k1": ("k1", None), "k2": ("k2", None), "k3": ("k3", None), "low_var_kl": ("k3", 10.0)}

# PolicyLossConfig's field -> the slime option it comes from (for its errors)
_OPTION = {
    "clip_low": "--eps-clip",
    "clip_high": "--eps-clip-high",
    "dual_clip": "--eps-clip-c",
    "entropy_coef": "--entropy-coef",
    "kl_coef": "--kl-loss-coef",
    "mismatch_is_cap": "--tis-clip",
    "mismatch_is_floor": "--tis-clip-low",
    "mismatch_token_mask": "--tis-clip-low / --tis-clip",
    "opsm_delta": "--opsm-delta",
}


def _arg(args: Any, name: str, default: Any = None) -> Any:
    return getattr(args, name, default)


def mismatch_active(args: Any) -> bool:
    """Whether slime's loss multiplies the policy term by its TIS function's weights: with
    ``--use-tis``, and also with ``--get-mismatch-metrics`` alone (``policy_loss_function``
    runs the TIS function under either)."""
    return bool(_arg(args, "use_tis", False) or _arg(args, "get_mismatch_metrics", False))


def _refused_options() -> tuple[tuple[str, Callable[[Any], bool], str], ...]:
    """``(option, when, why)``: what slime's arguments let through that logitless cannot do."""
    return (
        (
            "--recompute-loss-function",
            lambda a: bool(_arg(a, "recompute_loss_function", False)),
            "logitless keeps only per-token statistics between forward and backward, so there "
            "are no logits to recompute; recomputing would run the head twice: drop the flag",
        ),
        (
            "--rollout-top-p",
            lambda a: _arg(a, "rollout_top_p", 1.0) != 1.0,
            "slime replays the rollout's top-p nucleus in the log-probs but not in the "
            "entropy; logitless's replay normalizes both over the kept set, so the entropy "
            "term would differ: use --rollout-top-p 1.0",
        ),
        (
            "--custom-pg-loss-reducer-function-path",
            lambda a: _arg(a, "custom_pg_loss_reducer_function_path") is not None,
            "logitless aggregates the loss itself (slime's per-sample mean, or the token sum "
            "with --calculate-per-token-loss); a custom reducer of per-token losses has no "
            "per-token losses to reduce",
        ),
        (
            "--custom-tis-function-path",
            lambda a: _arg(a, "custom_tis_function_path") not in (None, _TIS, _ICEPOP),
            f"logitless follows slime's {_TIS} and {_ICEPOP} (token-level truncated and masked "
            "importance sampling); another function's weights are unknown to it",
        ),
        (
            "--use-rollout-logprobs",
            lambda a: bool(_arg(a, "use_rollout_logprobs", False)) and mismatch_active(a),
            "with --use-tis or --get-mismatch-metrics slime weighs the policy term by "
            "pi_old/pi_rollout, pi_old the trainer's log-probs, while the ratio's pi_old is "
            "the rollout's; logitless has one pi_old for both",
        ),
        (
            "--use-unbiased-kl",
            lambda a: _uses_kl(a) and _arg(a, "use_unbiased_kl", False) and _gspo(a),
            "with --advantage-estimator gspo slime weighs the KL by the token ratio, "
            "logitless by the sequence ratio",
        ),
        (
            "--kl-loss-type low_var_kl",
            lambda a: (
                _uses_kl(a)
                and _arg(a, "use_unbiased_kl", False)
                and _arg(a, "kl_loss_type") == "low_var_kl"
            ),
            "with --use-unbiased-kl slime clamps the importance-weighted KL to [-10, 10], "
            "logitless clamps the KL before weighting it: use --kl-loss-type k3",
        ),
        (
            "--kl-loss-type",
            lambda a: _uses_kl(a) and _arg(a, "kl_loss_type", "k1") not in _KL,
            f"expected one of {list(_KL)}",
        ),
        (
            "--advantage-estimator",
            lambda a: _arg(a, "advantage_estimator", "grpo") not in _ESTIMATORS,
            f"expected one of {list(_ESTIMATORS)}",
        ),
        (
            "--mtp-num-layers",
            lambda a: bool(_arg(a, "mtp_num_layers")) or bool(_arg(a, "enable_mtp_training")),
            "GPTModel computes the multi-token-prediction losses from their logits inside its "
            "forward; build the model without MTP layers",
        ),
        (
            "--overlap-moe-expert-parallel-comm",
            lambda a: bool(_arg(a, "overlap_moe_expert_parallel_comm", False)),
            "the combined 1F1B schedule builds the model's schedule plan, which computes the "
            "logits itself instead of calling GPTModel.forward's output_processor",
        ),
        (
            "--rollout-temperature",
            lambda a: not _positive(_arg(a, "rollout_temperature", 1.0)),
            "expected a finite number > 0 (slime divides the logits by it)",
        ),
    )


def _uses_kl(args: Any) -> bool:
    return bool(_arg(args, "use_kl_loss", False))


def _gspo(args: Any) -> bool:
    return _arg(args, "advantage_estimator", "grpo") == "gspo"


def _positive(value: Any) -> bool:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return ok and math.isfinite(value) and value > 0


def check_switch(args: Any) -> None:
    """The model provider's model hands the loss hidden states, not logits: slime's loss must
    be logitless's (``--loss-type custom_loss --custom-loss-function-path`` :data:`POLICY_LOSS`).
    """
    loss_type = _arg(args, "loss_type")
    path = _arg(args, "custom_loss_function_path")
    if loss_type != "custom_loss" or path != POLICY_LOSS:
        raise ValueError(
            f"--custom-model-provider-path {MODEL_PROVIDER} hands the loss the decoder's hidden "
            f"states instead of logits, so slime's loss must be logitless's: expected "
            f"--loss-type custom_loss --custom-loss-function-path {POLICY_LOSS}, got "
            f"--loss-type {loss_type} --custom-loss-function-path {path}"
        )


def loss_config(args: Any) -> PolicyLossConfig:
    """The :class:`~logitless.PolicyLossConfig` of slime's ``policy_loss_function`` for
    ``args`` (slime's parsed arguments).

    ``--advantage-estimator`` ``cispo`` is the CISPO surrogate, ``gspo`` the sequence ratio,
    the others PPO's clip (``--eps-clip``, ``--eps-clip-high``, dual clip ``--eps-clip-c``);
    ``--entropy-coef``; ``--use-kl-loss`` with ``--kl-loss-coef``, ``--kl-loss-type`` and
    ``--use-unbiased-kl``; ``--use-tis`` (or ``--get-mismatch-metrics``) with ``--tis-clip``,
    ``--tis-clip-low`` and slime's vanilla or IcePop TIS function; ``--use-opsm`` with
    ``--opsm-delta``; ``--calculate-per-token-loss`` (the token sum, else slime's per-sample
    mean). Raises ``ValueError`` naming the option (docs/slime.md, "Limits")."""
    for option, refused, why in _refused_options():
        if refused(args):
            raise ValueError(f"slime's {option} is not supported with {POLICY_LOSS}: {why}")
    try:
        return PolicyLossConfig(**_fields(args))
    except ValueError as e:
        field = next((f for f in _OPTION if str(e).startswith(f"{f} ")), None)
        if field is None:
            raise
        raise ValueError(f"slime's {_OPTION[field]}: {e}") from e


def _fields(args: Any) -> dict[str, Any]:
    estimator = _arg(args, "advantage_estimator", "grpo")
    eps_clip = _arg(args, "eps_clip", 0.2)
    high = _arg(args, "eps_clip_high")
    fields: dict[str, Any] = {
        "surrogate": "cispo" if estimator == "cispo" else "ppo_clip",
        "clip_low": eps_clip,
        "clip_high": eps_clip if high is None else high,
        # slime's CISPO has no dual clip: it ignores --eps-clip-c
        "dual_clip": None if estimator == "cispo" else _arg(args, "eps_clip_c"),
        # slime's GSPO differentiates the sequence ratio through its mean (its all-gather
        # under context parallelism is differentiable)
        "ratio_level": "sequence_mean" if estimator == "gspo" else "token",
        # slime's reducers: the token sum, or each sample's mean (summed over the samples;
        # slime's loss_function divides by the step's sample count)
        "aggregation": (
            "token_sum" if _arg(args, "calculate_per_token_loss", False) else "seq_mean_token_mean"
        ),
        "entropy_coef": _arg(args, "entropy_coef", 0.0),
        "opsm_delta": _arg(args, "opsm_delta") if _arg(args, "use_opsm", False) else None,
    }
    if _uses_kl(args):
        estimator_name, clamp = _KL[_arg(args, "kl_loss_type", "k1")]
        fields.update(
            kl_coef=_arg(args, "kl_loss_coef", 0.0),
            kl_estimator=estimator_name,
            kl_log_ratio_clamp=None,
            kl_value_clamp=clamp,
            kl_importance_weight=bool(_arg(args, "use_unbiased_kl", False)),
        )
    if mismatch_active(args):
        low, high = _arg(args, "tis_clip_low", 0.0), _arg(args, "tis_clip", 2.0)
        fields.update(mismatch_is="token", mismatch_is_cap=high)
        if _arg(args, "custom_tis_function_path") == _ICEPOP:
            fields["mismatch_token_mask"] = (low, high)  # a weight of 0 outside [low, high]
        elif low:
            fields["mismatch_is_floor"] = low
    return fields
