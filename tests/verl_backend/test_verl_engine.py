"""logitless as verl's fused-kernel backend, through verl 0.9's own FSDP engine forward on CPU.

Each case runs ``FSDPEngineWithLMHead.forward_step`` (tests/verl_backend/_engine.py) on the same
tiny Qwen2 patched by verl's ``apply_monkey_patch`` three ways: ``impl_backend=logitless``, verl's
``impl_backend=torch`` and the unfused path (verl's logits -> log_softmax), plus the unfused path
on a float64 copy (the truth). The loss is ``Σ g·log_probs + Σ e·entropy`` with random ``g``,
``e``; log-probs, entropy and every parameter's gradient must be within 4x the fp32 paths'
error against float64 (tests/_tolerance.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
import verl.utils.tensordict_utils as tu
from _engine import (
    check_ranks_equal_one_process,
    cpu_devices,
    engine,
    forward_step,
    lv,
    micro_batch,
    patched,
    sharded_step,
    tiny_gemma2,
    tiny_model,
)
from _tolerance import assert_no_worse_than_reference

SEQS = [[5, 6, 7, 8, 9, 3, 2], [10, 11, 12], [13, 14, 15, 16, 1], [40, 41]]


@pytest.fixture(autouse=True)
def _cpu(monkeypatch):
    cpu_devices(monkeypatch)


def _upstream(seqs, seed=1, zero_last=False):
    n = sum(map(len, seqs))
    gen = torch.Generator().manual_seed(seed)
    g, e = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    keep = torch.ones(n, dtype=torch.bool)
    if zero_last:  # each sequence's last token: its label is a filler (below)
        keep[torch.tensor([len(s) for s in seqs]).cumsum(0) - 1] = False
    return g * keep, e * keep, keep


def _run(model, backend, seqs, *, rmpad=True, temperature=1.0, g=None, e=None, dtype=None):
    if dtype is not None:
        model = copy.deepcopy(model).to(dtype)
        g, e = g.to(dtype), e.to(dtype)
    mod = patched(model, backend, rmpad=rmpad)
    batch = micro_batch(seqs, temperature=temperature, fused=backend is not None, rmpad=rmpad)
    return forward_step(engine(mod), batch, g, e)


def _check(name, got, refs, truth, keep=None):
    for ref_name, ref in refs.items():
        a, r, t = got, ref, truth
        if keep is not None:
            a, r, t = a[keep], r[keep], t[keep]
        assert_no_worse_than_reference(a, r, t, f"{name} (reference: {ref_name})")


@pytest.mark.parametrize("rmpad", [True, False], ids=["remove_padding", "padded"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_forward_matches_torch_backend_and_unfused(rmpad, temperature):
    model = tiny_model()
    # Padded layout: verl's fused forwards roll each row's ids (a sequence's last token is
    # scored on the pad id, or its own first token), its unfused path rolls the packed row (the
    # next sequence's first token). Neither is a prediction anyone trains on; those positions
    # are left out of the comparison with the unfused paths and get no upstream gradient.
    g, e, keep = _upstream(SEQS, zero_last=not rmpad)
    kw = dict(rmpad=rmpad, temperature=temperature, g=g, e=e)
    ours = _run(model, "logitless", SEQS, **kw)
    torch_backend = _run(model, "torch", SEQS, **kw)
    unfused = _run(model, None, SEQS, **kw)
    truth = _run(model, None, SEQS, dtype=torch.float64, **kw)
    assert ours[0].dtype == torch.float32 and ours[1].dtype == torch.float32
    mask = None if rmpad else keep
    for i, name in enumerate(("log_probs", "entropy")):
        _check(name, ours[i], {"unfused": unfused[i]}, truth[i], mask)
        _check(name, ours[i], {"torch backend": torch_backend[i]}, truth[i], mask)
    if not rmpad:  # the fused paths agree with each other everywhere, fillers included
        torch.testing.assert_close(ours[0], torch_backend[0], rtol=1e-5, atol=1e-5)
    for n in truth[2]:
        refs = {"unfused": unfused[2][n], "torch backend": torch_backend[2][n]}
        _check(f"grad {n}", ours[2][n], refs, truth[2][n])


@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16], ids=["fp32_w", "bf16_w"])
def test_bf16_autocast_as_verl_runs_it(weights):
    """verl's engine runs the forward under autocast (bf16): the head's matmul in bf16 as
    ``lm_head`` / verl's torch backend run it, statistics in fp32. Held to the naive (unfused)
    bf16 path's error; the outputs also to verl's torch backend's. fp32 weights are verl's
    training default, bf16 the weights its default mixed precision hands the forward.

    Dtypes: logitless's log-probs and entropy are fp32 either way. verl's torch backend
    returns its entropy in the backbone's output dtype, its values rounded to the bf16 of
    the logits: bf16 with bf16 weights, fp32 holding bf16 values with fp32 weights."""
    model = copy.deepcopy(tiny_model()).to(weights)
    g, e, _ = _upstream(SEQS)
    outs = {}
    for b in ("logitless", "torch", None):
        mod = patched(model, b)
        eng = engine(mod, dtype=torch.bfloat16)
        outs[b] = forward_step(eng, micro_batch(SEQS, fused=b is not None), g, e)
    truth = _run(model, None, SEQS, g=g, e=e, dtype=torch.float64)
    assert outs["logitless"][0].dtype == torch.float32
    assert outs["logitless"][1].dtype == torch.float32
    verl_entropy = outs["torch"][1]
    assert verl_entropy.dtype == weights
    assert torch.equal(verl_entropy, verl_entropy.bfloat16().to(weights))  # bf16 values
    assert not torch.equal(outs["logitless"][1], outs["logitless"][1].bfloat16().float())
    for i, name in enumerate(("log_probs", "entropy")):
        refs = {"unfused": outs[None][i], "torch backend": outs["torch"][i]}
        _check(name, outs["logitless"][i], refs, truth[i])
    for n in truth[2]:
        _check(f"grad {n}", outs["logitless"][2][n], {"unfused": outs[None][2][n]}, truth[2][n])


def test_gemma2_final_logit_softcap_applied_where_verls_torch_backend_drops_it():
    """Gemma-2 computes its logits as ``30·tanh(z / 30)`` (``final_logit_softcapping``).
    verl 0.9's torch backend (``forward_with_torch_backend`` -> ``FusedLinearForPPO``) scores
    ``hidden @ lm_head.weight.T`` without it; logitless applies it. Held to the unfused path
    (the model's own softcapped logits -> verl's log-softmax) against float64, gradients too."""
    model = tiny_gemma2()
    g, e, _ = _upstream(SEQS)
    ours = _run(model, "logitless", SEQS, g=g, e=e)
    unfused = _run(model, None, SEQS, g=g, e=e)
    truth = _run(model, None, SEQS, g=g, e=e, dtype=torch.float64)
    for i, name in enumerate(("log_probs", "entropy")):
        _check(name, ours[i], {"unfused": unfused[i]}, truth[i])
    for n in truth[2]:
        _check(f"grad {n}", ours[2][n], {"unfused": unfused[2][n]}, truth[2][n])
    # the case is one where the softcap matters: verl's torch backend, which drops it, is
    # nats off (docs/migrating.md states this of verl 0.9.1)
    verl_torch = _run(model, "torch", SEQS)
    off = float((verl_torch[0] - truth[0]).abs().max())
    assert off > 5.0, f"verl's torch backend within {off:.3g} nats of the softcapped truth"


def test_the_switch_is_one_replaced_function_and_undone():
    import verl.models.transformers.monkey_patch as mp

    assert lv.installed()
    model = tiny_model(layers=0)
    cls_forward = type(model).forward
    ours = patched(model, "logitless")
    assert "forward" in vars(ours) and type(ours).forward is cls_forward  # instance, not class
    assert ours._verl_fused_kernels_backend == "logitless"
    lv.uninstall()
    try:
        assert not lv.installed() and mp.patch_forward_with_backends.__module__ == mp.__name__
        plain = patched(model, "logitless")  # verl's own function: an unknown value, skipped
        assert "forward" not in vars(plain)
    finally:
        lv.install()
    assert lv.installed()
    lv.install()  # idempotent: verl's function is still what uninstall restores
    lv.uninstall()
    assert mp.patch_forward_with_backends.__module__ == mp.__name__
    lv.install()
    # other values still reach verl's own function
    verl_torch = patched(model, "torch")
    assert type(verl_torch).forward is not cls_forward and "forward" not in vars(verl_torch)


def test_refused_by_name():
    model = tiny_model(layers=0)
    mod = patched(model, "logitless")
    ids = torch.tensor([[1, 2, 3]])
    cases = {
        "inputs_embeds": dict(inputs_embeds=torch.zeros(1, 3, 32)),
        "pixel_values given, but Qwen2ForCausalLM does not take it": dict(
            input_ids=ids, pixel_values=torch.zeros(1)
        ),
        "KV cache": dict(input_ids=ids, use_cache=True),
        "logits_to_keep": dict(input_ids=ids, logits_to_keep=1),
        "return_dict=False": dict(input_ids=ids, return_dict=False),
        "calculate_sum_pi_squared": dict(input_ids=ids, calculate_sum_pi_squared=True),
    }
    for what, kwargs in cases.items():
        with pytest.raises(ValueError, match=what.replace("(", r"\(").replace(")", r"\)")):
            mod(**kwargs)
    out = mod(input_ids=ids, return_dict=True)
    assert out.log_probs.shape == (1, 3) and out.entropy.dtype == torch.float32
    # models: a multimodal config, an unsupported class
    mm = tiny_model(layers=0)
    mm.config.vision_config = transformers.PretrainedConfig()
    with pytest.raises(ValueError, match="multimodal"):
        patched(mm, "logitless")
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=0, n_embd=16, n_head=2))
    with pytest.raises(ValueError, match="impl_backend=logitless: unsupported model GPT2"):
        lv.use(gpt2)
    # verl's engine refuses the sum of squared probabilities with any fused backend
    batch = micro_batch(SEQS)
    tu.assign_non_tensor(batch, calculate_sum_pi_squared=True)
    with pytest.raises(NotImplementedError, match="calculate_sum_pi_squared"):
        forward_step(engine(mod), batch)


@pytest.mark.parametrize("temperature", [0.0, float("nan")])
def test_a_bad_temperature_raises_before_the_backbone(temperature):
    """verl's engine hands the forward its temperature (a float, or a per-token tensor): one
    the head cannot use is refused by the seam's prepare, before the backbone's forward runs
    (it was refused inside the head, after the whole backbone)."""
    model = tiny_model(layers=1)
    mod = patched(model, "logitless")
    calls: list[int] = []
    handle = mod.model.register_forward_pre_hook(lambda *_: calls.append(1))
    ids = torch.tensor([[1, 2, 3, 4]])
    for temp in (temperature, torch.full((1, 4), temperature)):
        with pytest.raises(ValueError, match="temperature"):
            mod(input_ids=ids, temperature=temp)
    assert calls == []
    mod(input_ids=ids, temperature=0.5)  # a good one runs the backbone once
    handle.remove()
    assert calls == [1]


def test_batch_invariant_backend_gives_a_sequence_the_same_bits_in_any_company():
    """verl's exactness check: a sequence's log-probs do not depend on the micro-batch (the
    other sequences, their order, gradients or not). A backbone without decoder layers is
    token-local, so only the head could break it."""
    model = tiny_model(layers=0)
    mod = patched(model, "logitless_batch_invariant")
    target = [7, 8, 9, 10, 11, 12]
    others = [[20 + i for i in range(n)] for n in (3, 50, 17, 130, 1)]
    companies = [[target], [target, *others], [*others[::-1], target], [others[1], target]]
    seen = []
    for k, seqs in enumerate(companies):
        n = sum(map(len, seqs))
        g = e = torch.ones(n) if k % 2 else None
        lp, ent, _ = forward_step(engine(mod), micro_batch(seqs), g, e)
        start = sum(len(s) for s in seqs[: seqs.index(target)])
        seen.append((lp[start : start + len(target) - 1], ent[start : start + len(target) - 1]))
    for lp, ent in seen[1:]:
        assert torch.equal(lp, seen[0][0]) and torch.equal(ent, seen[0][1])


# --- Ulysses sequence parallelism on 2 gloo ranks, under FSDP2 ------------------------------


ULYSSES_SEQS = [*SEQS, [50, 51, 52, 53, 54, 55, 56, 57, 58]]  # 26 tokens: 13 a rank


def ulysses_case(group, mesh, world):
    """On each rank of the shared launch (``_engine.ulysses_worker``)."""
    model = tiny_model(layers=0)
    g, e, _ = _upstream(ULYSSES_SEQS)
    out = {}
    for backend in ("logitless", "torch", "logitless, lm_head unit"):
        out[backend] = sharded_step(
            model, backend.split(",")[0], mesh, group, world, micro_batch(ULYSSES_SEQS), g, e,
            unit=backend.endswith("unit"),
        )  # fmt: skip
    return out


def test_ulysses_two_ranks_under_fsdp2_equal_one_process(ulysses):
    seqs = ULYSSES_SEQS
    ranks = [r["text"] for r in ulysses]
    model = tiny_model(layers=0)
    g, e, _ = _upstream(seqs)
    one = _run(model, "logitless", seqs, g=g, e=e)
    unfused = _run(model, None, seqs, g=g, e=e)
    truth = _run(model, None, seqs, g=g, e=e, dtype=torch.float64)

    def grads(got, refs, truth, what):
        for n in truth[2]:
            ref = {k: v[2][n] for k, v in refs.items()}
            _check(f"grad {n} ({what})", got[2][n], ref, truth[2][n])

    # the head run inside lm_head's own unit too: the same rows, bit for bit
    ours = ("logitless", "logitless, lm_head unit")
    check_ranks_equal_one_process(ranks, one, unfused, truth, grads, ours)


def _tiny_qwen3_5_text() -> transformers.PreTrainedModel:
    """Qwen3.5's text model (a Gated DeltaNet layer, then an attention layer), from its config."""
    torch.manual_seed(0)
    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=tiny_model().config.vocab_size, hidden_size=32, intermediate_size=48,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        layer_types=["linear_attention", "full_attention"], linear_key_head_dim=8,
        linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
        attn_implementation="sdpa",
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.6)
    return model


def test_qwen3_5_text_model_one_sequence_per_row():
    """The Qwen3.5 text model (hybrid linear attention): verl 0.9.1 hands ``cu_seqlens`` to the
    vision-language classes' linear-attention layers only, so a remove-padding micro-batch of
    several sequences is refused by name; the padded layout (one sequence per row) is held to
    the unfused path against float64, gradients included."""
    model = _tiny_qwen3_5_text()
    with pytest.raises(ValueError, match="linear-attention layers"):
        _run(model, "logitless", SEQS)
    g, e, keep = _upstream(SEQS, zero_last=True)
    kw = dict(rmpad=False, g=g, e=e)
    ours = _run(model, "logitless", SEQS, **kw)
    unfused = _run(model, None, SEQS, **kw)
    truth = _run(model, None, SEQS, dtype=torch.float64, **kw)
    for i, name in enumerate(("log_probs", "entropy")):
        _check(name, ours[i], {"unfused": unfused[i]}, truth[i], keep)
    for n in truth[2]:
        _check(f"grad {n}", ours[2][n], {"unfused": unfused[2][n]}, truth[2][n])
