"""logitless as verl's fused-kernel backend on vision-language models, through verl 0.9's own
FSDP engine forward on CPU (tests/verl_backend/_engine.py).

Tiny Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, Qwen3.5 and Qwen3.5-MoE models from the
configs of tests/test_hf_vlm.py (nothing is downloaded), each patched by verl's
``apply_monkey_patch`` three ways: ``impl_backend=logitless``, verl's ``impl_backend=torch``
(its ``qwen2_vl`` / ``qwen3_vl`` / ``qwen3_5`` fused forward) and the unfused path (verl's VLM
forward returning logits -> log-softmax), plus the unfused path on a float64 copy (the truth).
The micro-batch is verl's: nested ``input_ids``, ``[4, T]`` position ids per sequence (text
positions, then the model's ``get_rope_index`` sections, as verl's datasets build them) and the
processor's image inputs per sample in ``multi_modal_inputs``; verl's engine packs it into its
remove-padding layout (``input_ids [1, nnz]``, ``position_ids [4, 1, nnz]``, ``shift_labels``,
no attention mask; Qwen3.5: also the row's ``cu_seqlens``, which verl's engine passes to a
forward that names them). Log-probs, entropy and every parameter's gradient, the vision tower's
included, within 4x the fp32 / bf16 paths' error against float64 (tests/_tolerance.py).
Qwen3.5's gated delta rule runs per document (:func:`per_document_delta_rule`: what
flash-linear-attention's kernel computes; transformers' CPU fallback ignores ``cu_seqlens``).

Attention: verl's remove-padding patch of Qwen2-VL's attention runs flash-attn's varlen kernel
(CUDA only), so the models are patched with ``use_remove_padding=False`` and attend with
transformers' sdpa, which reads the documents of the packed row from the text row of the same
``[4, 1, nnz]`` position ids; the engine's layout is the remove-padding one either way (it is
chosen by the micro-batch). Ulysses (2 gloo ranks, FSDP2) runs a backbone without text decoder
layers, as the text-model test does: verl's Ulysses attention is flash-attn only.

Mutations checked: the image inputs not passed to the backbone, and the position ids reduced to
their text row (2-D), each fail the comparisons here; so does Qwen3.5's ``cu_seqlens`` not
passed to the backbone.
"""

from __future__ import annotations

import copy

import _engine
import pytest
import test_hf_vlm as vlm  # the tiny configs and image rows of the HF tests
import torch
import transformers
from _engine import (
    _own_class,
    check_ranks_equal_one_process,
    cpu_devices,
    engine,
    forward_step,
    lv,
    sharded_step,
    tiny_model,
)
from _tolerance import assert_no_worse_than_reference
from verl.models.transformers.monkey_patch import apply_monkey_patch

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
# Sequences of the micro-batch: text lengths and image grids (t, h, w patches), as
# test_hf_vlm's rows; one sequence is text only (verl runs the vision tower on a dummy image).
SEQS = [[3, (1, 4, 4), 4, (1, 2, 4), 3], [5], [2, (1, 2, 4), 6]]


@pytest.fixture(autouse=True)
def _cpu(monkeypatch):
    cpu_devices(monkeypatch)


def tiny_vlm(name: str, layers: int = 2) -> torch.nn.Module:
    """test_hf_vlm's tiny model of ``name`` with ``layers`` text decoder layers (Qwen3.5: its
    gated delta rule per document, see :func:`per_document_delta_rule`)."""
    if layers == 2:
        return per_document_delta_rule(vlm._model(name))
    torch.manual_seed(1234)
    cfg = vlm._config(name)
    cfg.text_config.num_hidden_layers = layers
    cfg.text_config.layer_types = cfg.text_config.layer_types[:layers]
    model = getattr(transformers, vlm.VLM_MODELS[name])._from_config(cfg)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.25)
    return model.eval()


