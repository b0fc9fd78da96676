"""logitless.integrations.hf on vision-language models, against the model's own logits and
float64.

For tiny random-weight models of each audited vision-language class, built from configs
(nothing is downloaded), with image prompts:

op     = hf.causal_lm_logprobs / causal_lm_policy_loss / causal_lm_divergence (backbone with the
         image inputs, then the logitless head)
ref    = model(input_ids, pixel_values=..., ...).logits -> float -> /T -> log_softmax -> gather
truth  = the same reference on copy.deepcopy(model).double() (pixel values in float64)

Log-probs, entropy, the loss and its metrics, and the gradient of every parameter (the vision
tower's and the projector's included; Gemma-3's projector, zero at init, is made non-zero) under
random upstream gradients: |op - truth| within 4x |ref - truth| plus the floors of
tests/test_hf.py (tests/_tolerance.py). Layouts: left and right padding (Qwen: the model's own
multimodal positions from ``mm_token_type_ids``, and explicit ``[3, B, T]`` ones) and packed rows
(Qwen: ``[4, 1, T]`` position ids, text positions first; Gemma-3 and LLaVA: 2-D ones restarting
per document). Mutation checked: the image inputs not passed to the backbone fails every
comparison here.
"""

from __future__ import annotations

import copy
import inspect
import re

import pytest
import torch
from _tolerance import assert_no_worse_than_reference
from test_hf import IGNORE, _from_logits, _grads
from test_hf_distill import _divergence as _divergence_reference

from logitless import PolicyLossConfig, policy_loss
from logitless.integrations import hf
from logitless.integrations.hf import vlm as hf_vlm

transformers = pytest.importorskip("transformers")

V = 256
IMAGE, VIDEO, VISION_START = 250, 251, 252
_TEXT = dict(
    vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8,
)  # fmt: skip
_QWEN_VISION = dict(
    depth=1, hidden_size=32, num_heads=2, patch_size=2, spatial_merge_size=2,
    temporal_patch_size=2, in_channels=3,
)  # fmt: skip
_MROPE = dict(mrope_section=[1, 1, 2])  # head_dim 8: 4 rotary frequencies

# name -> the transformers class the integration must recognise
VLM_MODELS = {
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
    "glm4v": "Glm4vForConditionalGeneration",
    "glm4v_moe": "Glm4vMoeForConditionalGeneration",
    "gemma3": "Gemma3ForConditionalGeneration",
    "llava": "LlavaForConditionalGeneration",
}
# the classes with Qwen's image inputs (grids, mm_token_type_ids) and multimodal rope
QWEN = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "glm4v")
QWEN += ("glm4v_moe",)
# hybrid linear-attention models: one document per row (a packed row is refused)
RECURRENT = ("qwen3_5", "qwen3_5_moe")
GLM_VIDEO_START, GLM_VIDEO_END = 254, 255


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _config(name: str, **moe):
    t = transformers
    qwen = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VISION_START)
    qwen3_vision = dict(
        _QWEN_VISION, intermediate_size=64, out_hidden_size=32, num_position_embeddings=16,
        deepstack_visual_indexes=[0],
    )  # fmt: skip
    qwen3_rope = dict(rope_scaling=dict(rope_type="default", mrope_interleaved=True, **_MROPE))
    if name == "qwen2_vl":
        return t.Qwen2VLConfig(
            text_config=dict(_TEXT, rope_scaling=dict(type="mrope", **_MROPE)),
            vision_config=dict(_QWEN_VISION, embed_dim=32, mlp_ratio=2), **qwen,
        )  # fmt: skip
    if name == "qwen2_5_vl":
        vision = dict(
            _QWEN_VISION, intermediate_size=64, out_hidden_size=32, window_size=8,
            fullatt_block_indexes=[0],
        )  # fmt: skip
        return t.Qwen2_5_VLConfig(
            text_config=dict(_TEXT, rope_scaling=dict(type="mrope", **_MROPE)),
            vision_config=vision, **qwen,
        )  # fmt: skip
    if name == "qwen3_vl":
        return t.Qwen3VLConfig(
            text_config=dict(_TEXT, **qwen3_rope), vision_config=qwen3_vision, **qwen
        )
    if name == "qwen3_vl_moe":
        text = dict(
            _TEXT, **qwen3_rope, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            decoder_sparse_step=1, router_aux_loss_coef=0.02, **moe,
        )  # fmt: skip
        return t.Qwen3VLMoeConfig(text_config=text, vision_config=qwen3_vision, **qwen)
    if name.startswith("qwen3_5"):
        text = dict(
            _TEXT, layer_types=["linear_attention", "full_attention"], linear_key_head_dim=8,
            linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
            rope_parameters=dict(
                rope_type="default", mrope_interleaved=True, partial_rotary_factor=1.0, **_MROPE
            ),
        )  # fmt: skip
        vision = dict(
            _QWEN_VISION, intermediate_size=64, out_hidden_size=32, num_position_embeddings=16
        )
        if name == "qwen3_5":
            return t.Qwen3_5Config(text_config=text, vision_config=vision, **qwen)
        text.update(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            shared_expert_intermediate_size=16, router_aux_loss_coef=0.02, **moe,
        )  # fmt: skip
        return t.Qwen3_5MoeConfig(text_config=text, vision_config=vision, **qwen)
    if name.startswith("glm4v"):
        text = dict(
            _TEXT,
            rope_parameters=dict(rope_type="default", partial_rotary_factor=1.0, **_MROPE),
        )
        vision = dict(_QWEN_VISION, intermediate_size=64, out_hidden_size=32, image_size=8)
        glm = dict(
            image_token_id=IMAGE, video_token_id=VIDEO, image_start_token_id=VISION_START,
            image_end_token_id=253, video_start_token_id=GLM_VIDEO_START,
            video_end_token_id=GLM_VIDEO_END,
        )  # fmt: skip
        if name == "glm4v":
            return t.Glm4vConfig(text_config=text, vision_config=vision, **glm)
        text.update(
            n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            first_k_dense_replace=1, n_shared_experts=1, router_aux_loss_coef=0.02, **moe,
        )  # fmt: skip
        return t.Glm4vMoeConfig(text_config=text, vision_config=vision, **glm)
    if name == "gemma3":
        return t.Gemma3Config(
            text_config=t.Gemma3TextConfig(**_TEXT, final_logit_softcapping=3.0),
            vision_config=t.SiglipVisionConfig(
                hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, image_size=8, patch_size=2,
            ),
            mm_tokens_per_image=4, image_token_id=IMAGE, boi_token_id=VISION_START,
            eoi_token_id=253,
        )  # fmt: skip
    if name == "llava":
        return t.LlavaConfig(
            text_config=t.LlamaConfig(**_TEXT),
            vision_config=t.CLIPVisionConfig(
                hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, image_size=8, patch_size=4, projection_dim=32,
            ),
            image_token_id=IMAGE, vision_feature_layer=-2,
        )  # fmt: skip
    raise AssertionError(name)


