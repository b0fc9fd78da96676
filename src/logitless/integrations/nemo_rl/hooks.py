"""Where logitless meets NeMo RL's code: the functions it replaces, each where NeMo RL looks it
up at call time, and what each replacement does for a config that selects logitless
(anything else goes to NeMo RL's own function, with the same arguments).

Part of :mod:`logitless.integrations.nemo_rl` (whose docstring lists them as a table).
"""

from __future__ import annotations

import copyreg
import importlib
import inspect
import sys
from collections.abc import Callable
from typing import Any

from .forward import NEMO, STEP, Recorder, Step, fused_forward, logitless_output

__all__ = [
    "BACKEND",
    "KEY",
    "VALUE",
    "backend",
    "install",
    "installed",
    "mark",
    "selected",
    "uninstall",
]

#: The key of ``policy.megatron_cfg`` that selects the fused path's backend, and its value.
KEY = "fused_linear_logprobs_backend"
VALUE = "logitless"
#: ``policy.megatron_cfg`` key: hand the loss the entropy (``data["entropy"]``), differentiable.
ENTROPY_KEY = "fused_linear_logprobs_entropy"


class _Backend(str):
    """``"logitless"``, of a class of this package, pickled by reference to :data:`BACKEND`
    (``copyreg``, which Ray's cloudpickle follows too): unpickling it imports the package, and
    so installs it, in every process NeMo RL hands the config to."""

    __slots__ = ()


#: The value ``policy.megatron_cfg.fused_linear_logprobs_backend`` holds once marked; equal to
#: ``"logitless"``.
BACKEND = _Backend(VALUE)


def backend() -> _Backend:
    """:data:`BACKEND`: what unpickling a marked config calls."""
    return BACKEND


copyreg.pickle(_Backend, lambda _: (backend, ()))


def mark(policy_config: Any) -> None:
    """Store :data:`BACKEND` as the backend of a policy config that selects logitless, so every
    process the config is pickled to imports this package (``grpo.setup`` does it; call it on
    the policy config before NeMo RL's ``Policy`` is built in other algorithms' setups)."""
    if selected(policy_config):
        policy_config["megatron_cfg"][KEY] = BACKEND


_MODEL_UTILS = "nemo_rl.distributed.model_utils"
_TRAIN = "nemo_rl.models.megatron.train"
_SETUP = "nemo_rl.models.megatron.setup"
_GRPO = "nemo_rl.algorithms.grpo"

_ORIGINAL: dict[tuple[str, str], Any] = {}


def selected(config: Any) -> bool:
    """Whether a NeMo RL policy config sends its fused path to logitless:
    ``megatron_cfg.use_fused_linear_logprobs`` and ``megatron_cfg.fused_linear_logprobs_backend
    == "logitless"``."""
    megatron = (config or {}).get("megatron_cfg") or {}
    return bool(megatron.get("use_fused_linear_logprobs")) and megatron.get(KEY) == VALUE


