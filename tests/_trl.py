"""What the TRL tests share: tiny models, a tokenizer, data, trainer builders, run comparisons.

tests/test_trl.py (single process), test_trl_distill.py, test_trl_distributed.py (DDP,
FSDP2), test_trl_deepspeed.py and test_trl_vlm.py build their trainers from these. Models are
tiny random Qwen2s (or a Qwen3-MoE) saved locally; their word-level tokenizer is kept in memory
(:data:`TOKENIZERS`, by model path), so nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
import trl
from _tolerance import FLOOR, assert_no_worse_than_reference

V = 96
EOS = 1

# the 2-rank train() runs (DDP, FSDP2, DeepSpeed): 2 iterations of each batch, gradient
# accumulation 2, 2 optimizer steps
RUN = dict(
    per_device_train_batch_size=4,
    num_generations=4,
    gradient_accumulation_steps=2,
    num_iterations=2,
    max_steps=2,
    max_completion_length=6,
    optim="sgd",
    learning_rate=0.05,
)

TOKENIZERS: dict = {}  # model path -> its tokenizer
TIMING_KEYS = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")


def single_thread():
    """Body of a module-scoped autouse fixture: tiny models gain nothing from intra-op threads
    on a shared 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def word_tokenizer(words: dict, **kwargs):
    """A whitespace-split word-level fast tokenizer over ``words`` (unknown words: ``<pad>``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", **kwargs
    )


def make_tokenizer():
    """A word-level tokenizer over V ids: <pad>, <eos>, <bos>, w0 .. w{V-4}."""
    return word_tokenizer(
        {"<pad>": 0, "<eos>": EOS, "<bos>": 2, **{f"w{i}": i + 3 for i in range(V - 3)}}
    )


def save_model(
    path, *, tied: bool = False, moe: bool = False, hybrid: bool = False, width: int = 16
) -> str:
    """A tiny random Qwen2 (or Qwen3-MoE: 4 experts, 2 per token, router loss on; or the
    Qwen3.5 text model: a Gated DeltaNet layer, then an attention layer) saved at ``path``; its
    tokenizer registered in memory. Returns ``str(path)``."""
    small = dict(
        vocab_size=V, hidden_size=width, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, pad_token_id=0, eos_token_id=EOS,
        bos_token_id=2, tie_word_embeddings=tied,
    )  # fmt: skip
    if moe:
        config = transformers.Qwen3MoeConfig(
            **small, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
            output_router_logits=True, router_aux_loss_coef=0.02,
        )  # fmt: skip
    elif hybrid:
        config = transformers.Qwen3_5TextConfig(
            **small, head_dim=8, layer_types=["linear_attention", "full_attention"],
            linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
            linear_num_value_heads=2,
        )  # fmt: skip
    else:
        config = transformers.Qwen2Config(**small)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # logits of a few units: a peaked, non-uniform softmax
        model.lm_head.weight.normal_(0.0, 0.5)
    model.save_pretrained(path)
    TOKENIZERS[str(path)] = make_tokenizer()
    return str(path)


def dataset():
    import datasets

    prompts = [" ".join(f"w{(7 * i + j) % (V - 3)}" for j in range(2 + i % 4)) for i in range(8)]
    return datasets.Dataset.from_dict({"prompt": prompts})


def reward(completions, **kwargs):
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [len(t) / 10.0 + (sum(map(ord, t)) % 7) / 7.0 for t in texts]


def grpo_args(tmp_path, **overrides):
    base = dict(
        output_dir=str(Path(tmp_path) / "out"),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=7,
        gradient_accumulation_steps=2,
        bf16=False,
        report_to=[],
        gradient_checkpointing=False,
        use_cpu=True,
        save_strategy="no",
        seed=0,
        logging_steps=1,
    )
    base.update(overrides)
    return trl.GRPOConfig(**base)


def grpo_trainer(cls, model_dir, args, peft_config=None, **attrs):
    trainer = cls(
        model=model_dir,
        reward_funcs=reward,
        args=args,
        train_dataset=dataset(),
        processing_class=TOKENIZERS[model_dir],
        peft_config=peft_config,
    )
    for name, value in attrs.items():
        setattr(trainer, name, value)
    return trainer


def distill_trainer(cls, student: str, teacher: str, output_dir, **options):
    """``cls`` (a distillation trainer) on a student and teacher saved by :func:`save_model`:
    the 2-rank runs' options (JSD, a temperature, gradient accumulation 2, 2 SGD steps)."""
    args = dict(
        output_dir=str(output_dir), per_device_train_batch_size=2, max_completion_length=6,
        gradient_accumulation_steps=2, max_steps=2, bf16=False, use_cpu=True, report_to=[],
        save_strategy="no", seed=0, logging_steps=1, optim="sgd", learning_rate=0.2, beta=0.5,
        temperature=0.8,
    )  # fmt: skip
    return cls(
        model=student,
        teacher_model=teacher,
        args=trl.DistillationConfig(**(args | options)),
        train_dataset=dataset(),
        processing_class=TOKENIZERS[student],
    )


