"""LogitlessGRPOTrainer on a vision-language policy with image prompts, against the real TRL
``GRPOTrainer`` (CPU, fp32, nothing downloaded). LLaVA and Gemma-3 (its processor's
token_type_ids; TRL's token_type_ids misaligned by a right-padding processor are refused).

A tiny random LLaVA (a CLIP vision tower, a Llama language model) with a processor built here
(a word-level tokenizer, CLIP's image processor, a chat template): conversational prompts, one
8x8 image each, generation with ``model.generate``, rewards, 2 iterations of each batch,
gradient accumulation 2. Stock TRL and the adapter run the same ``train()``: the same logged
losses and metrics and the same final weights, the vision tower's and the projector's included
(tests/_trl.py's ``assert_same_run``). The scoring passes (old policy log-probs) in chunks
of rows slice the image inputs as TRL does (checked against a whole-batch call). Mutation
checked: the image inputs not passed to the loss's backbone call fails the run comparison.

The distillation trainer likewise (a LLaVA student and a wider LLaVA teacher, both given the
images): the same loss and gradients as stock ``DistillationTrainer`` on a generated batch,
and the same ``train()``.

Qwen2-VL: its processor needs torchvision (its video processor), which this project's
environments do not install, so its batch is built here as TRL's scoring builds it; stock
``compute_loss`` and the adapter's, the loss, every gradient (the vision tower's included), the
metrics, and the scoring in chunks of rows (image rows sliced by ``image_grid_thw``). Mutation
checked: the pixel rows of a chunk taken from the start fails both Qwen tests.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

trl = pytest.importorskip(
    "trl", reason="TRL is not installed (pip install -e '.[trl]' in a logitless checkout)"
)
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
PIL = pytest.importorskip("PIL.Image")

from _trl import assert_same_run, reward, single_thread, word_tokenizer  # noqa: E402
from _trl import grpo_args as _args  # noqa: E402

from logitless.integrations.trl import (  # noqa: E402
    LogitlessDistillationTrainer,
    LogitlessGRPOTrainer,
)

V = 256
IMAGE = 250


_one_thread = pytest.fixture(autouse=True, scope="module")(single_thread)


def make_processor():
    """A LLaVA processor: word-level tokenizer (``<image>`` = 250), CLIP's image processor at
    8x8, 4 image tokens per image (a 2x2 patch grid, CLIP's class token dropped)."""
    words = {"<pad>": 0, "<eos>": 1, "<bos>": 2, **{f"w{i}": i + 3 for i in range(200)}}
    words.update({"<image>": IMAGE, "<user>": 251, "<assistant>": 252})
    tokenizer = word_tokenizer(
        words, extra_special_tokens={"image_token": "<image>"}, padding_side="left"
    )
    template = (
        "{% for m in messages %}<user> {% for c in m['content'] %}{% if c['type'] == 'image' %}"
        "<image> {% else %}{{ c['text'] }} {% endif %}{% endfor %}{% endfor %}"
        "{% if add_generation_prompt %}<assistant> {% endif %}"
    )
    images = transformers.CLIPImageProcessor(
        size={"shortest_edge": 8}, crop_size={"height": 8, "width": 8}
    )
    return transformers.LlavaProcessor(
        image_processor=images, tokenizer=tokenizer, patch_size=4,
        vision_feature_select_strategy="default", chat_template=template, image_token="<image>",
        num_additional_image_tokens=1,
    )  # fmt: skip


def make_model(width: int = 16, seed: int = 0):
    text = dict(
        vocab_size=V, hidden_size=width, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, pad_token_id=0, eos_token_id=1,
        bos_token_id=2,
    )  # fmt: skip
    config = transformers.LlavaConfig(
        text_config=transformers.LlamaConfig(**text),
        vision_config=transformers.CLIPVisionConfig(
            hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            image_size=8, patch_size=4, projection_dim=16,
        ),
        image_token_id=IMAGE, vision_feature_layer=-2, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(config)
    with torch.no_grad():  # logits of a few units: a peaked, non-uniform softmax
        model.lm_head.weight.normal_(0.0, 0.5)
    model.generation_config.eos_token_id = 1
    model.generation_config.pad_token_id = 0
    return model


def _dataset():
    rng = np.random.default_rng(0)
    prompts = [
        [{"role": "user", "content": " ".join(f"w{(7 * i + j) % 200}" for j in range(2 + i % 3))}]
        for i in range(8)
    ]
    images = [
        PIL.fromarray((rng.random((8, 8, 3)) * 255).astype("uint8")) for _ in range(len(prompts))
    ]
    return datasets.Dataset.from_dict({"prompt": prompts, "image": images})


def make_gemma3_processor(padding_side: str = "left"):
    """A Gemma-3 processor: ``<start_of_image>`` expands to 4 ``<image_soft_token>`` (= 250)
    between the image delimiters; the processor returns token_type_ids (1 at image tokens).
    Left padding, as TRL loads a processor itself (its prompt ids are left-padded)."""
    words = {"<pad>": 0, "<eos>": 1, "<bos>": 2, **{f"w{i}": i + 3 for i in range(200)}}
    words.update({"<image_soft_token>": IMAGE, "<start_of_image>": 251, "<end_of_image>": 252})
    words.update({"<user>": 253, "<assistant>": 254})
    special = {"image_token": "<image_soft_token>", "boi_token": "<start_of_image>"}
    tokenizer = word_tokenizer(
        words, extra_special_tokens={**special, "eoi_token": "<end_of_image>"},
        padding_side=padding_side,
    )  # fmt: skip
    template = (
        "{% for m in messages %}<user> {% for c in m['content'] %}{% if c['type'] == 'image' %}"
        "<start_of_image> {% else %}{{ c['text'] }} {% endif %}{% endfor %}{% endfor %}"
        "{% if add_generation_prompt %}<assistant> {% endif %}"
    )
    images = transformers.Gemma3ImageProcessor(
        size={"height": 8, "width": 8}, do_pan_and_scan=False
    )
    return transformers.Gemma3Processor(
        image_processor=images, tokenizer=tokenizer, chat_template=template, image_seq_length=4
    )


def make_gemma3_model():
    text = transformers.Gemma3TextConfig(
        vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, pad_token_id=0,
        eos_token_id=1, bos_token_id=2,
    )  # fmt: skip
    config = transformers.Gemma3Config(
        text_config=text,
        vision_config=transformers.SiglipVisionConfig(
            hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            image_size=8, patch_size=2,
        ),
        mm_tokens_per_image=4, image_token_id=IMAGE, boi_token_id=251, eoi_token_id=252,
        pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.5)
        # zero at init: no gradient would reach the vision tower
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.3)
    model.generation_config.eos_token_id = 1
    model.generation_config.pad_token_id = 0
    return model


_FAMILIES = {
    "llava": (make_model, make_processor),
    "gemma3": (make_gemma3_model, make_gemma3_processor),
}


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_gemma3")
    make_gemma3_model().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny LLaVA saved locally: the trainer loads the policy, and with beta > 0 the
    reference model, from this path."""
    path = tmp_path_factory.mktemp("tiny_llava")
    make_model().save_pretrained(path)
    return str(path)


def _train(cls, model_dir, tmp_path, family="llava", **options):
    args = dict(
        per_device_train_batch_size=4, num_generations=4, gradient_accumulation_steps=2,
        num_iterations=2, max_steps=2, max_completion_length=6, optim="sgd", learning_rate=0.05,
    )  # fmt: skip
    trainer = cls(
        model=model_dir,
        reward_funcs=reward,
        args=_args(tmp_path, **(args | options)),
        train_dataset=_dataset(),
        processing_class=_FAMILIES[family][1](),
    )
    assert trainer._is_vlm
    trainer.train()
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return trainer.state.log_history, params


@pytest.mark.parametrize(
    ("family", "options"),
    [
        ("llava", {}),
        ("llava", {"loss_type": "grpo", "beta": 0.05, "entropy_coef": 0.01}),
        ("gemma3", {"loss_type": "grpo", "beta": 0.05}),
    ],
    ids=["llava-dapo", "llava-grpo_kl_entropy", "gemma3-grpo_kl"],
)
def test_train_on_images_matches_trl(family, options, model_dir, gemma3_dir, tmp_path):
    """Generation from image prompts, rewards, 2 iterations (off-policy old log-probs on the
    second), gradient accumulation 2: the same losses, metrics and weights as stock TRL, and
    the vision tower and projector trained. Gemma-3: its processor's token_type_ids too."""
    path = gemma3_dir if family == "gemma3" else model_dir
    runs = [
        _train(cls, path, tmp_path / sub, family, **options)
        for cls, sub in ((trl.GRPOTrainer, "a"), (LogitlessGRPOTrainer, "b"))
    ]
    (stock_log, stock_params), (ours_log, ours_params) = runs
    initial = {n: p.detach() for n, p in _FAMILIES[family][0]().named_parameters()}
    moved = assert_same_run(stock_log, stock_params, ours_log, ours_params, initial)
    assert moved > 0
    vision = [n for n in initial if n.startswith(("model.vision_tower.", "model.multi_modal"))]
    trained = [n for n in vision if not torch.equal(ours_params[n], initial[n])]
    assert trained and any(n.startswith("model.multi_modal_projector.") for n in trained)
    assert any(n.startswith("model.vision_tower.") for n in trained)


def test_misaligned_token_type_ids_are_refused(gemma3_dir, tmp_path):
    """A processor that pads on the right, passed to TRL (which left-pads the prompt ids it
    takes from the chat template): TRL's token_type_ids then sit one pad off the image tokens
    of left-padded rows, and stock TRL runs on with Gemma-3's bidirectional image mask on the
    wrong tokens. The adapter refuses the batch, naming token_type_ids."""
    trainer = LogitlessGRPOTrainer(
        model=gemma3_dir, reward_funcs=reward,
        args=_args(tmp_path, per_device_train_batch_size=4, num_generations=4, max_steps=1,
                   max_completion_length=4),
        train_dataset=_dataset(), processing_class=make_gemma3_processor("right"),
    )  # fmt: skip
    with pytest.raises(ValueError, match="token_type_ids must be 1 at token id 250"):
        trainer.train()


def test_scoring_in_chunks_slices_the_images(tmp_path):
    """TRL scores old-policy log-probs ``batch_size`` rows at a time: each chunk gets its own
    rows' images (``num_images`` per row; a text-only row has none)."""
    trainer = LogitlessGRPOTrainer(
        model=make_model(), reward_funcs=reward, args=_args(tmp_path), train_dataset=_dataset(),
        processing_class=make_processor(),
    )  # fmt: skip
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 200, (4, 12), generator=g)
    ids[0, 1:5] = IMAGE
    ids[2, 2:6] = IMAGE
    ids[2, 7:11] = IMAGE  # two images in row 2, none in rows 1 and 3
    mask = torch.ones_like(ids)
    pixels = torch.randn(3, 3, 8, 8, generator=g)
    kw = dict(pixel_values=pixels, num_images=[1, 0, 2, 0])
    with torch.no_grad():
        whole = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, mask, 4, compute_entropy=True, **kw
        )
        chunks = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, mask, 4, batch_size=1, compute_entropy=True, **kw
        )
        row2 = trainer.model(ids[2:3], pixel_values=pixels[1:], use_cache=False).logits
    for a, b in zip(whole[:2], chunks[:2], strict=True):
        torch.testing.assert_close(a, b)
    want = row2[0, -5:-1].float().log_softmax(-1).gather(-1, ids[2, -4:, None])[:, 0]
    torch.testing.assert_close(whole[0][2], want)
    with pytest.raises(ValueError, match="pixel_attention_mask"):
        trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, mask, 4, pixel_attention_mask=torch.ones(3, 8, 8), **kw
        )