def _model(name: str, dtype: torch.dtype = torch.float32, **moe) -> torch.nn.Module:
    """A tiny random model; lm_head large enough that logits reach ~±10, Gemma-3's projector
    (zero at init, so no gradient would reach its vision tower) made non-zero."""
    torch.manual_seed(1234)
    cls = getattr(transformers, VLM_MODELS[name])
    # MoE experts run the eager loop: the grouped-matmul kernel has no float64 (the truth copy)
    extra = {"experts_implementation": "eager"} if name.endswith("moe") else {}
    model = cls._from_config(_config(name, **moe), **extra)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.25)
        if name == "gemma3":
            model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.3)
    return model.to(dtype).eval()


# --------------------------------------------------------------------------------------------
# batches with images


def _tokens(name: str, grid: tuple[int, int, int] | None) -> int:
    """Placeholder tokens of one image (Qwen: its grid after the 2x2 merge)."""
    return grid[0] * grid[1] * grid[2] // 4 if name in QWEN else 4


# One row = a list of segments: an int (that many text tokens) or an image grid (Qwen: (t, h, w)
# patches; the other families' images are fixed 8x8: their grid is ignored).
_ROWS = [
    [3, (1, 4, 4), 4, (1, 2, 4), 3],  # two images of 4 and 2 tokens
    [5, (1, 2, 4), 6],
    [9],  # text only
]


def _row(name: str, segments, g: torch.Generator) -> tuple[list[int], list]:
    ids, grids = [], []
    for seg in segments:
        if isinstance(seg, int):
            ids += torch.randint(3, 200, (seg,), generator=g).tolist()
        else:
            ids += [VISION_START] + [IMAGE] * _tokens(name, seg)
            grids.append(seg)
    return ids, grids


def _images(name: str, grids: list, g: torch.Generator) -> dict:
    """The image inputs of ``grids`` (in row-major order) as the processor gives them."""
    if not grids:
        return {}
    if name in QWEN:
        grid = torch.tensor(grids)
        rows = int(grid.prod(-1).sum())
        return {
            "pixel_values": torch.randn(rows, 3 * 2 * 2 * 2, generator=g),
            "image_grid_thw": grid,
        }
    return {"pixel_values": torch.randn(len(grids), 3, 8, 8, generator=g)}


def _type_ids(name: str, ids: torch.Tensor) -> dict:
    if name in QWEN:
        return {"mm_token_type_ids": (ids == IMAGE).int()}
    if name == "gemma3":
        return {"token_type_ids": (ids == IMAGE).long()}
    return {}


