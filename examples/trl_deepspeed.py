"""LogitlessGRPOTrainer under DeepSpeed ZeRO-3, launched by accelerate (docs/trl.md, DeepSpeed).

    # a CPU box: 2 processes on DeepSpeed's CPU accelerator (gloo), fp32
    DS_ACCELERATOR=cpu accelerate launch --config_file examples/accelerate/ds_zero3_cpu.yaml examples/trl_deepspeed.py
    # GPUs: one node, 8 processes, bf16
    accelerate launch --config_file examples/accelerate/ds_zero3.yaml examples/trl_deepspeed.py

Two GRPO steps on a tiny random Qwen2 built from a config, with a word-level tokenizer: nothing
is downloaded (in real code: your model name, dataset and rewards). The script holds no
DeepSpeed code: the accelerate config carries it, and its ``mixed_precision`` must agree with
the trainer's ``bf16`` (transformers refuses the run otherwise). The first CPU launch
JIT-builds DeepSpeed's shared-memory communication op (a few minutes; cached under
``~/.cache/torch_extensions``, or ``$TORCH_EXTENSIONS_DIR``).
"""  # noqa: E501 (the commands, whole)

import tempfile

import torch
import transformers
import trl
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers

from logitless.integrations.trl import LogitlessGRPOTrainer


def main() -> None:
    words = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(62)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>"
    )
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, pad_token_id=0, eos_token_id=1))  # fmt: skip

    gpu = torch.cuda.is_available()
    args = trl.GRPOConfig(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, num_generations=4,
        max_completion_length=6, max_steps=2, logging_steps=1, report_to=[], save_strategy="no",
        bf16=gpu, use_cpu=not gpu,  # the accelerate config's mixed_precision: bf16 / 'no'
    )  # fmt: skip
    trainer = LogitlessGRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **kw: [c.count("w1") / 6 for c in completions],
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["w3 w4", "w5", "w6 w7 w8", "w9"] * 4}),
        processing_class=tokenizer,
    )
    trainer.train()
    if trainer.accelerator.is_main_process:
        losses = [round(e["loss"], 5) for e in trainer.state.log_history if "loss" in e]
        setup = trainer.accelerator.state.deepspeed_plugin
        stage = f"ZeRO-{setup.zero_stage}" if setup is not None else "no DeepSpeed"
        print(f"{stage}, {trainer.accelerator.num_processes} processes: losses {losses}")


if __name__ == "__main__":
    main()