# --------------------------------------------------------------------------------------------
# distillation: TRL's DistillationTrainer takes a VLM student and teacher


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llava_teacher")
    make_model(width=24, seed=1).save_pretrained(path)
    return str(path)


def _distiller(cls, model_dir, teacher_dir, tmp_path, **options):
    args = dict(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_completion_length=6,
        gradient_accumulation_steps=2, max_steps=2, bf16=False, use_cpu=True, report_to=[],
        save_strategy="no", seed=0, logging_steps=1, optim="sgd", learning_rate=0.2,
    )  # fmt: skip
    return cls(
        model=model_dir, teacher_model=teacher_dir,
        args=trl.DistillationConfig(**(args | options)), train_dataset=_dataset(),
        processing_class=make_processor(),
    )  # fmt: skip


def test_distillation_loss_on_images_matches_trl(model_dir, teacher_dir, tmp_path):
    stock = _distiller(trl.DistillationTrainer, model_dir, teacher_dir, tmp_path / "a", beta=0.5)
    ours = _distiller(
        LogitlessDistillationTrainer, model_dir, teacher_dir, tmp_path / "b", beta=0.5
    )
    inputs = stock._generate_and_score_completions(next(iter(stock.get_train_dataloader())))
    assert inputs["pixel_values"].shape[0] == inputs["prompt_ids"].shape[0]
    grads = []
    for trainer in (ours, stock):
        trainer.model.train()
        trainer.model.zero_grad(set_to_none=True)
        loss = trainer.compute_loss(trainer.model, dict(inputs))
        loss.backward()
        named = {n: p.grad for n, p in trainer.model.named_parameters()}
        grads.append((loss.detach(), named))
    (a, ga), (b, gb) = grads
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert set(ga) == set(gb)
    for name, g in gb.items():
        if g is None:  # LLaVA's last vision layer: its output is never read
            assert ga[name] is None, name
            continue
        atol = 1e-6 * max(1.0, float(g.abs().max()))
        torch.testing.assert_close(ga[name], g, rtol=1e-4, atol=atol, msg=name)
    assert any(
        ga[n] is not None and bool(ga[n].any()) for n in ga if n.startswith("model.vision_tower.")
    )