def assert_same_run(stock_log, stock_params, ours_log, ours_params, initial) -> int:
    """The same logged losses and metrics and the same final weights (TRL's float rounding
    aside); returns how many parameters moved from ``initial``."""
    steps = [e for e in stock_log if "loss" in e]
    assert len(steps) >= 2 and len([e for e in ours_log if "loss" in e]) == len(steps)
    for s, o in zip(stock_log, ours_log, strict=True):
        assert set(s) == set(o)
        for key in s:
            if key not in TIMING_KEYS:
                assert o[key] == pytest.approx(s[key], rel=2e-4, abs=1e-6), key
    assert set(ours_params) == set(stock_params)
    for name, p in stock_params.items():
        torch.testing.assert_close(ours_params[name], p, rtol=1e-5, atol=1e-6, msg=name)
    return _moved(stock_params, initial)


def assert_run_no_worse(ours, stock, truth, initial, name: str = "") -> int:
    """A run held to stock TRL's own error: each run is ``(log_history, final params)``;
    ``truth`` is stock TRL's run of the same steps in float64. Every logged value and every
    final parameter of ``ours`` is within 4x stock's error against the truth (max and rms)
    plus a floor (tests/_tolerance.py; 4 ulps of scale for the logged scalars, which are means
    of sums); returns how many parameters moved from ``initial``."""
    (o_log, o_params), (s_log, s_params), (t_log, t_params) = ours, stock, truth
    assert len([e for e in t_log if "loss" in e]) >= 2
    assert len(o_log) == len(s_log) == len(t_log), name
    for step, (o, s, t) in enumerate(zip(o_log, s_log, t_log, strict=True)):
        # ZeRO stage 0 logs no grad_norm (it clips, but keeps no norm): a key the truth may add
        assert set(o) == set(s) <= set(t), (name, step, set(o) ^ set(s), set(s) - set(t))
        for key in sorted(set(s) - set(TIMING_KEYS)):
            values = (torch.tensor(float(e[key]), dtype=torch.float64) for e in (o, s, t))
            assert_no_worse_than_reference(*values, f"{name} log {step} {key}", floor=4 * FLOOR)
    assert set(o_params) == set(s_params) == set(t_params), name
    for param, t in t_params.items():
        assert_no_worse_than_reference(o_params[param], s_params[param], t, f"{name} {param}")
    return _moved(s_params, initial)


def _moved(params, initial) -> int:
    return sum(int(n not in initial or not torch.equal(p, initial[n])) for n, p in params.items())


def initial(model_dir, _cache={}):  # noqa: B006 (a per-process cache)
    """The parameters of the model saved at ``model_dir``."""
    if model_dir not in _cache:
        m = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
        _cache[model_dir] = {n: p.detach() for n, p in m.named_parameters()}
    return _cache[model_dir]


def lora_base(model_dir, names) -> dict:
    """The initial base-model parameters of a PEFT model saved at ``model_dir``, under PEFT's
    ``names`` (prefixed; a wrapped layer's in ``base_layer``); the adapters are left out."""
    start = initial(model_dir)
    return {
        n: start[n.removeprefix("base_model.model.").replace("base_layer.", "")]
        for n in names
        if "lora_" not in n
    }
