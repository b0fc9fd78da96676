"""The HF integration's vision-language side: which multimodal classes are audited, and the
checks of their image inputs before the backbone runs.

Package-internal (:mod:`~logitless.integrations.hf.model` reads :data:`AUDITED` for its model
table and calls :func:`check_backbone_inputs` before every backbone call). It imports no other
integration module.

A vision-language class of transformers runs, in its forward, ``self.model(input_ids,
pixel_values=..., ..., position_ids=..., attention_mask=...)`` (the vision tower, the projector,
the image features scattered into the image-token positions of the embeddings, then the
language model with its final norm) and then ``logits = self.lm_head(hidden)``: the head is the
same linear layer as a text model's, what differs is the backbone call. Each entry of
:data:`AUDITED` names the forward's own image / video arguments, which pass to ``model.model``
by their own names; any multimodal name the class does not take is refused (its backbone would
drop it through ``**kwargs`` and return the hidden states of the text alone).

Read in transformers 5.24's modeling files:

- ``Qwen2VLForConditionalGeneration``, ``Qwen2_5_VLForConditionalGeneration``,
  ``Qwen3VLForConditionalGeneration`` and ``Qwen3VLMoeForConditionalGeneration``:
  ``logits = lm_head(model(...).last_hidden_state)``, no transform; the MoE one adds the
  router's load-balancing loss with ``config.text_config``'s counts and weight. Rotary position
  ids are multimodal: ``[3, B, T]`` (temporal, height, width; ``model.model.get_rope_index``)
  or ``[4, B, T]`` with the text positions first (what a packed row passes, so attention stops
  at document ends); ``None`` lets the model compute them from ``mm_token_type_ids`` and the
  grids. A 2-D ``position_ids`` is accepted by the model and broadcast to the three sections,
  which gives other hidden states than the processor's inputs: refused.
- ``Qwen3_5ForConditionalGeneration`` and ``Qwen3_5MoeForConditionalGeneration`` (Qwen3.5):
  as Qwen3-VL (``logits = lm_head(hidden)``, no transform; the same image / video names, rope
  and ``get_rope_index``, a video one run per frame; the MoE one adds the router loss with
  ``config.text_config``'s ``num_experts``, ``num_experts_per_tok``,
  ``router_aux_loss_coef``). The language model is a hybrid: Gated DeltaNet linear-attention
  layers (a causal convolution and a recurrent state along the row; transformers' torch
  fallback runs them on CPU, in float32 whatever the model's dtype) between attention layers.
  Its forward keeps packed documents apart only in the attention layers (the text row of
  ``[4, B, T]`` position ids masks them); the linear-attention layers take no document
  boundaries, so a packed row is refused (one document per row; padding is zeroed before
  those layers).
- ``Glm4vForConditionalGeneration`` and ``Glm4vMoeForConditionalGeneration`` (GLM-4.1V,
  GLM-4.5V): ``logits = lm_head(hidden)``, no transform; the Qwen image / video names and
  ``[3, B, T]`` / ``[4, B, T]`` rope (``get_rope_index`` splits a video into frames: one run
  of placeholders per frame). A video's placeholders are **image** tokens
  (``image_token_id``; the processor marks them 2 in ``mm_token_type_ids``), and the forward
  scatters images into every image token and videos into every image token: a call with both
  fails in transformers, so one with both is refused. The MoE one adds the router loss with
  ``config.text_config.num_local_experts``.
- ``Gemma3ForConditionalGeneration``: ``logits = lm_head(hidden)`` with **no** final-logit
  soft-capping, although its text config may carry ``final_logit_softcapping`` (the text-only
  ``Gemma3ForCausalLM`` applies it; this class's forward does not). ``token_type_ids`` (1 at
  image tokens) makes attention bidirectional within an image.
- ``LlavaForConditionalGeneration``: ``logits = lm_head(hidden)``; the image features come
  from the vision tower's ``vision_feature_layer`` (by default the one before the last).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

from ...contract.checks import fmt_shape as _shape

__all__ = [
    "AUDITED",
    "MULTIMODAL_INPUTS",
    "VisionLanguage",
    "audited",
    "check_backbone_inputs",
    "moe_router",
    "text_positions",
]


def _none(model: nn.Module) -> tuple[float | None, float]:
    return None, 1.0


class VisionLanguage(NamedTuple):
    """An audited vision-language class: what its forward does after ``lm_head`` (softcap,
    logit scale), its image / video arguments, whether its rope position ids are multimodal
    (``[3, B, T]``), the check of its image inputs against ``input_ids``, and, for an MoE
    class, the text-config attribute its forward reads as the expert count of its router
    loss. (Whether a row may hold several packed documents is :data:`RECURRENT_ROWS`', for
    text and vision-language classes alike.)"""

    transform: Callable[[nn.Module], tuple[float | None, float]]
    inputs: frozenset[str]
    mrope: bool
    check: Callable[[nn.Module, torch.Tensor, torch.Tensor | None, Mapping[str, Any]], None]
    experts: str = "num_experts"


def _count(input_ids: torch.Tensor, token_id: int, attention_mask: torch.Tensor | None) -> int:
    hits = input_ids == token_id
    if attention_mask is not None:
        hits = hits & attention_mask.bool()
    return int(hits.sum())


def _tensor(name: str, t: object, input_ids: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {_shape(t)}")
    if t.device != input_ids.device:
        raise ValueError(f"{name} must be on input_ids' device {input_ids.device}, got {t.device}")
    return t


def _pair(
    kwargs: Mapping[str, Any],
    pixels: str,
    what: str,
    token_id: int,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
) -> int:
    """The number of ``what`` placeholder tokens of ``input_ids``; refuses placeholders without
    ``pixels`` and ``pixels`` without placeholders (either would give a silently wrong row)."""
    tokens = _count(input_ids, token_id, attention_mask)
    given = kwargs.get(pixels) is not None
    if tokens and not given:
        raise ValueError(
            f"input_ids holds {tokens} {what} tokens (id {token_id}) but {pixels} is not given: "
            f"the model would embed them as text. Pass the processor's {pixels}"
        )
    if given and not tokens:
        raise ValueError(
            f"{pixels} is given but input_ids holds no {what} token (id {token_id}, outside "
            "padding): the features would have nowhere to go"
        )
    return tokens


def _placeholders(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    kwargs: Mapping[str, Any],
    shared: bool,
) -> tuple[int, int, dict[str, int]]:
    """The image and video placeholder tokens of ``input_ids`` (paired with their pixel
    values, :func:`_pair`) and the token id of each kind; ``shared``: see
    :func:`_check_qwen`."""
    cfg = model.config
    video_id = cfg.image_token_id if shared else cfg.video_token_id
    ids = {"image": cfg.image_token_id, "video": video_id}
    if not shared:
        image = _pair(kwargs, "pixel_values", "image", ids["image"], input_ids, attention_mask)
        video = _pair(kwargs, "pixel_values_videos", "video", video_id, input_ids, attention_mask)
        return image, video, ids
    if all(kwargs.get(k) is not None for k in ("pixel_values", "pixel_values_videos")):
        raise ValueError(
            f"pixel_values and pixel_values_videos given together, but {type(model).__name__} "
            f"places images and videos at the same token id (image_token_id "
            f"{cfg.image_token_id}) and its forward scatters each into all of them "
            "(transformers raises on the count): pass images and videos in separate calls"
        )
    if kwargs.get("pixel_values_videos") is not None:
        video = _pair(kwargs, "pixel_values_videos", "video", video_id, input_ids, attention_mask)
        return 0, video, ids
    return _pair(kwargs, "pixel_values", "image", ids["image"], input_ids, attention_mask), 0, ids


def _check_qwen(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    kwargs: Mapping[str, Any],
    frames: bool = False,
    shared: bool = False,
) -> None:
    """Qwen's image and video inputs; ``frames``: a video is one run of placeholder tokens per
    temporal patch (Qwen3-VL puts a timestamp before each frame), else one run per video.
    ``shared``: a video's placeholders are image tokens too (GLM-4V; ``mm_token_type_ids``
    marks them 2), and the forward scatters each of images and videos into every image token,
    so one call takes images or videos, not both."""
    cfg = model.config
    merge = int(cfg.vision_config.spatial_merge_size)
    image, video, ids = _placeholders(model, input_ids, attention_mask, kwargs, shared)
    for kind, tokens, pixels, grid_name in (
        ("image", image, "pixel_values", "image_grid_thw"),
        ("video", video, "pixel_values_videos", "video_grid_thw"),
    ):
        grid = kwargs.get(grid_name)
        if (grid is None) != (kwargs.get(pixels) is None):
            missing = grid_name if grid is None else pixels
            raise ValueError(
                f"{missing} must be given with {pixels if grid is None else grid_name}"
            )
        if grid is None:
            continue
        grid = _tensor(grid_name, grid, input_ids, dim=2)
        if grid.shape[1] != 3 or grid.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"{grid_name} must be an integer [num_{kind}s, 3] tensor (t, h, w patches), got "
                f"dtype {grid.dtype} and shape {_shape(grid)}"
            )
        if bool((grid <= 0).any()) or bool((grid[:, 1:] % merge != 0).any()):
            raise ValueError(
                f"{grid_name} must hold positive (t, h, w) with h and w multiples of the "
                f"spatial merge size {merge}, got {grid.tolist()}"
            )
        patches = grid.prod(-1)
        pix = _tensor(pixels, kwargs[pixels], input_ids, dim=2)
        if pix.shape[0] != int(patches.sum()):
            raise ValueError(
                f"{pixels} must have one row per patch of {grid_name}: {int(patches.sum())} "
                f"rows, got shape {_shape(pix)}"
            )
        per = (patches // (merge * merge)).tolist()
        if sum(per) != tokens:
            raise ValueError(
                f"{grid_name} describes {sum(per)} {kind} tokens ({per} after the {merge}x{merge} "
                f"merge), but input_ids holds {tokens} (id {ids[kind]})"
            )
        if kind == "video" and frames:
            per = [n // t for n, t in zip(per, grid[:, 0].tolist(), strict=True) for _ in range(t)]
        runs = _runs(input_ids, ids[kind], attention_mask)
        if runs != per:
            each = "frames" if kind == "video" and frames else f"{kind}s"
            raise ValueError(
                f"{grid_name} does not match input_ids' {kind}s: in row order its {each} have "
                f"{per} tokens, the runs of {kind} tokens in input_ids {runs}"
            )
    kinds = {1: cfg.image_token_id, 2: cfg.video_token_id}
    if shared:  # the kind of this call's media at the image tokens
        kinds = {2 if video else 1: cfg.image_token_id}
    _check_type_ids(
        "mm_token_type_ids", kwargs, input_ids, kinds,
        required=(image or video) and kwargs.get("position_ids") is None,
    )  # fmt: skip


def _runs(input_ids: torch.Tensor, token_id: int, attention_mask: torch.Tensor | None) -> list:
    """The lengths of the runs of ``token_id`` in ``input_ids``, row-major (padding skipped)."""
    out = []
    for b in range(input_ids.shape[0]):
        row = input_ids[b]
        if attention_mask is not None:
            row = row[attention_mask[b].bool()]
        hits = torch.cat([row.new_zeros(1), (row == token_id).long(), row.new_zeros(1)])
        edges = hits.diff()
        starts, ends = (edges == 1).nonzero().squeeze(1), (edges == -1).nonzero().squeeze(1)
        out += (ends - starts).tolist()
    return out


def _check_type_ids(
    name: str,
    kwargs: Mapping[str, Any],
    input_ids: torch.Tensor,
    kinds: dict[int, int],
    required: bool,
) -> None:
    """``name`` (``[B, T]``: ``k`` at the tokens ``kinds[k]``, 0 elsewhere) agrees with
    ``input_ids``; ``required``: it must be given."""
    t = kwargs.get(name)
    if t is None:
        if required:
            raise ValueError(
                f"{name} must be given with image or video inputs (the processor returns it; "
                "the model builds its multimodal rope positions from it)"
            )
        return
    t = _tensor(name, t, input_ids)
    if t.shape != input_ids.shape:
        raise ValueError(f"{name} must have input_ids' shape {_shape(input_ids)}, got {_shape(t)}")
    expected = torch.zeros_like(input_ids)
    for k, token_id in kinds.items():
        expected = torch.where(input_ids == token_id, k, expected)
    if not torch.equal(t.to(expected.dtype), expected):
        marks = ", ".join(f"{k} at token id {i}" for k, i in kinds.items())
        raise ValueError(f"{name} must be {marks} and 0 elsewhere; it disagrees with input_ids")


def _fixed_images(
    per_image: Callable[[Any, Mapping[str, Any]], int | None], type_ids: str | None = None
) -> Callable[[nn.Module, torch.Tensor, torch.Tensor | None, Mapping[str, Any]], None]:
    """The check of a class whose images are ``[N, C, H, W]`` pixel values of
    ``per_image(config, kwargs)`` placeholder tokens each (None: not fixed, only paired), with
    ``type_ids`` (1 at the image tokens) when it takes them."""

    def check(
        model: nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        kwargs: Mapping[str, Any],
    ) -> None:
        cfg = model.config
        token_id = cfg.image_token_id
        tokens = _pair(kwargs, "pixel_values", "image", token_id, input_ids, attention_mask)
        pix = kwargs.get("pixel_values")
        if pix is not None:
            pix = _tensor("pixel_values", pix, input_ids, dim=4)
            n = per_image(cfg, kwargs)
            if n is not None and tokens != pix.shape[0] * n:
                raise ValueError(
                    f"pixel_values holds {pix.shape[0]} images of {n} tokens each, but "
                    f"input_ids holds {tokens} image tokens (id {token_id})"
                )
        if type_ids is not None:
            _check_type_ids(type_ids, kwargs, input_ids, {1: token_id}, required=False)

    return check


def _llava_tokens(cfg: Any, kwargs: Mapping[str, Any]) -> int | None:
    """A LLaVA image's tokens: its vision tower's patch grid (CLIP with the "full" feature
    strategy keeps the class token); None for a tower without a fixed grid."""
    vision = cfg.vision_config
    if vision.model_type not in ("clip_vision_model", "siglip_vision_model"):
        return None
    per_image = (vision.image_size // vision.patch_size) ** 2
    strategy = kwargs.get("vision_feature_select_strategy")
    strategy = cfg.vision_feature_select_strategy if strategy is None else strategy
    if strategy == "full" and vision.model_type == "clip_vision_model":
        per_image += 1  # CLIP's class token is kept
    return per_image


_QWEN_INPUTS = frozenset(
    {"pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw", "mm_token_type_ids"}
)
_QWEN = VisionLanguage(_none, _QWEN_INPUTS, True, _check_qwen)
_QWEN3 = _QWEN._replace(check=functools.partial(_check_qwen, frames=True))
_GLM4V = _QWEN._replace(check=functools.partial(_check_qwen, frames=True, shared=True))

#: Audited vision-language class -> what its forward does and takes (see the module doc).
AUDITED: dict[str, VisionLanguage] = {
    "Qwen2VLForConditionalGeneration": _QWEN,
    "Qwen2_5_VLForConditionalGeneration": _QWEN._replace(
        inputs=_QWEN_INPUTS | {"second_per_grid_ts"}
    ),
    "Qwen3VLForConditionalGeneration": _QWEN3,
    "Qwen3VLMoeForConditionalGeneration": _QWEN3,
    "Qwen3_5ForConditionalGeneration": _QWEN3,
    "Qwen3_5MoeForConditionalGeneration": _QWEN3,
    "Glm4vForConditionalGeneration": _GLM4V,
    "Glm4vMoeForConditionalGeneration": _GLM4V._replace(experts="num_local_experts"),
    "Gemma3ForConditionalGeneration": VisionLanguage(
        _none,
        frozenset({"pixel_values", "token_type_ids"}),
        False,
        _fixed_images(lambda cfg, _: cfg.mm_tokens_per_image, "token_type_ids"),
    ),
    "LlavaForConditionalGeneration": VisionLanguage(
        _none,
        frozenset(
            {
                "pixel_values",
                "image_sizes",
                "vision_feature_layer",
                "vision_feature_select_strategy",
            }
        ),
        False,
        _fixed_images(_llava_tokens),
    ),
}

#: Every image / video argument name of the audited classes: refused for a model that does not
#: take it (a text model's backbone would drop it and return the text's hidden states alone).
MULTIMODAL_INPUTS: frozenset[str] = frozenset().union(
    *(v.inputs for v in AUDITED.values()),
    # and those of classes not audited that trainers pass (TRL: LFM2-VL, InternVL, Gemma-4)
    {"pixel_attention_mask", "spatial_shapes", "image_position_ids", "mm_encoder_outputs"},
)


def text_positions(position_ids: torch.Tensor | None) -> torch.Tensor | None:
    """The ``[B, T]`` text positions that say where documents start: 2-D position ids
    themselves, row 0 of ``[4, B, T]`` multimodal ones (transformers' packed form: text
    positions, then the three rope sections), None for ``[3, B, T]`` (whose sections do not
    restart per document: each row is one sequence, as the model's attention treats it)."""
    if position_ids is None or position_ids.dim() == 2:
        return position_ids
    return position_ids[0] if position_ids.shape[0] == 4 else None


def _check_position_ids(
    name: str, spec: VisionLanguage | None, position_ids: object, input_ids: torch.Tensor
) -> None:
    if position_ids is None:
        return
    if not isinstance(position_ids, torch.Tensor):
        raise ValueError(f"position_ids must be a torch.Tensor, got {type(position_ids).__name__}")
    if spec is not None and spec.mrope:
        want = "[3, B, T] (or [4, B, T], text positions first, for packed rows)"
        ok = position_ids.dim() == 3 and position_ids.shape[0] in (3, 4)
        ok = ok and position_ids.shape[1:] == input_ids.shape
        if not ok:
            hint = ""
            if position_ids.dim() == 2:
                hint = (
                    ": 2-D position ids are broadcast to the three rope sections and give other "
                    "hidden states than the processor's inputs (cu_seqlens gives 2-D ones: pass "
                    "[4, 1, T] position ids instead). Pass model.model.get_rope_index(...)[0], or "
                    "None to let the model compute them"
                )
            raise ValueError(
                f"{name} uses multimodal rotary positions: position_ids must have shape {want} "
                f"with input_ids' [B, T] = {_shape(input_ids)}, got {_shape(position_ids)}{hint}"
            )
    elif position_ids.shape != input_ids.shape:
        raise ValueError(
            f"position_ids must have input_ids' shape {_shape(input_ids)} for {name}, got "
            f"{_shape(position_ids)}"
        )


def _check_one_document_per_row(
    name: str, position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None
) -> None:
    """Refuses packed rows (text positions restarting at 0 within a row) for a class whose
    linear-attention layers carry their recurrent state along the whole row."""
    text = text_positions(position_ids)
    if text is None:
        return
    starts = text == 0
    if attention_mask is not None:
        starts = starts & attention_mask.bool()
    if bool((starts.sum(-1) > 1).any()):
        raise ValueError(
            f"position_ids' text positions restart within a row (packed documents), but "
            f"{name}'s linear-attention layers (Gated DeltaNet: a convolution and a recurrent "
            "state along the row) take no document boundaries in its forward: each document "
            "would read the one before it. Pass one document per row (padding and an "
            "attention_mask)"
        )


#: The audited classes (text and vision-language) whose language model carries a recurrent
#: state along the whole row: Gated DeltaNet linear-attention layers (a causal convolution and
#: a recurrence) between the attention layers, which take no document boundaries in the HF
#: forward (transformers 5.24: the Qwen3.5 and Qwen3-Next text models hand the layers no
#: ``cu_seqlens``; the attention layers alone keep packed documents apart). A row must hold one
#: document; verl's forward, which hands those layers the row's ``cu_seqlens``, is the exception
#: (``check_backbone_inputs(boundaries=True)``).
RECURRENT_ROWS: frozenset[str] = frozenset({
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM",
    "Qwen3NextForCausalLM",
})  # fmt: skip


def _recurrent_rows(model: nn.Module) -> bool:
    return any(c.__name__ in RECURRENT_ROWS for c in type(model).__mro__)


def audited(model: nn.Module) -> VisionLanguage | None:
    """The :data:`AUDITED` entry of ``model``'s class (or of a base of it); None for a text
    model."""
    return next((AUDITED[c.__name__] for c in type(model).__mro__ if c.__name__ in AUDITED), None)


class BackboneInputs(NamedTuple):
    """What a transformers backbone (``model.model``) is called with: ``input_ids`` ``[B, T]``,
    the ``attention_mask`` and ``position_ids`` it gets (``[B, T]``, or a multimodal rope's
    ``[3, B, T]`` / verl's ``[4, B, T]``), and its other keyword arguments (image inputs, a
    flash-attention varlen argument, ...)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    kwargs: Mapping[str, Any] = {}


def check_backbone_inputs(
    model: nn.Module, inputs: BackboneInputs, boundaries: bool = False
) -> None:
    """What the backbone of ``model`` (unwrapped, audited) gets, checked before it runs: the
    multimodal arguments it takes and only those; for a vision-language class, image tokens in
    ``input_ids`` with their pixel values and the reverse, grids and per-image token counts
    that match, the type ids, position ids of the rank its rope takes, and one document per
    row for a class that cannot keep packed documents apart (``boundaries``: the backbone is
    given the documents' boundaries, verl's ``cu_seqlens`` to its Qwen3.5 forward)."""
    input_ids, attention_mask, position_ids, model_kwargs = inputs
    name = type(model).__name__
    spec = audited(model)
    taken = spec.inputs if spec is not None else frozenset()
    foreign = sorted(k for k in MULTIMODAL_INPUTS - taken if model_kwargs.get(k) is not None)
    if foreign:
        raise ValueError(
            f"{', '.join(foreign)} given, but {name} does not take "
            f"{'them' if len(foreign) > 1 else 'it'}: its backbone would drop "
            f"{'them' if len(foreign) > 1 else 'it'} and return the hidden states of the text "
            "alone" + ("" if spec is None else f" ({name} takes {', '.join(sorted(spec.inputs))})")
        )
    _check_position_ids(name, spec, position_ids, input_ids)
    mask = attention_mask if isinstance(attention_mask, torch.Tensor) else None
    if not boundaries and _recurrent_rows(model):
        _check_one_document_per_row(name, position_ids, mask)
    if spec is not None:
        spec.check(model, input_ids, mask, {**model_kwargs, "position_ids": position_ids})


def moe_router(model: nn.Module) -> tuple[int, int, float]:
    """An MoE model's ``(num_experts, experts per token, router_aux_loss_coef)`` as its forward
    reads them: its own attributes for the text classes, its text config for the
    vision-language ones (Qwen3-VL-MoE's and Qwen3.5-MoE's forwards read
    ``config.text_config.num_experts``, GLM-4V-MoE's ``num_local_experts``)."""
    if type(model).__name__ in AUDITED:
        text = model.config.get_text_config()
        return (
            int(getattr(text, AUDITED[type(model).__name__].experts)),
            int(text.num_experts_per_tok),
            float(text.router_aux_loss_coef),
        )
    return int(model.num_experts), int(model.num_experts_per_tok), float(model.router_aux_loss_coef)