def per_document_delta_rule(model: torch.nn.Module) -> torch.nn.Module:
    """Qwen3.5's linear-attention layers with a gated delta rule that takes ``cu_seqlens``, as
    flash-linear-attention's kernel (CUDA) does: transformers' torch fallback, run on each
    document of the packed row. transformers' fallback itself takes any keyword and ignores
    ``cu_seqlens`` (verl's packed forward then lets documents read each other; logitless
    refuses it, test_qwen3_5_packed_row_needs_a_delta_rule_that_takes_cu_seqlens)."""
    for m in model.modules():
        rule = getattr(m, "chunk_gated_delta_rule", None)
        if rule is None:
            continue

        def by_document(q, k, v, g, beta, cu_seqlens=None, cu_seqlens_cpu=None, _rule=rule, **kw):
            if cu_seqlens is None:
                return _rule(q, k, v, g=g, beta=beta, **kw)
            cu = cu_seqlens.tolist()
            out = [
                _rule(q[:, a:b], k[:, a:b], v[:, a:b], g=g[:, a:b], beta=beta[:, a:b], **kw)[0]
                for a, b in zip(cu[:-1], cu[1:], strict=True)
            ]
            return torch.cat(out, dim=1), None

        m.chunk_gated_delta_rule = by_document
    return model


def samples(model, name: str, seqs=SEQS, seed: int = 0):
    """Per sequence: its ids, its ``[4, T]`` position ids and its image inputs (a dict)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for segments in seqs:
        ids, grids = vlm._row(name, segments, g)
        images = vlm._images(name, grids, g)
        one = torch.tensor([ids])
        rope = model.model.get_rope_index(
            one, image_grid_thw=images.get("image_grid_thw"),
            mm_token_type_ids=(one == vlm.IMAGE).int(),
        )[0][:, 0]  # fmt: skip
        pos = torch.cat([torch.arange(len(ids))[None], rope])
        out.append((ids, pos, images))
    return out


def micro_batch(batch, **kw):
    """verl's micro-batch of ``samples``: nested input_ids and [4, T_i] position ids, the image
    inputs per sample (verl's ``multi_modal_inputs``)."""
    return _engine.micro_batch(
        [i for i, _, _ in batch], positions=[p for _, p, _ in batch],
        multi_modal_inputs=[m for _, _, m in batch], **kw,
    )  # fmt: skip


def patched(model, backend, *, sp: int = 1):
    """A copy of ``model`` patched by verl's ``apply_monkey_patch`` (see the module doc for
    ``use_remove_padding=False``)."""
    model = copy.deepcopy(model)
    if backend in ("torch", "triton", "liger"):
        model.__class__ = _own_class(type(model))
    apply_monkey_patch(
        model=model, ulysses_sp_size=sp, use_remove_padding=False,
        use_fused_kernels=backend is not None, fused_kernels_backend=backend,
    )  # fmt: skip
    return model


def _upstream(batch, seed=1):
    n = sum(len(i) for i, _, _ in batch)
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen), torch.randn(n, generator=gen)


def _run(model, backend, batch, *, g, e, dtype=None, autocast=torch.float32, rmpad=True):
    if dtype is not None:
        model = copy.deepcopy(model).to(dtype)
        g, e = g.to(dtype), e.to(dtype)
    mb = micro_batch(batch, temperature=0.8, fused=backend is not None, rmpad=rmpad)
    return forward_step(engine(patched(model, backend), dtype=autocast), mb, g, e)


def _check(name, got, refs, truth):
    for ref_name, ref in refs.items():
        assert_no_worse_than_reference(got, ref, truth, f"{name} (reference: {ref_name})")


def _check_all(model, ours, refs, truth, floor_tokens):
    for i, name in enumerate(("log_probs", "entropy")):
        assert ours[i].dtype == torch.float32
        _check(name, ours[i], {k: v[i] for k, v in refs.items()}, truth[i])
    floor = floor_tokens * torch.finfo(torch.float32).eps
    for n in truth[2]:
        for ref_name, ref in refs.items():
            assert_no_worse_than_reference(
                ours[2][n], ref[2][n], truth[2][n], f"grad {n} (reference: {ref_name})",
                floor=floor,
            )  # fmt: skip
    vision = vlm._vision_names(model)
    reached = [n for n in vision if bool(ours[2][n].any())]
    assert len(reached) > len(vision) // 2, f"vision gradients: {reached}"