def test_distillation_train_on_images_matches_trl(model_dir, teacher_dir, tmp_path):
    runs = []
    for cls, sub in ((trl.DistillationTrainer, "a"), (LogitlessDistillationTrainer, "b")):
        trainer = _distiller(cls, model_dir, teacher_dir, tmp_path / sub, beta=0.5)
        trainer.train()
        params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        runs.append((trainer.state.log_history, params))
    initial = {n: p.detach() for n, p in make_model().named_parameters()}
    assert assert_same_run(*runs[0], *runs[1], initial) > 0


# --------------------------------------------------------------------------------------------
# Qwen2-VL: its processor needs torchvision, so the batch is built here as TRL's scoring builds
# it (left-padded prompts with image tokens, mm_token_type_ids over prompt + completion, one
# pixel row per patch of image_grid_thw, num_images per row); the trainers get the LLaVA
# processor only to construct (compute_loss reads the batch alone).


def _qwen_batch():
    from test_hf_vlm import _model as vlm_model

    model = vlm_model("qwen2_vl")
    g = torch.Generator().manual_seed(5)
    B, P, C = 4, 12, 5
    prompt = torch.randint(3, 200, (B, P), generator=g)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[1, :3] = 0  # left padding
    prompt_mask[3, :5] = 0
    prompt = prompt.masked_fill(prompt_mask == 0, 0)
    prompt[0, 2:6] = IMAGE  # a 4-token image (grid 1x4x4)
    prompt[1, 4:6] = IMAGE  # a 2-token image (grid 1x2x4)
    prompt[1, 7:11] = IMAGE  # and a 4-token one; row 2 is text only
    prompt[3, 6:8] = IMAGE  # a 2-token image
    grid = torch.tensor([[1, 4, 4], [1, 2, 4], [1, 4, 4], [1, 2, 4]])
    completion = torch.randint(3, 200, (B, C), generator=g)
    completion_mask = torch.ones(B, C, dtype=torch.long)
    completion_mask[2, 3:] = 0
    ids = torch.cat([prompt, completion], 1)
    with torch.no_grad():
        old = torch.randn(B, C, generator=g) * 0.1 - 5.0
    inputs = {
        "prompt_ids": prompt,
        "prompt_mask": prompt_mask,
        "completion_ids": completion,
        "completion_mask": completion_mask,
        "advantages": torch.randn(B, generator=g),
        "num_items_in_batch": completion_mask.sum(),
        "old_per_token_logps": old,
        "pixel_values": torch.randn(int(grid.prod(-1).sum()), 24, generator=g),
        "image_grid_thw": grid,
        "num_images": [1, 2, 0, 1],
        "mm_token_type_ids": (ids == IMAGE).int(),
    }
    return model, inputs