def _padded(name: str, kind: str, seed: int = 0) -> dict:
    """Three rows (two with images, one text only) padded left or right; the last 3 real tokens
    of each row are the response. Qwen: left padding lets the model compute its multimodal
    positions (position_ids None), right padding passes them ([3, B, T], get_rope_index).
    Gemma-3 / LLaVA: HF-style 2-D positions with left padding, none with right padding."""
    g = torch.Generator().manual_seed(seed)
    rows = [_row(name, r, g) for r in _ROWS]
    T = max(len(r) for r, _ in rows) + 2
    B = len(rows)
    ids = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.long)
    for b, (r, _) in enumerate(rows):
        place = slice(T - len(r), T) if kind == "left_pad" else slice(0, len(r))
        ids[b, place] = torch.tensor(r)
        mask[b, place] = 1
    response = torch.zeros(B, T, dtype=torch.bool)
    for b in range(B):
        response[b, mask[b].nonzero().squeeze(1)[-3:]] = True
    kw = {"attention_mask": mask, **_images(name, [x for _, gs in rows for x in gs], g)}
    kw.update(_type_ids(name, ids))
    if name in QWEN and kind == "right_pad":
        model = _model(name)
        kw["position_ids"] = model.model.get_rope_index(
            ids, image_grid_thw=kw.get("image_grid_thw"), attention_mask=mask,
            mm_token_type_ids=kw["mm_token_type_ids"],
        )[0]  # fmt: skip
    elif name not in QWEN and kind == "left_pad":
        kw["position_ids"] = torch.where(mask.bool(), mask.cumsum(-1) - 1, 1)
    doc = torch.where(mask.bool(), torch.arange(B)[:, None], -1)
    labels = _expected_labels(ids, doc, response)
    return dict(ids=ids, kw={**kw, "response_mask": response}, model_kw=kw, doc=doc, labels=labels)


def _packed(name: str, seed: int = 0) -> dict:
    """One row of the three documents of ``_ROWS``, no attention mask. Qwen: ``[4, 1, T]``
    position ids (each document's text positions, then its own get_rope_index sections)."""
    g = torch.Generator().manual_seed(seed)
    docs = [_row(name, r, g) for r in _ROWS]
    ids = torch.tensor([sum((r for r, _ in docs), [])])
    doc = torch.cat([torch.full((len(r),), d) for d, (r, _) in enumerate(docs)])[None]
    text = torch.cat([torch.arange(len(r)) for r, _ in docs])[None]
    kw = {**_images(name, [x for _, gs in docs for x in gs], g), **_type_ids(name, ids)}
    if name in QWEN:
        model, sections = _model(name), []
        for r, grids in docs:
            one = torch.tensor([r])
            grid = torch.tensor(grids) if grids else None
            sections.append(
                model.model.get_rope_index(
                    one, image_grid_thw=grid, mm_token_type_ids=(one == IMAGE).int()
                )[0]
            )
        kw["position_ids"] = torch.cat([text[None], torch.cat(sections, dim=2)], dim=0)
    else:
        kw["position_ids"] = text
    labels = _expected_labels(ids, doc, None)
    return dict(ids=ids, kw=dict(kw), model_kw=kw, doc=doc, labels=labels)


def _expected_labels(ids, doc, response):
    """Independent construction: the next token of the same document (and a response token)."""
    labels = torch.full_like(ids, IGNORE)
    same = (doc[:, :-1] >= 0) & (doc[:, :-1] == doc[:, 1:])
    labels[:, :-1] = torch.where(same, ids[:, 1:], IGNORE)
    if response is not None:
        labels[:, :-1] = labels[:, :-1].masked_fill(~response[:, 1:], IGNORE)
    return labels


def _layout(name: str, kind: str, seed: int = 0) -> dict:
    return _packed(name, seed) if kind == "packed" else _padded(name, kind, seed)


def _cast(kw: dict, dtype: torch.dtype) -> dict:
    """Pixel values in the model's dtype (the truth's: float64)."""
    return {k: v.to(dtype) if torch.is_floating_point(v) else v for k, v in kw.items()}


def _dtype(model) -> torch.dtype:
    return next(model.parameters()).dtype


# --------------------------------------------------------------------------------------------
# log-probs and entropy


def _vision_names(model) -> list[str]:
    """The vision tower's and the projector's parameters (Qwen's merger is in model.visual)."""
    prefixes = ("model.visual.", "model.vision_tower.", "model.multi_modal_projector.")
    return [n for n, _ in model.named_parameters() if n.startswith(prefixes)]


def _check_grads(model, op, ref, truth, num_tokens, context=""):
    """Every parameter's gradient (as tests/test_hf.py), the vision tower's and projector's
    included: a parameter the model's own forward leaves without gradient (LLaVA's last vision
    layer, whose output it never reads) gets none here either."""
    assert set(op) == set(ref) == set(truth)
    floor = num_tokens * torch.finfo(torch.float32).eps
    for name in truth:
        if ref[name] is None:
            assert truth[name] is None and op[name] is None, f"{context}{name}: gradient"
            continue
        assert op[name] is not None, f"{context}{name}: no gradient from the integration"
        assert op[name].dtype == ref[name].dtype
        assert_no_worse_than_reference(
            op[name], ref[name], truth[name], f"{context}{name}.grad", floor=floor
        )
    reached = [n for n in _vision_names(model) if op[n] is not None and bool(op[n].any())]
    assert len(reached) > len(_vision_names(model)) // 2, f"{context}vision gradients: {reached}"