@pytest.mark.parametrize("name", FAMILIES)
def test_remove_padding_layout_matches_torch_backend_and_unfused(name):
    """And ``logitless_batch_invariant`` (the same forward, the head in its batch-invariant
    mode) on one family."""
    model = tiny_vlm(name)
    batch = samples(model, name)
    g, e = _upstream(batch)
    refs = {
        "torch backend": _run(model, "torch", batch, g=g, e=e),
        "unfused": _run(model, None, batch, g=g, e=e),
    }
    truth = _run(model, None, batch, g=g, e=e, dtype=torch.float64)
    for backend in ("logitless", "logitless_batch_invariant")[: 2 if name == "qwen3_vl" else 1]:
        _check_all(model, _run(model, backend, batch, g=g, e=e), refs, truth, len(g))


@pytest.mark.parametrize(
    "weights", [torch.float32, torch.bfloat16], ids=["fp32_w_bf16_autocast", "bf16_w"]
)
def test_bf16_as_verl_runs_it(weights):
    """verl's engine runs the forward under bf16 autocast, with fp32 (its training default) or
    bf16 weights: held to the unfused bf16 path's error against float64 (verl's torch backend
    rounds its entropy to bf16, see test_verl_engine.py)."""
    name = "qwen2_5_vl"
    model = tiny_vlm(name).to(weights)
    batch = samples(model, name)
    g, e = _upstream(batch)
    kw = dict(g=g, e=e, autocast=torch.bfloat16)
    ours = _run(model, "logitless", batch, **kw)
    unfused = _run(model, None, batch, **kw)
    truth = _run(model.float(), None, batch, g=g, e=e, dtype=torch.float64)
    _check_all(model, ours, {"unfused": unfused}, truth, len(g))


@pytest.mark.parametrize("name", ["qwen3_vl", "qwen3_5"])
def test_padded_layout(name):
    """``use_remove_padding=False``: verl pads the rows and passes ``[4, B, T]`` position ids
    with an attention mask (Qwen3.5: no cu_seqlens, one sequence a row). Each sequence's last
    position is scored on a filler (see test_verl_engine.py); it gets no upstream gradient and
    is left out of the comparison."""
    model = tiny_vlm(name)
    batch = samples(model, name)
    g, e = _upstream(batch)
    keep = torch.ones(len(g), dtype=torch.bool)
    keep[torch.tensor([len(i) for i, _, _ in batch]).cumsum(0) - 1] = False
    g, e = g * keep, e * keep
    kw = dict(g=g, e=e, rmpad=False)
    ours = _run(model, "logitless", batch, **kw)
    unfused = _run(model, None, batch, **kw)
    truth = _run(model, None, batch, dtype=torch.float64, **kw)
    for i, what in enumerate(("log_probs", "entropy")):
        _check(what, ours[i][keep], {"unfused": unfused[i][keep]}, truth[i][keep])
    for n in truth[2]:
        _check(f"grad {n}", ours[2][n], {"unfused": unfused[2][n]}, truth[2][n])


def test_bad_inputs_raise_naming_the_argument():
    name = "qwen2_vl"
    model = tiny_vlm(name, layers=0)
    mod = patched(model, "logitless")
    ids, pos, images = samples(model, name, [[3, (1, 2, 4), 2]])[0]
    ids, pos = torch.tensor([ids]), pos[:, None]
    ok = mod(input_ids=ids, position_ids=pos, **images)
    assert ok.log_probs.shape == ids.shape
    cases = {
        r"position_ids of shape \[4, B, T\].*\(3, 1, ": dict(position_ids=pos[1:], **images),
        "position_ids must have shape": dict(position_ids=pos[0], **images),
        "pixel_values is not given": dict(position_ids=pos),
        "image_grid_thw must be given with pixel_values": dict(
            position_ids=pos, pixel_values=images["pixel_values"]
        ),
        "image_grid_thw describes": dict(
            position_ids=pos,
            pixel_values=images["pixel_values"][:4],
            image_grid_thw=torch.tensor([[1, 2, 2]]),
        ),  # fmt: skip
    }
    for what, kwargs in cases.items():
        with pytest.raises(ValueError, match="impl_backend=logitless: .*" + what):
            mod(input_ids=ids, **kwargs)
    text = patched(tiny_model(layers=0), "logitless")
    with pytest.raises(ValueError, match="pixel_values given, but Qwen2ForCausalLM"):
        text(input_ids=torch.tensor([[1, 2, 3]]), pixel_values=images["pixel_values"])
    # vision-language classes verl's fused kernels do not serve (its dense forward for them)
    # (GLM-4V: verl 0.9.1's glm4v forward reads .shape of the vision tower's output, a
    # BaseModelOutputWithPooling under transformers 5, and fails; GLM-4V-MoE has none)
    for other in ("gemma3", "llava", "glm4v", "glm4v_moe"):
        with pytest.raises(ValueError, match="multimodal model outside Qwen2VL"):
            lv.use(vlm._model(other))
    # cu_seqlens: only Qwen3.5's verl forward takes them
    with pytest.raises(ValueError, match="cu_seqlens given, but Qwen2VLFor"):
        mod(input_ids=ids, position_ids=pos, cu_seqlens=torch.tensor([0, 9]), **images)