def _module(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:  # this process does not run that part of NeMo RL (driver / worker)
        return None


def _replace(module, name: str, new: Callable[..., Any]) -> None:
    key = (module.__name__, name)
    if key not in _ORIGINAL:
        _ORIGINAL[key] = getattr(module, name)
        setattr(module, name, new)


def _original(module_name: str, name: str) -> Any:
    return _ORIGINAL[(module_name, name)]


def install(driver: bool = False) -> None:
    """Replace NeMo RL's functions (idempotent): the worker's (``model_utils``,
    ``megatron.train``, ``megatron.setup``) where this process can import them, and the
    driver's (``algorithms.grpo``) where it is imported already or ``driver`` (importing GRPO
    costs seconds a Megatron worker need not spend)."""
    model_utils = _module(_MODEL_UTILS)
    if model_utils is not None:
        NEMO.setdefault("forward", model_utils._gpt_forward_with_linear_ce_fusion)
        _replace(model_utils, "_gpt_forward_with_linear_ce_fusion", fused_forward)
    train = _module(_TRAIN)
    if train is not None:
        _replace(train, "forward_with_post_processing_fn", _forward_step)
        _replace(train, "apply_temperature_scaling", _temperature)
        _replace(train, "prepare_loss_input", _prepare(_TRAIN, "prepare_loss_input"))
        _replace(train, "prepare_packed_loss_input", _prepare(_TRAIN, "prepare_packed_loss_input"))
        _replace(train, "SequencePackingLossWrapper", _per_sequence(train))
    setup = _module(_SETUP)
    if setup is not None:
        _replace(setup, "_apply_parallelism_config", _lifted(_SETUP, "_apply_parallelism_config"))
        _replace(setup, "_create_megatron_config", _lifted(_SETUP, "_create_megatron_config"))
    grpo = _module(_GRPO) if driver or _GRPO in sys.modules else None
    if grpo is not None:
        _replace(grpo, "setup", _grpo_setup)


def uninstall() -> None:
    """Give NeMo RL back every function replaced here."""
    for (module_name, name), original in list(_ORIGINAL.items()):
        setattr(importlib.import_module(module_name), name, original)
        del _ORIGINAL[(module_name, name)]


def installed() -> bool:
    """Whether NeMo RL's fused forward is logitless's (in this process)."""
    model_utils = _module(_MODEL_UTILS)
    return model_utils is not None and model_utils._gpt_forward_with_linear_ce_fusion is (
        fused_forward
    )


# --- the worker: NeMo RL's forward step and loss preparation (megatron/train.py) ------------


def _forward_step(data_iterator, model, **kwargs: Any):
    """NeMo RL's ``forward_with_post_processing_fn``; for a loss or log-prob step of a config
    that selects logitless, run inside a :class:`~.forward.Step` (the sampler's settings, the
    micro-batch) that the fused forward reads."""
    train = importlib.import_module(_TRAIN)
    original = _original(_TRAIN, "forward_with_post_processing_fn")
    post = kwargs.get("post_processing_fn")
    kinds = (train.LossPostProcessor, train.LogprobsPostProcessor)
    cfg = getattr(post, "cfg", None)
    if not (kwargs.get("use_fused_linear_logprobs") and isinstance(post, kinds) and selected(cfg)):
        return original(data_iterator, model, **kwargs)
    sampling = kwargs.get("sampling_params")
    from nemo_rl.algorithms.logits_sampling_utils import need_top_k_or_top_p_filtering

    loss_fn = getattr(post, "loss_fn", None)
    kl = getattr(loss_fn, "reference_policy_kl_penalty", 0) != 0
    unfiltered = need_top_k_or_top_p_filtering(sampling) and kl
    entropy = isinstance(post, train.LossPostProcessor) and bool(
        cfg["megatron_cfg"].get(ENTROPY_KEY, False)
    )
    recorder = Recorder(data_iterator)
    token = STEP.set(Step(sampling, unfiltered, entropy, recorder))
    try:
        return original(recorder, model, **kwargs)
    finally:
        STEP.reset(token)


def _temperature(logits, sampling_params):
    """NeMo RL's ``apply_temperature_scaling``, except on logitless's log-probs: they are
    already those of ``softmax(logits / temperature)`` (NeMo RL's would divide log-probs)."""
    if logitless_output(logits) is not None:
        return logits
    return _original(_TRAIN, "apply_temperature_scaling")(logits, sampling_params)


def _prepare(module_name: str, name: str) -> Callable[..., Any]:
    """NeMo RL's ``prepare_loss_input`` / ``prepare_packed_loss_input``, with logitless's
    log-probs prepared by :func:`prepare_logitless`."""

    def prepare(logits, data, loss_fn, *args: Any, **kwargs: Any):
        if logitless_output(logits) is not None:
            return prepare_logitless(logits, data)
        return _original(module_name, name)(logits, data, loss_fn, *args, **kwargs)

    prepare.__name__ = prepare.__qualname__ = name
    return prepare


def prepare_logitless(logprobs, data) -> tuple[dict[str, Any], Any]:
    """NeMo RL's LOGPROB loss input from logitless's log-probs: ``next_token_logprobs`` cut to
    the micro-batch (``[B, S−1]``); under top-k / top-p the positions whose token fell outside
    the kept set masked out as NeMo RL masks them, and ``data["curr_logprobs_unfiltered"]``
    for its reference KL; ``data["entropy"]`` when asked for."""
    from nemo_rl.algorithms.utils import mask_out_neg_inf_logprobs

    extras = logitless_output(logprobs)
    n = data["input_ids"].shape[1] - 1
    out = logprobs[:, :n]
    if extras.filtered:
        mask = data["token_mask"] * data["sample_mask"].unsqueeze(-1)
        out = mask_out_neg_inf_logprobs(out, mask[:, 1:], "curr_logprobs")
        if extras.unfiltered is not None:
            data["curr_logprobs_unfiltered"] = extras.unfiltered[:, :n]
    if extras.entropy is not None:
        data["entropy"] = extras.entropy[:, :n]
    return {"next_token_logprobs": out}, data


def _per_sequence(train) -> type:
    """NeMo RL's ``SequencePackingLossWrapper`` (one sequence at a time, on slices of a
    packed row), taking logitless's log-probs, already unpacked, whole."""
    base = train.SequencePackingLossWrapper
    if getattr(base, "_logitless", False):
        return base

    class SequencePackingLossWrapper(base):
        _logitless = True

        def __call__(self, next_token_logits, data, global_valid_seqs, global_valid_toks):
            if logitless_output(next_token_logits) is None:
                return super().__call__(
                    next_token_logits, data, global_valid_seqs, global_valid_toks
                )
            loss_input, data = prepare_logitless(next_token_logits, data)
            return self.loss_fn(
                data=data, global_valid_seqs=global_valid_seqs,
                global_valid_toks=global_valid_toks, **loss_input,
            )  # fmt: skip

    return SequencePackingLossWrapper


# --- the worker's model setup (megatron/setup.py): the refusals of its own fused forward ------


def unfused(config: Any) -> Any:
    """``config`` as NeMo RL's checks of *its* fused forward should see it: a config that
    selects logitless reads ``use_fused_linear_logprobs=False`` there (a shallow copy)."""
    if not selected(config):
        return config
    megatron = {**config["megatron_cfg"], "use_fused_linear_logprobs": False}
    return {**config, "megatron_cfg": megatron}


def _lifted(module_name: str, name: str) -> Callable[..., Any]:
    """NeMo RL's ``_apply_parallelism_config`` (refuses context parallelism with the fused
    path) / ``_create_megatron_config`` (refuses ``overlap_param_gather``), run on
    :func:`unfused`'s view of the policy config: logitless's head runs inside
    ``output_layer``'s forward and splits documents over the context-parallel group."""
    module = importlib.import_module(module_name)
    original = _ORIGINAL.get((module_name, name)) or getattr(module, name)
    signature = inspect.signature(original)

    def lifted(*args: Any, **kwargs: Any):
        bound = signature.bind(*args, **kwargs)
        bound.arguments["config"] = unfused(bound.arguments["config"])
        return _original(module_name, name)(*bound.args, **bound.kwargs)

    lifted.__name__ = lifted.__qualname__ = name
    lifted.__signature__ = signature
    return lifted


# --- the driver: GRPO's setup (algorithms/grpo.py) ------------------------------------------


def _grpo_setup(*args: Any, **kwargs: Any):
    """NeMo RL's ``grpo.setup``. For a policy config that selects logitless, its refusals of
    sequence packing and top-k / top-p with *its* fused forward are passed (the policy config
    reads ``use_fused_linear_logprobs=False`` until the policy is built: the workers see
    ``True``, and the returned loss function has it set); the backend's value becomes
    :data:`~logitless.integrations.nemo_rl.BACKEND`, which imports logitless in every process
    the config is sent to."""
    original = _original(_GRPO, "setup")
    bound = inspect.signature(original).bind(*args, **kwargs)
    policy = bound.arguments["master_config"].policy
    if not selected(policy):
        return original(*args, **kwargs)
    grpo = importlib.import_module(_GRPO)
    make = bound.arguments.get("policy_factory") or grpo.Policy
    megatron = policy["megatron_cfg"]

    def policy_factory(*a: Any, **kw: Any):
        megatron["use_fused_linear_logprobs"] = True
        mark(kw.get("config", policy))
        return make(*a, **kw)

    bound.arguments["policy_factory"] = policy_factory
    megatron["use_fused_linear_logprobs"] = False
    try:
        out = original(*bound.args, **bound.kwargs)
    finally:
        megatron["use_fused_linear_logprobs"] = True
    out[6].use_fused_linear_logprobs = True  # the loss function (grpo.setup's 7th result)
    return out