@pytest.mark.parametrize("options", [{}, {"loss_type": "grpo", "entropy_coef": 0.01}])
def test_qwen2_vl_compute_loss_matches_trl(options, tmp_path):
    import copy

    model, inputs = _qwen_batch()
    args = _args(tmp_path, per_device_train_batch_size=4, **options)
    trainers = [
        cls(
            model=copy.deepcopy(model),
            reward_funcs=reward,
            args=args,
            train_dataset=_dataset(),
            processing_class=make_processor(),
        )  # fmt: skip
        for cls in (LogitlessGRPOTrainer, trl.GRPOTrainer)
    ]
    results = []
    for trainer in trainers:
        trainer.current_gradient_accumulation_steps = 2
        trainer.model.train()
        trainer.model.zero_grad(set_to_none=True)
        loss = trainer.compute_loss(trainer.model, dict(inputs))
        loss.backward()
        grads = {n: p.grad for n, p in trainer.model.named_parameters()}
        metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        att = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        images = {k: inputs[k] for k in ("pixel_values", "image_grid_thw", "num_images")}
        with torch.no_grad():  # scoring two rows at a time: the images sliced per row
            scored = trainer._get_per_token_logps_and_entropies(
                trainer.model, ids, att, 5, batch_size=2, compute_entropy=True,
                mm_token_type_ids=inputs["mm_token_type_ids"], **images,
            )[:2]  # fmt: skip
        results.append((loss.detach(), grads, metrics, scored))
    (a, ga, ma, sa), (b, gb, mb, sb) = results
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    mask = inputs["completion_mask"].bool()
    for x, y in zip(sa, sb, strict=True):
        torch.testing.assert_close(x[mask], y[mask], rtol=1e-5, atol=1e-5)
    for name, g in gb.items():
        assert g is not None and ga[name] is not None, name
        atol = 1e-6 * max(1.0, float(g.abs().max()))
        torch.testing.assert_close(ga[name], g, rtol=1e-4, atol=atol, msg=name)
    assert bool(ga["model.visual.patch_embed.proj.weight"].any())
    for key, value in ma.items():
        assert value == pytest.approx(mb[key], rel=1e-4, abs=1e-6), key