def _run_logprobs(kind, model, lay, temperature, upstream):
    model.zero_grad(set_to_none=True)
    dtype = _dtype(model)
    if kind == "op":
        out = hf.causal_lm_logprobs(
            model, lay["ids"], with_entropy=True, temperature=temperature,
            **_cast(lay["kw"], dtype),
        )  # fmt: skip
        lp, ent = out.logprobs, out.entropy
    else:
        logits = model(lay["ids"], use_cache=False, **_cast(lay["model_kw"], dtype)).logits
        logits = logits.double() if kind == "truth" else logits.float()
        lp, ent = _from_logits(logits, lay["labels"], temperature)
    g, e = upstream
    ((lp * g.to(lp)).sum() + (ent * e.to(ent)).sum()).backward()
    return lp.detach(), ent.detach(), _grads(model)


def _check_logprobs(model, lay, temperature=0.8, context=""):
    labels = lay["labels"]
    assert torch.equal(hf.causal_lm_labels(lay["ids"], **_label_kw(lay["kw"])), labels)
    gen = torch.Generator().manual_seed(7)
    upstream = (torch.randn(labels.shape, generator=gen), torch.randn(labels.shape, generator=gen))
    op = _run_logprobs("op", model, lay, temperature, upstream)
    ref = _run_logprobs("ref", model, lay, temperature, upstream)
    truth = _run_logprobs("truth", copy.deepcopy(model).double(), lay, temperature, upstream)
    valid = labels != IGNORE
    assert bool((op[0][~valid] == 0).all()) and bool((op[1][~valid] == 0).all())
    assert_no_worse_than_reference(op[0], ref[0], truth[0], f"{context}logprobs")
    assert_no_worse_than_reference(op[1], ref[1], truth[1], f"{context}entropy")
    _check_grads(model, op[2], ref[2], truth[2], labels.numel(), context)


def _label_kw(kw: dict) -> dict:
    keys = ("attention_mask", "position_ids", "response_mask")
    return {k: v for k, v in kw.items() if k in keys}


LAYOUTS = ["left_pad", "right_pad", "packed"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("name", "layout"),
    [(n, lay) for n in VLM_MODELS for lay in LAYOUTS if not (n in RECURRENT and lay == "packed")],
)
def test_logprobs_match_model_logits(name, layout, dtype):
    lay = _layout(name, layout)
    temperature = 0.8
    if layout == "right_pad":  # a per-token temperature
        gen = torch.Generator().manual_seed(3)
        temperature = 0.5 + torch.rand(lay["ids"].shape, generator=gen)
    _check_logprobs(_model(name, dtype), lay, temperature)


@pytest.mark.parametrize("name", RECURRENT)
def test_hybrid_linear_attention_refuses_packed_rows(name):
    """Qwen3.5's Gated DeltaNet layers run along the whole row: the model's own forward on a
    packed row lets each document read the ones before it (its attention layers alone keep
    them apart). Refused before the backbone runs; one document per row (padded) is not."""
    model = _model(name)
    calls: list = []
    model.model.register_forward_pre_hook(lambda *_, c=calls: c.append(1))
    lay = _packed(name)
    _raises(model, calls, lay["ids"], "linear-attention layers", **lay["kw"])
    # the refusal is not overcautious: the model's own logits of the last document (text
    # only) differ from the same document scored alone
    n = _ROWS[-1][0]  # 9 text tokens
    last = lay["ids"][:, -n:]
    assert int(lay["kw"]["position_ids"][0, 0, -n]) == 0
    with torch.no_grad():
        packed = model(lay["ids"], use_cache=False, **lay["model_kw"]).logits
        alone = model(last, use_cache=False).logits
    assert not torch.allclose(packed[:, -last.shape[1] :], alone, atol=1e-3)
    # [4, B, T] position ids of one document per row (no restart) are taken
    pad = _padded(name, "right_pad")
    kw = dict(pad["kw"])
    kw["position_ids"] = torch.cat([(pad["kw"]["attention_mask"].cumsum(-1) - 1)[None],
                                    kw["position_ids"]])  # fmt: skip
    hf.causal_lm_logprobs(model, pad["ids"], **kw)


def test_every_vision_language_model_is_tested():
    assert set(hf_vlm.AUDITED) == set(VLM_MODELS.values())
    assert set(hf_vlm.AUDITED) <= set(hf.SUPPORTED_MODELS)


def test_gemma3_has_no_softcap_whatever_its_text_config():
    """Gemma3ForConditionalGeneration's forward applies no final_logit_softcapping (the text
    class does): the head follows the class, not the config."""
    model = _model("gemma3")
    assert model.config.get_text_config().final_logit_softcapping == 3.0
    assert hf.causal_lm_head(model)[2:] == (None, 1.0)


