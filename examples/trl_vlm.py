"""GRPO on a vision-language policy with ``LogitlessGRPOTrainer``: image prompts, a tiny LLaVA.

    python examples/trl_vlm.py            # CPU, under a minute; nothing is downloaded

The model (a CLIP vision tower, a projector and a Llama language model) and its processor (a
word-level tokenizer, CLIP's image processor, a chat template) are built here from configs, at
random. In real code each is one line: ``model="llava-hf/llava-1.5-7b-hf"`` (a name or a path:
TRL loads it) and ``AutoProcessor.from_pretrained(name, padding_side="left")``. The lines
between the ``recipe`` markers are docs/trl.md's example (tests/test_docs.py runs this script and
checks that they match).
"""

import tempfile

import numpy as np
import torch
import transformers
import trl
from datasets import Dataset
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers

from logitless.integrations.trl import LogitlessGRPOTrainer

IMAGE_TOKEN = 250  # the id of "<image>": the processor expands it to 4, one per image patch


def tiny_processor() -> transformers.LlavaProcessor:
    """Words w0..w199, ``<image>``, and a chat template: ``<user> <image> w3 w4 <assistant>``.
    Left padding, as TRL loads a processor itself."""
    words = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(200)}}
    words.update({"<image>": IMAGE_TOKEN, "<user>": 251, "<assistant>": 252})
    tok = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", padding_side="left",
        extra_special_tokens={"image_token": "<image>"},
    )  # fmt: skip
    template = (
        "{% for m in messages %}<user> {% for c in m['content'] %}{% if c['type'] == 'image' %}"
        "<image> {% else %}{{ c['text'] }} {% endif %}{% endfor %}{% endfor %}"
        "{% if add_generation_prompt %}<assistant> {% endif %}"
    )
    images = transformers.CLIPImageProcessor(
        size={"shortest_edge": 8}, crop_size={"height": 8, "width": 8}
    )
    return transformers.LlavaProcessor(
        image_processor=images, tokenizer=tokenizer, patch_size=4, chat_template=template,
        vision_feature_select_strategy="default", image_token="<image>",
        num_additional_image_tokens=1,  # CLIP's class token, dropped by "default"
    )  # fmt: skip


def tiny_llava() -> transformers.LlavaForConditionalGeneration:
    """8x8 images in 4x4 patches, a 2-layer Llama of width 16 over 256 ids."""
    torch.manual_seed(0)
    config = transformers.LlavaConfig(
        text_config=transformers.LlamaConfig(
            vocab_size=256, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, pad_token_id=0, eos_token_id=1,
        ),
        vision_config=transformers.CLIPVisionConfig(
            hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            image_size=8, patch_size=4,
        ),
        image_token_id=IMAGE_TOKEN, vision_feature_layer=-2, pad_token_id=0,
    )  # fmt: skip
    model = transformers.LlavaForConditionalGeneration(config)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = 1, 0
    return model


def image_prompts(n: int = 8) -> Dataset:
    """TRL's vision-language format: a conversational ``prompt`` and an ``image`` per row."""
    rng = np.random.default_rng(0)
    return Dataset.from_dict({
        "prompt": [[{"role": "user", "content": f"w{3 * i} w{3 * i + 1}"}] for i in range(n)],
        "image": [Image.fromarray(rng.integers(0, 256, (8, 8, 3), np.uint8)) for _ in range(n)],
    })  # fmt: skip


def main() -> None:
    model, processor, dataset = tiny_llava(), tiny_processor(), image_prompts()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    # [recipe]
    def reward(completions, **kwargs):  # completions: [{"role": "assistant", "content": ...}]
        return [c[0]["content"].count("w1") / 6 for c in completions]

    args = trl.GRPOConfig(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, num_generations=4,
        max_completion_length=6, max_steps=2, logging_steps=1, report_to=[], save_strategy="no",
        bf16=False, use_cpu=True,  # on a GPU: drop these two
    )  # fmt: skip
    trainer = LogitlessGRPOTrainer(
        model=model,  # or a name / path, e.g. "llava-hf/llava-1.5-7b-hf"
        reward_funcs=reward,
        args=args,
        train_dataset=dataset,  # "prompt" (a conversation) and "image" per row
        processing_class=processor,  # pads on the left, as TRL loads a processor itself
    )
    trainer.train()
    # [/recipe]
    losses = [f"{e['loss']:.4g}" for e in trainer.state.log_history if "loss" in e]
    moved = {  # vision_tower, multi_modal_projector, language_model, lm_head
        name.removeprefix("model.").split(".")[0]
        for name, p in trainer.model.named_parameters()
        if not torch.equal(p, before[name])
    }
    print(f"losses {', '.join(losses)}; trained: {', '.join(sorted(moved))}")


if __name__ == "__main__":
    main()
