"""logitless.integrations.hf with wrapped models: DDP and FSDP2 on 2 gloo ranks (CPU).

A tiny random Llama (tied or untied head) is wrapped in ``DistributedDataParallel``, or in
FSDP2: ``fully_shard`` on each decoder layer, then on the model (the head in the root's group),
or with ``lm_head`` a unit of its own as accelerate's FSDP2 shards it. Each rank holds
different rows of one batch and calls
``hf.causal_lm_policy_loss`` / ``hf.causal_lm_logprobs`` with the *wrapped* model; the loss is
normalized by the global counts (``loss_normalizer(..., process_group=..., loss_scale=2)``), so
after the wrapper averages the gradients every rank holds the whole batch's gradient.

Compared with one process on the whole batch: the ranks' losses sum to its loss, the log-probs
of each rank's rows are its rows', and every parameter's gradient (FSDP2: gathered with
``full_tensor()``) equals its gradient. The comparison is sensitive: calling the unwrapped model
under DDP (what logitless did before it ran inside the wrapper's forward) leaves the gradients
un-averaged and fails it (``test_bypassing_ddp_is_caught``).
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist
from _dist import spawn
from torch import nn

from logitless import PolicyLossConfig, loss_normalizer
from logitless.integrations import hf

transformers = pytest.importorskip("transformers")

V = 67  # odd: FSDP2 shards the head's rows unevenly
WORLD = 2
ROWS = {0: [0, 1], 1: [2, 3, 4]}  # uneven rows per rank
CONFIG = PolicyLossConfig(clip_high=0.28, kl_coef=0.05, entropy_coef=0.01)


def _model(tied: bool) -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.5)
    return model.train()


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    B, T = 5, 9
    ids = torch.randint(3, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    for b, pad in enumerate([0, 2, 3, 1, 4]):  # left padding
        mask[b, :pad] = 0
    response = torch.zeros(B, T, dtype=torch.bool)
    response[:, 5:] = True
    old = 0.1 * torch.randn(B, T, generator=g) - 4.0
    return dict(
        ids=ids, mask=mask, response=response, old=old, ref=old + 0.05,
        adv=torch.randn(B, generator=g),
    )  # fmt: skip


def _rows(batch: dict, rows: list[int]) -> dict:
    return {k: v[rows] for k, v in batch.items()}


def _loss_and_logprobs(model, b: dict, normalizer):
    with torch.no_grad():
        logprobs = hf.causal_lm_logprobs(
            model, b["ids"], attention_mask=b["mask"], response_mask=b["response"]
        ).logprobs
    loss, _ = hf.causal_lm_policy_loss(
        model, b["ids"], b["old"], b["adv"], config=CONFIG, attention_mask=b["mask"],
        response_mask=b["response"], ref_logprobs=b["ref"], normalizer=normalizer,
    )  # fmt: skip
    return loss, logprobs


def _wrap(model: nn.Module, kind: str) -> nn.Module:
    if kind == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    if kind == "fsdp2_head_apart":
        fully_shard(model.lm_head)
    return fully_shard(model)


def _full(grad: torch.Tensor) -> torch.Tensor:
    return grad.full_tensor() if hasattr(grad, "full_tensor") else grad


def _worker(rank: int, world: int, kind: str, tied: bool, bypass: bool = False, compiled=False):
    torch.set_num_threads(1)
    model = _model(tied)
    if compiled:  # the backbone compiled in place (aot_eager: the graph capture, no C++ build)
        model.model.compile(backend="aot_eager")
    wrapped = _wrap(model, kind)
    b = _rows(_batch(), ROWS[rank])
    labels = hf.causal_lm_labels(b["ids"], attention_mask=b["mask"], response_mask=b["response"])
    normalizer = loss_normalizer(
        [labels != -100], process_group=dist.group.WORLD, loss_scale=float(world)
    )
    target = wrapped.module if bypass else wrapped
    loss, logprobs = _loss_and_logprobs(target, b, normalizer)
    loss.backward()
    grads = {n: _full(p.grad).clone() for n, p in wrapped.named_parameters()}
    grads = {n.removeprefix("module."): g for n, g in grads.items()}
    return loss.detach(), logprobs, grads


def _one_process(tied: bool):
    model = _model(tied)
    b = _batch()
    labels = hf.causal_lm_labels(b["ids"], attention_mask=b["mask"], response_mask=b["response"])
    loss, logprobs = _loss_and_logprobs(model, b, loss_normalizer([labels != -100]))
    loss.backward()
    return loss.detach(), logprobs, {n: p.grad for n, p in model.named_parameters()}


def _compare(results, tied: bool):
    loss, logprobs, grads = _one_process(tied)
    total = sum(r[0] for r in results) / WORLD  # loss_scale=WORLD: DDP/FSDP2 average
    torch.testing.assert_close(total, loss, rtol=1e-5, atol=1e-7)
    for rank, r in enumerate(results):
        torch.testing.assert_close(r[1], logprobs[ROWS[rank]], rtol=1e-5, atol=1e-6)
        assert set(r[2]) == set(grads)
        for name, g in grads.items():
            torch.testing.assert_close(r[2][name], g, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    ("kind", "tied"),
    [("ddp", False), ("ddp", True), ("fsdp2", False), ("fsdp2", True), ("fsdp2_head_apart", False)],
)
def test_wrapped_model_matches_one_process(kind, tied):
    """fsdp2_head_apart: lm_head an FSDP2 unit of its own (as accelerate shards it); the head
    then runs inside lm_head's forward, its weight gathered there."""
    _compare(spawn(_worker, WORLD, kind, tied, threads=1), tied)