@pytest.mark.parametrize("name", ["qwen2_vl", "glm4v", "gemma3", "llava"])
def test_packed_documents_equal_each_document_alone(name):
    """Packed rows keep documents apart in attention as well as in the labels: each document
    scored alone (its own image inputs, its own positions) gives the packed row's numbers.
    Gemma-3 without token_type_ids: with them, transformers 5.24's bidirectional image mask
    does not keep a packed row's documents apart (the model's own logits differ from each
    document's alone too; docs/hf.md says so)."""
    model = _model(name)
    lay = _packed(name, seed=4)
    lay["kw"].pop("token_type_ids", None)
    packed = hf.causal_lm_logprobs(model, lay["ids"], **lay["kw"]).logprobs
    truth_model = copy.deepcopy(model).double()
    g = torch.Generator().manual_seed(4)  # the same draws as _packed's
    docs = [_row(name, r, g) for r in _ROWS]
    images = _images(name, [x for _, gs in docs for x in gs], g)
    pix, offset = images.get("pixel_values"), 0
    start = 0
    for r, grids in docs:
        one = torch.tensor([r])
        assert torch.equal(one, lay["ids"][:, start : start + len(r)])
        kw = dict(_type_ids(name, one)) if name != "gemma3" else {}
        if grids and name in QWEN:
            n = int(torch.tensor(grids).prod(-1).sum())
            kw.update(pixel_values=pix[offset : offset + n], image_grid_thw=torch.tensor(grids))
            offset += n
        elif grids:
            kw["pixel_values"] = pix[offset : offset + len(grids)]
            offset += len(grids)
        labels = torch.full_like(one, IGNORE)
        labels[:, :-1] = one[:, 1:]
        ref, _ = _from_logits(model(one, use_cache=False, **kw).logits.float(), labels, 1.0)
        truth, _ = _from_logits(
            truth_model(one, use_cache=False, **_cast(kw, torch.float64)).logits.double(),
            labels, 1.0,
        )  # fmt: skip
        got = packed[:, start : start + len(r)]
        assert_no_worse_than_reference(got, ref, truth, f"{name} document at {start}")
        start += len(r)


def test_hidden_states_are_what_lm_head_gets():
    model = _model("qwen2_5_vl")
    lay = _padded("qwen2_5_vl", "left_pad")
    hidden = hf.causal_lm_hidden_states(model, lay["ids"], **lay["model_kw"])
    out = model(lay["ids"], use_cache=False, output_hidden_states=True, **lay["model_kw"])
    torch.testing.assert_close(model.lm_head(hidden), out.logits, rtol=0, atol=0)


# --------------------------------------------------------------------------------------------
# policy loss

LOSS = PolicyLossConfig(
    clip_high=0.28, aggregation="token_mean", kl_coef=0.05, kl_estimator="k3", entropy_coef=0.01
)
GSPO = PolicyLossConfig(  # bounds the sequence ratios of these inputs straddle
    ratio_level="sequence", clip_low=0.02, clip_high=0.03, aggregation="seq_mean_token_mean"
)


def _run_loss(kind, model, lay, cfg, p, aux_coef=0.0):
    model.zero_grad(set_to_none=True)
    dtype = _dtype(model)
    labels = lay["labels"]
    if kind == "op":
        loss, metrics = hf.causal_lm_policy_loss(
            model, lay["ids"], p["old"], p["adv"], config=cfg, ref_logprobs=p["ref"],
            temperature=0.9, **_cast(lay["kw"], dtype),
        )  # fmt: skip
    else:
        out = model(lay["ids"], use_cache=False, **_cast(lay["model_kw"], dtype))
        as_kind = (lambda t: t.double()) if kind == "truth" else (lambda t: t)
        lp, ent = _from_logits(as_kind(out.logits.float()), labels, 0.9)
        docs = lay["kw"].get("attention_mask") is None  # packed: one advantage per document
        tok = (lambda t: t.reshape(-1)) if docs else (lambda t: t)
        loss, metrics = policy_loss(
            tok(lp), tok(as_kind(p["old"])), as_kind(p["adv"]), tok(labels != IGNORE),
            config=cfg, document_ids=tok(lay["doc"]) if docs else None,
            ref_logprobs=tok(as_kind(p["ref"])),
            entropy=tok(ent) if cfg.entropy_coef != 0 else None,
        )  # fmt: skip
        if aux_coef:
            loss = loss + aux_coef * out.aux_loss.to(loss.dtype)
            metrics = {**metrics, "aux_loss": out.aux_loss.detach().float()}
    (2.5 * loss).backward()
    return loss.detach(), metrics, _grads(model)


def _loss_inputs(model, lay, seed=0):
    g = torch.Generator().manual_seed(seed)
    labels = lay["labels"]
    with torch.no_grad():
        logits = model(lay["ids"], use_cache=False, **_cast(lay["model_kw"], _dtype(model))).logits
        base, _ = _from_logits(logits.float(), labels, 0.9)  # the loss's temperature
    valid = labels != IGNORE

    def near(x):
        return torch.where(valid, x + 0.1 * torch.randn(labels.shape, generator=g), 0.0)

    sequences = int(lay["doc"].max()) + 1
    return dict(old=near(base), ref=near(base), adv=torch.randn(sequences, generator=g))


LOSS_MATRIX = [
    ("qwen2_vl", "left_pad", torch.float32),
    ("qwen2_5_vl", "packed", torch.float32),
    ("qwen3_vl", "right_pad", torch.bfloat16),
    ("qwen3_vl", "packed", torch.float32),
    ("gemma3", "left_pad", torch.bfloat16),
    ("gemma3", "packed", torch.float32),
    ("llava", "right_pad", torch.float32),
    ("llava", "packed", torch.bfloat16),
    ("qwen3_5", "left_pad", torch.float32),
    ("qwen3_5", "right_pad", torch.bfloat16),
    ("glm4v", "packed", torch.float32),
    ("glm4v", "left_pad", torch.bfloat16),
]


