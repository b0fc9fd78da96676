"""The HF functions refuse logitless's own option names in ``**model_kwargs``.

Their ``**model_kwargs`` go to the model's backbone, and transformers' backbones drop names
they do not know: ``causal_lm_divergence(student, teacher, ids, top_k=5)`` used to return the
divergence without ``top_k``, ``causal_lm_policy_loss(..., teacher=t, distill_beta=0.5)`` the
forward KL. Every name that is a parameter of a public logitless function or class (restated
here from the signatures, independently of the rule in ``hf``) and that the called function
does not take raises ``TypeError`` naming it, before any backbone runs; names the backbones
take still reach them.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")

import logitless  # noqa: E402
from logitless import PolicyLossConfig  # noqa: E402
from logitless.integrations import hf  # noqa: E402
from logitless.integrations.hf import functions as hf_functions  # noqa: E402

V = 50


def _tiny(width: int = 16):
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(
            vocab_size=V,
            hidden_size=width,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )  # fmt: skip
    ).eval()


@pytest.fixture(scope="module")
def models():
    student, teacher = _tiny(16), _tiny(24)
    calls = []
    for m in (student, teacher):  # count backbone calls: a refused call makes none
        m.model.register_forward_pre_hook(lambda *_: calls.append(1))
    return student, teacher, calls


IDS = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(0))

# Each HF function that takes **model_kwargs, called with the arguments it needs.
CALLS = {
    "causal_lm_logprobs": lambda s, t, **kw: hf.causal_lm_logprobs(s, IDS, **kw),
    "causal_lm_policy_loss": lambda s, t, **kw: hf.causal_lm_policy_loss(
        s, IDS, torch.zeros(2, 6), torch.ones(2), config=PolicyLossConfig(), **kw
    ),
    "causal_lm_divergence": lambda s, t, **kw: hf.causal_lm_divergence(s, t, IDS, **kw),
    "causal_lm_hidden_states": lambda s, t, **kw: hf.causal_lm_hidden_states(s, IDS, **kw),
}


def _keyword_names(obj) -> set[str]:
    """The keyword-passable parameters of a function or class (a module: its constructor and
    forward; a dataclass or NamedTuple: its fields)."""
    if dataclasses.is_dataclass(obj):
        return {f.name for f in dataclasses.fields(obj)}
    targets = (
        [obj.__init__, obj.forward] if isinstance(obj, type) and hasattr(obj, "forward") else [obj]
    )
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {
        p.name
        for t in targets
        for p in inspect.signature(t).parameters.values()
        if p.kind in kinds and p.name != "self"
    }


def _public_names() -> set[str]:
    objs = [getattr(logitless, n) for n in logitless.__all__]
    objs += [getattr(hf, n) for n in hf.__all__]
    names = set()
    for obj in objs:
        if callable(obj):
            names |= _keyword_names(obj)
    # the module forms' **options are the head and sampler options
    from logitless.contract.options import HeadKwargs

    return names | set(HeadKwargs.__annotations__)


PUBLIC = sorted(_public_names())


def test_the_names_restated_here_are_the_rules():
    """This file's restatement and the rule in hf see the same names (so the sweep below
    covers every name the rule refuses); the issue's examples among them."""
    assert set(PUBLIC) <= set(hf_functions._LOGITLESS_NAMES)
    assert {"top_k", "capturable", "teacher_softcap", "distill_beta", "beta"} <= set(PUBLIC)
    config_fields = {f.name for f in dataclasses.fields(PolicyLossConfig)}
    assert config_fields <= set(PUBLIC)


@pytest.mark.parametrize(
    "function, name",
    [
        ("causal_lm_divergence", "top_k"),
        ("causal_lm_divergence", "capturable"),
        ("causal_lm_divergence", "teacher_softcap"),
        ("causal_lm_divergence", "distill_beta"),
        ("causal_lm_logprobs", "teacher"),
        ("causal_lm_logprobs", "beta"),
        ("causal_lm_policy_loss", "with_entropy"),
        ("causal_lm_hidden_states", "cu_seqlens"),
    ],
)
def test_the_reported_names_raise_before_the_backbone(function, name, models):
    student, teacher, calls = models
    calls.clear()
    with pytest.raises(
        TypeError, match=rf"{function}\(\) got an unexpected keyword argument '{name}'"
    ):
        CALLS[function](student, teacher, **{name: 1})
    assert not calls


def test_policy_loss_with_a_teacher_refuses_distill_beta_before_either_backbone(models):
    """The forward KL used to come back as if beta 0.5 had been applied."""
    student, teacher, calls = models
    calls.clear()
    with pytest.raises(TypeError, match=r"distill_beta.*config=PolicyLossConfig\(distill_beta"):
        hf.causal_lm_policy_loss(
            student, IDS, torch.zeros(2, 6), torch.ones(2), config=PolicyLossConfig(),
            teacher=teacher, distill_beta=0.5,
        )  # fmt: skip
    assert not calls


def test_the_divergence_points_distill_beta_to_its_beta(models):
    student, teacher, _ = models
    with pytest.raises(TypeError, match=r"'distill_beta'.*own interpolation is beta="):
        hf.causal_lm_divergence(student, teacher, IDS, distill_beta=0.5)


@pytest.mark.parametrize("function", list(CALLS))
def test_every_logitless_name_the_function_does_not_take_raises(function, models):
    student, teacher, calls = models
    takes = _keyword_names(getattr(hf, function))
    calls.clear()
    for name in PUBLIC:
        if name in takes or name in hf_functions._RESERVED_KWARGS:  # its own, or reserved
            continue
        with pytest.raises(TypeError, match=f"'{name}'"):
            CALLS[function](student, teacher, **{name: object()})
    assert not calls


def test_a_new_option_is_known_without_a_list(monkeypatch):
    """The names come from the signatures: a new entry point's option (as ``batch_invariant``
    will be) is refused with no change to hf."""

    def new_entry(hidden, weight, labels, *, a_brand_new_option: bool = False):
        return hidden

    monkeypatch.setattr(logitless, "new_entry", new_entry, raising=False)
    monkeypatch.setattr(logitless, "__all__", [*logitless.__all__, "new_entry"])
    names = hf_functions._logitless_names()
    assert names["a_brand_new_option"] == ("logitless.new_entry",)
    assert "a_brand_new_option" not in hf_functions._LOGITLESS_NAMES  # computed once, at import


def test_no_known_name_is_a_backbone_argument():
    """No name the rule refuses is one the supported models' backbones take (beyond the
    inputs every HF function declares itself): the rule never blocks a real model argument."""
    from transformers.modeling_flash_attention_utils import FlashAttentionKwargs
    from transformers.utils import TransformersKwargs

    backbone = set(FlashAttentionKwargs.__annotations__) | set(TransformersKwargs.__annotations__)
    for name in hf.SUPPORTED_MODELS:
        base = getattr(transformers, name.replace("ForCausalLM", "Model"))
        backbone |= set(inspect.signature(base.forward).parameters)
    # the inputs every HF function declares, and labels (refused: its own ValueError)
    declared = {"input_ids", "attention_mask", "position_ids", "labels"}
    assert backbone & set(hf_functions._LOGITLESS_NAMES) == declared


def test_backbone_arguments_still_reach_the_backbone(models):
    student, teacher, _ = models
    seen = {}

    def spy(module, args, kwargs):
        seen.update(kwargs)

    handle = student.model.register_forward_pre_hook(spy, with_kwargs=True)
    try:
        hf.causal_lm_logprobs(student, IDS, output_attentions=False)
    finally:
        handle.remove()
    assert seen["output_attentions"] is False