def test_qwen3_5_packed_row_needs_a_delta_rule_that_takes_cu_seqlens():
    """transformers' torch fallback of the gated delta rule (no flash-linear-attention) takes
    ``cu_seqlens`` and ignores it: verl's own Qwen3.5 forward then lets each document of the
    packed row read the ones before it. logitless refuses that packed row by name, takes a
    micro-batch of one sequence, and refuses a packed row without ``cu_seqlens`` (its
    linear-attention layers would get no boundaries at all) and malformed ``cu_seqlens``."""
    name = "qwen3_5"
    model = vlm._model(name)  # transformers' own fallback, unwrapped
    mod = patched(model, "logitless")
    assert "cu_seqlens" in __import__("inspect").signature(mod.forward).parameters
    batch = samples(model, name)
    with pytest.raises(ValueError, match="torch fallback of the gated delta rule"):
        forward_step(engine(mod), micro_batch(batch, temperature=0.8))
    one = batch[:1]
    g, e = _upstream(one)
    ours = forward_step(engine(mod), micro_batch(one, temperature=0.8), g, e)
    ref = _run(model, "torch", one, g=g, e=e)
    truth = _run(model, None, one, g=g, e=e, dtype=torch.float64)
    _check_all(model, ours, {"torch backend": ref}, truth, len(g))
    ids = torch.tensor([sum((i for i, _, _ in batch), [])])
    pos = torch.cat([p for _, p, _ in batch], dim=1)[:, None]
    images = {
        "pixel_values": torch.cat([m["pixel_values"] for _, _, m in batch if m]),
        "image_grid_thw": torch.cat([m["image_grid_thw"] for _, _, m in batch if m]),
    }
    with pytest.raises(ValueError, match="restart within a row"):
        mod(input_ids=ids, position_ids=pos, **images)
    with pytest.raises(ValueError, match=r"cu_seqlens must be \[D \+ 1\] integers from 0"):
        mod(input_ids=ids, position_ids=pos, cu_seqlens=torch.tensor([3, 0]), **images)


# --- Ulysses sequence parallelism on 2 gloo ranks, under FSDP2 ------------------------------

_SP_NAME = "qwen2_5_vl"


def ulysses_case(group, mesh, world):
    """On each rank of the shared launch (``_engine.ulysses_worker``): verl pads the packed
    row for the ranks, embeds the images on every rank and slices the embeddings (its
    ``patch_vlm_for_ulysses_input_slicing``)."""
    model = tiny_vlm(_SP_NAME, layers=0)
    batch = samples(model, _SP_NAME)
    g, e = _upstream(batch)
    mb = micro_batch(batch, temperature=0.8)
    return {
        b: sharded_step(model, b, mesh, group, world, mb, g, e, patch=patched)
        for b in ("logitless", "torch")
    }


def test_ulysses_two_ranks_under_fsdp2_equal_one_process(ulysses):
    model = tiny_vlm(_SP_NAME, layers=0)
    batch = samples(model, _SP_NAME)  # 33 tokens: verl pads the row to 34, 17 a rank
    ranks = [r["vlm"] for r in ulysses]
    g, e = _upstream(batch)
    one = _run(model, "logitless", batch, g=g, e=e)
    unfused = _run(model, None, batch, g=g, e=e)
    truth = _run(model, None, batch, g=g, e=e, dtype=torch.float64)

    def check(got, refs, truth, _what):  # every gradient, the vision tower's included
        _check_all(model, got, refs, truth, len(g))

    check_ranks_equal_one_process(ranks, one, unfused, truth, check)