@pytest.mark.parametrize("cfg", [LOSS, GSPO], ids=["dapo_kl_entropy", "gspo"])
@pytest.mark.parametrize(("name", "layout", "dtype"), LOSS_MATRIX)
def test_policy_loss_matches_policy_loss_on_model_logits(name, layout, dtype, cfg):
    _check_loss(_model(name, dtype), _layout(name, layout, seed=2), cfg, dtype)


@pytest.mark.parametrize(
    ("name", "layout"),
    [
        ("qwen3_vl_moe", "left_pad"), ("qwen3_vl_moe", "packed"), ("qwen3_5_moe", "left_pad"),
        ("glm4v_moe", "right_pad"), ("glm4v_moe", "packed"),
    ],
)  # fmt: skip
def test_moe_policy_loss_adds_the_router_loss(name, layout):
    """Qwen3-VL-MoE, Qwen3.5-MoE and GLM-4V-MoE with output_router_logits: the loss gains the
    router's load-balancing loss weighted by config.text_config.router_aux_loss_coef, with the
    expert count the forward reads (GLM-4V-MoE: num_local_experts), as the model adds it.
    Up to transformers 5.17 these forwards ignore the config flag (they add the loss only when
    a call passes it): there the model's own output has no router loss, and neither has
    logitless's (the reference run below is the model's own forward either way)."""
    model = _model(name, output_router_logits=True)
    reads = "output_router_logits" in inspect.signature(type(model).forward).parameters
    if tuple(map(int, transformers.__version__.split(".")[:2])) >= (5, 24):
        assert reads  # CI's transformers: the router loss is there to check
    want = 0.02 if reads else 0.0
    assert hf.causal_lm_router_aux_coef(model) == want
    _check_loss(model, _layout(name, layout, seed=2), LOSS, torch.float32, aux=want)


def _check_loss(model, lay, cfg, dtype, aux=0.0):
    labels = lay["labels"]
    p = _loss_inputs(model, lay)
    op = _run_loss("op", model, lay, cfg, p)
    ref = _run_loss("ref", model, lay, cfg, p, aux)
    truth = _run_loss("truth", copy.deepcopy(model).double(), lay, cfg, p, aux)
    floor = int((labels != IGNORE).sum()) * torch.finfo(dtype).eps
    assert set(op[1]) == set(ref[1])
    assert_no_worse_than_reference(op[0], ref[0], truth[0], "loss", floor=floor)
    for key in truth[1]:
        assert_no_worse_than_reference(op[1][key], ref[1][key], truth[1][key], key, floor=floor)
    _check_grads(model, op[2], ref[2], truth[2], labels.numel())


# --------------------------------------------------------------------------------------------
# the divergence to a teacher


def test_divergence_matches_both_models_logits():
    student, teacher = _model("qwen2_vl"), _model("qwen2_vl")
    torch.manual_seed(5)
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(0.05 * torch.randn_like(p))
    lay = _padded("qwen2_vl", "left_pad", seed=3)
    labels = lay["labels"]
    gen = torch.Generator().manual_seed(8)
    g = torch.randn(labels.shape, generator=gen)

    def run(kind, s, t):
        s.zero_grad(set_to_none=True)
        kw = _cast(lay["kw"] if kind == "op" else lay["model_kw"], _dtype(s))
        if kind == "op":
            div = hf.causal_lm_divergence(s, t, lay["ids"], beta=0.5, temperature=0.8, **kw)
            div = div.divergence
        else:
            as_kind = (lambda x: x.double()) if kind == "truth" else (lambda x: x.float())
            z_s = as_kind(s(lay["ids"], use_cache=False, **kw).logits) / 0.8
            with torch.no_grad():
                z_t = as_kind(t(lay["ids"], use_cache=False, **kw).logits) / 0.8
            div = _divergence_reference(z_s.log_softmax(-1), z_t.log_softmax(-1), 0.5)
            div = torch.where(labels != IGNORE, div, 0.0)
        (div * g.to(div)).sum().backward()
        return div.detach(), _grads(s)

    op = run("op", student, teacher)
    ref = run("ref", student, teacher)
    truth = run("truth", copy.deepcopy(student).double(), copy.deepcopy(teacher).double())
    assert_no_worse_than_reference(op[0], ref[0], truth[0], "divergence")
    _check_grads(student, op[1], ref[1], truth[1], labels.numel())
    assert all(p.grad is None for p in teacher.parameters())


# --------------------------------------------------------------------------------------------
# bad input: ValueError naming the argument, before the backbone runs


@pytest.fixture(params=["qwen2_vl", "qwen3_5", "glm4v", "gemma3", "llava"])
def guarded(request):
    model = _model(request.param)
    calls: list = []
    model.model.register_forward_pre_hook(lambda *_, c=calls: c.append(1))
    return request.param, model, calls