@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_compiled_backbone_under_a_wrapper(kind):
    _compare(spawn(_worker, WORLD, kind, False, False, True, threads=1), False)


def test_bypassing_ddp_is_caught():
    """The inner model called directly (no reducer armed): the gradients stay per-rank, and
    the comparison above fails on them."""
    results = spawn(_worker, WORLD, "ddp", False, True, threads=1)
    with pytest.raises(AssertionError):
        _compare(results, False)


def _outside_worker(rank: int, world: int):
    model = _wrap(_model(False), "fsdp2")
    try:
        hf.causal_lm_head(model)
    except ValueError as e:
        return str(e)
    return "no error"


def test_fsdp2_head_outside_the_forward_is_refused():
    """Outside the model's forward the head weight is a shard: causal_lm_head says so."""
    messages = spawn(_outside_worker, WORLD, threads=1)
    assert all("sharded DTensor" in m for m in messages), messages


def test_unsupported_wrappers_are_refused():
    model = _model(False)

    class DeepSpeedEngine(nn.Module):  # found by the engine's class name; its config read
        def __init__(self, module):
            super().__init__()
            self.module = module
            offload = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}
            self._config = types.SimpleNamespace(_param_dict=offload)

    ids = torch.randint(3, V, (1, 5))
    with pytest.raises(ValueError, match="offload_param"):
        hf.causal_lm_logprobs(DeepSpeedEngine(model), ids)


# --------------------------------------------------------------------------------------------
# PEFT (single process): LoRA on the backbone, the adapters the only trainable parameters


@pytest.mark.parametrize("disabled", [False, True], ids=["adapter", "adapter_disabled"])
def test_peft_lora_model_matches_its_logits(disabled):
    """A LoRA PeftModel straight into the HF functions: the loss and the adapters' gradients
    equal policy_loss on the PeftModel's own logits; the frozen base gets no gradient; under
    ``disable_adapter()`` the numbers are the base model's."""
    peft = pytest.importorskip("peft")
    from logitless import policy_loss

    lora = peft.LoraConfig(  # random A and B: the adapters change the numbers from the start
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    model = peft.get_peft_model(_model(False), lora)
    b = _batch()
    labels = hf.causal_lm_labels(b["ids"], attention_mask=b["mask"], response_mask=b["response"])
    normalizer = loss_normalizer([labels != -100])
    context = model.disable_adapter() if disabled else torch.enable_grad()
    with context:
        loss = _loss_and_logprobs(model, b, normalizer)[0]
        logits = model(input_ids=b["ids"], attention_mask=b["mask"], use_cache=False).logits
    logp = logits.float().log_softmax(-1)
    lp = logp.gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    ent = -(logp.exp() * logp).sum(-1)
    valid = labels != -100
    ref, _ = policy_loss(
        torch.where(valid, lp, 0.0), b["old"], b["adv"], valid, config=CONFIG,
        ref_logprobs=b["ref"], entropy=ent, normalizer=normalizer,
    )  # fmt: skip
    torch.testing.assert_close(loss.detach(), ref.detach(), rtol=1e-5, atol=1e-6)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    if disabled:  # the adapters are not used: nothing to train through this loss
        assert not loss.requires_grad and not ref.requires_grad
        return
    ours = torch.autograd.grad(loss, [model.get_parameter(n) for n in trainable])
    theirs = torch.autograd.grad(ref, [model.get_parameter(n) for n in trainable])
    for n, a, t in zip(trainable, ours, theirs, strict=True):
        torch.testing.assert_close(a, t, rtol=1e-4, atol=1e-6, msg=n)
        assert bool(a.abs().sum() > 0), n