def _raises(model, calls, ids, match, **kw):
    with pytest.raises(ValueError, match=match):
        hf.causal_lm_logprobs(model, ids, **kw)
    assert calls == []


def test_image_tokens_without_pixel_values(guarded):
    name, model, calls = guarded
    lay = _padded(name, "left_pad")
    kw = {k: v for k, v in lay["kw"].items() if k not in ("pixel_values", "image_grid_thw")}
    _raises(model, calls, lay["ids"], "pixel_values is not given", **kw)


def test_pixel_values_without_image_tokens(guarded):
    name, model, calls = guarded
    lay = _padded(name, "left_pad")
    ids = lay["ids"].masked_fill(lay["ids"] == IMAGE, 7)
    kw = {k: v for k, v in lay["kw"].items() if k not in ("mm_token_type_ids", "token_type_ids")}
    _raises(model, calls, ids, "no image token", **kw)


def test_image_count_mismatch(guarded):
    name, model, calls = guarded
    lay = _padded(name, "left_pad")
    kw = dict(lay["kw"])
    if name in QWEN:  # the two 2-token images' grids swapped with the 4-token one: same total
        kw["image_grid_thw"] = kw["image_grid_thw"][[1, 0, 2]]
        _raises(model, calls, lay["ids"], "image_grid_thw does not match", **kw)
        kw["image_grid_thw"] = torch.tensor([[1, 4, 4], [1, 2, 4], [1, 4, 4]])
        kw["pixel_values"] = torch.randn(40, 24)
        _raises(model, calls, lay["ids"], "image_grid_thw describes 10 image tokens", **kw)
        kw["pixel_values"] = torch.randn(48, 24)
        _raises(model, calls, lay["ids"], "pixel_values must have one row per patch", **kw)
    else:
        kw["pixel_values"] = torch.randn(4, 3, 8, 8)
        _raises(model, calls, lay["ids"], "pixel_values holds 4 images", **kw)


@pytest.mark.parametrize("name", ["qwen2_vl", "glm4v", "gemma3"])  # LLaVA takes no type ids
def test_type_ids_must_match(name):
    model = _model(name)
    calls: list = []
    model.model.register_forward_pre_hook(lambda *_, c=calls: c.append(1))
    lay = _padded(name, "left_pad")
    key = "mm_token_type_ids" if name in QWEN else "token_type_ids"
    kw = dict(lay["kw"])
    kw[key] = torch.zeros_like(kw[key])
    _raises(model, calls, lay["ids"], key, **kw)
    if name in QWEN:  # the model computes its positions from them: required
        kw.pop(key)
        _raises(model, calls, lay["ids"], f"{key} must be given", **kw)


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen3_5", "glm4v"])
def test_qwen_refuses_2d_position_ids(name):
    model = _model(name)
    calls: list = []
    model.model.register_forward_pre_hook(lambda *_, c=calls: c.append(1))
    lay = _padded(name, "right_pad")
    kw = dict(lay["kw"])
    kw["position_ids"] = kw["position_ids"][0]
    _raises(model, calls, lay["ids"], "position_ids must have shape", **kw)
    lay = _packed(name)
    kw = {k: v for k, v in lay["kw"].items() if k != "position_ids"}
    cu = torch.tensor([0, 10, 17, lay["ids"].shape[1]])
    _raises(model, calls, lay["ids"], "cu_seqlens gives 2-D ones", cu_seqlens=cu, **kw)
    with pytest.raises(ValueError, match="position_ids"):
        hf.causal_lm_hidden_states(model, lay["ids"], position_ids=lay["kw"]["position_ids"][0])


def test_inputs_a_model_does_not_take():
    """Multimodal names a class does not take: its backbone would drop them silently."""
    text = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**_TEXT))
    ids = torch.randint(3, 200, (1, 6))
    with pytest.raises(ValueError, match="pixel_values given, but Qwen2ForCausalLM"):
        hf.causal_lm_logprobs(text, ids, pixel_values=torch.randn(1, 3, 8, 8))
    with pytest.raises(ValueError, match="position_ids must have input_ids' shape"):
        hf.causal_lm_logprobs(text, ids, position_ids=torch.zeros(3, 1, 6, dtype=torch.long))
    lay = _padded("qwen2_vl", "left_pad")
    with pytest.raises(ValueError, match="token_type_ids given, but Qwen2VL"):
        hf.causal_lm_logprobs(
            _model("qwen2_vl"), lay["ids"], token_type_ids=lay["ids"], **lay["kw"]
        )
    lay = _padded("gemma3", "left_pad")
    with pytest.raises(ValueError, match="image_grid_thw given"):
        hf.causal_lm_logprobs(
            _model("gemma3"), lay["ids"], image_grid_thw=torch.tensor([[1, 4, 4]]), **lay["kw"]
        )
    with pytest.raises(ValueError, match="mm_encoder_outputs"):
        hf.causal_lm_logprobs(_model("gemma3"), lay["ids"], mm_encoder_outputs={}, **lay["kw"])


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def test_video_inputs_match_model_logits(name):
    """A video (2 temporal patches of 4 x 4: 8 tokens) beside an image: pixel_values_videos
    and video_grid_thw reach the backbone, mm_token_type_ids marks the video tokens 2. Qwen2-VL
    and Qwen2.5-VL place a video as one run of 8 tokens, Qwen3-VL as one run of 4 per frame
    (its processor puts a timestamp and a vision-start token before each); a grid whose runs
    are not input_ids' is refused."""
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(3, 200, (2, 20), generator=g)
    frames = name in ("qwen3_vl", "qwen3_5")
    ids[0, 1], ids[0, 2:10] = VISION_START, VIDEO
    if frames:
        ids[0, 6], ids[0, 7] = 7, VISION_START  # frame 2: ids[0, 8:12]
        ids[0, 10:12] = VIDEO
    ids[1, 3], ids[1, 4:8] = VISION_START, IMAGE
    mask = torch.ones_like(ids)
    mask[1, 17:] = 0  # right padding
    kw = {
        "attention_mask": mask,
        "pixel_values_videos": torch.randn(32, 24, generator=g),
        "video_grid_thw": torch.tensor([[2, 4, 4]]),
        "pixel_values": torch.randn(16, 24, generator=g),
        "image_grid_thw": torch.tensor([[1, 4, 4]]),
        "mm_token_type_ids": torch.where(ids == VIDEO, 2, (ids == IMAGE).int()),
    }
    doc = torch.where(mask.bool(), torch.arange(2)[:, None], -1)
    lay = dict(ids=ids, kw=kw, model_kw=kw, doc=doc, labels=_expected_labels(ids, doc, None))
    _check_logprobs(_model(name), lay, 0.8)
    model = _model(name)
    bad = dict(kw, video_grid_thw=torch.tensor([[1, 4, 4]]))  # 4 tokens, input_ids hold 8
    with pytest.raises(ValueError, match="video_grid_thw describes 4 video tokens"):
        hf.causal_lm_logprobs(model, ids, **dict(bad, pixel_values_videos=torch.randn(16, 24)))
    # the same 8 tokens in the other families' placement: refused
    other = torch.where(ids == VIDEO, 9, ids)
    if frames:
        other[0, 2:10] = VIDEO
    else:
        other[0, 2:6], other[0, 8:12] = VIDEO, VIDEO
    want = "its frames have [4, 4] tokens" if frames else "its videos have [8] tokens"
    with pytest.raises(ValueError, match=rf"video_grid_thw does not match.*{re.escape(want)}"):
        hf.causal_lm_logprobs(model, other, **dict(kw, mm_token_type_ids=None))
    no_video = {k: v for k, v in kw.items() if "video" not in k}
    with pytest.raises(ValueError, match="pixel_values_videos is not given"):
        hf.causal_lm_logprobs(model, ids, **no_video)


@pytest.mark.parametrize("name", ["glm4v", "glm4v_moe"])
def test_glm4v_video_is_image_tokens_typed_2(name):
    """GLM-4V's video: one run of image tokens per frame (2 temporal patches of 4 x 4: two
    runs of 4, each in <begin_of_image> ... <end_of_image> and a timestamp, inside
    <begin_of_video> ... <end_of_video>), marked 2 in mm_token_type_ids, beside a text-only row:
    pixel_values_videos and video_grid_thw reach the backbone. Images and videos in one call
    (the forward scatters both into every image token: transformers raises) are refused, as
    are type ids that call the frames images."""
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(3, 200, (2, 20), generator=g)
    ids[0, 1], ids[0, 2], ids[0, 3:7], ids[0, 7] = GLM_VIDEO_START, VISION_START, IMAGE, 253
    ids[0, 9], ids[0, 10:14], ids[0, 14], ids[0, 16] = VISION_START, IMAGE, 253, GLM_VIDEO_END
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    kw = {
        "attention_mask": mask,
        "pixel_values_videos": torch.randn(32, 24, generator=g),
        "video_grid_thw": torch.tensor([[2, 4, 4]]),
        "mm_token_type_ids": (ids == IMAGE).int() * 2,
    }
    doc = torch.where(mask.bool(), torch.arange(2)[:, None], -1)
    lay = dict(ids=ids, kw=kw, model_kw=kw, doc=doc, labels=_expected_labels(ids, doc, None))
    model = _model(name)
    _check_logprobs(model, lay, 0.8)
    calls: list = []
    model.model.register_forward_pre_hook(lambda *_, c=calls: c.append(1))
    both = dict(kw, pixel_values=torch.randn(16, 24), image_grid_thw=torch.tensor([[1, 4, 4]]))
    _raises(model, calls, ids, "pixel_values and pixel_values_videos given together", **both)
    typed_1 = dict(kw, mm_token_type_ids=(ids == IMAGE).int())
    _raises(model, calls, ids, "mm_token_type_ids must be 2 at token id", **typed_1)
    one_run = ids.clone()
    one_run[0, 7:10] = IMAGE  # the two frames' tokens in one run of 11
    _raises(model, calls, one_run, "video_grid_thw describes 8", **kw)
    no_video = {k: v for k, v in kw.items() if "video" not in k}
    _raises(model, calls, ids, "pixel_values is not given", **no_video)
