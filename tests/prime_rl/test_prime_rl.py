"""logitless as prime-rl's ``model.lm_head`` (v0.8.0, its vendored source; tests/prime_rl/_prime.py
says what is bypassed or stubbed), against prime-rl's own heads and a float64 truth.

A tiny Hugging Face model (prime-rl's ``impl="hf"`` path) gets prime-rl's head and forward from
prime-rl's ``inject_prime_lm_head``; three copies of it run the same batch:

op     = ``FusedOutputLinear`` injected (chunk 8), then ``logitless.integrations.prime_rl.adopt``
ref    = ``VanillaOutputLinear`` (``fused_lm_head_token_chunk_size="disabled"``) and prime-rl's
         trainer code for it: the logits / per-token temperature, ``selective_log_softmax``;
         the entropy as prime-rl's ``compute_entropy`` computes it, with its gradient
fused  = prime-rl's ``FusedOutputLinear`` (its backward refuses an entropy gradient)
truth  = ref on a float64 copy of the model

The loss is prime-rl's: ``compute_loss`` with the rl loss ``setup_rl_loss_fn`` builds (the
default DPPO + KL loss). Compared, in fp32 and bf16, on Llama (untied and tied embeddings) and
Gemma-2 (``final_logit_softcapping``: prime-rl's Gemma heads): the log-probs, the entropy, the
loss, and every parameter's gradient under the loss plus random upstream gradients on the
log-probs and the entropy; within 4x ref's error against the truth (tests/_tolerance.py). With
the log-prob gradient alone (what prime-rl's fused head can take), also within 4x fused's error.
A Gemma-3 vision-language model (image inputs, softcap) runs the same comparison in fp32.

On 2 gloo ranks (one launch): the switch (``trainer.loss`` a ``CustomLossConfig`` naming
``logitless.integrations.prime_rl.default_loss``, resolved by prime-rl's ``setup_rl_loss_fn``
after FSDP2 sharded the model as prime-rl's ``setup_fsdp`` does: the blocks, ``[lm_head, norm]``
unless tied, the root; bf16 mixed precision for the untied model); each rank's batch against
prime-rl's fused head (the log-prob gradient) and vanilla path (the entropy's too) on the same
sharded layout and the float64 truth, the gathered gradients too; context parallelism with
prime-rl's ``shard_for_cp`` / ``gather_for_cp``; bad input on one rank raising on both before
the backbone.

Not run: prime-rl's ``train()`` loop (it needs CUDA, its data transport and torchtitan), its
own model classes (``impl="custom"``: behind the bypassed ``__init__``), ring attention.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
from _prime import MISSING, load

if MISSING:
    pytest.skip(MISSING, allow_module_level=True)

import transformers  # noqa: E402
from _dist import spawn  # noqa: E402
from _tolerance import assert_no_worse_than_reference  # noqa: E402

from logitless.integrations import prime_rl as lp  # noqa: E402

P = load()
V, S = 97, 24  # odd vocabulary; S: two documents, even (CP=2)
SWITCH = "logitless.integrations.prime_rl.default_loss"
_TEXT = dict(
    vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
    num_attention_heads=2, num_key_value_heads=1, head_dim=8,
)  # fmt: skip


@dataclass(frozen=True)
class Case:
    arch: str  # "llama" | "gemma2" | "gemma3_vl"
    dtype: torch.dtype = torch.float32
    tied: bool = False

    @property
    def name(self) -> str:
        return f"{self.arch}-{str(self.dtype)[6:]}{'-tied' if self.tied else ''}"


CASES = [
    Case("llama"),
    Case("llama", torch.bfloat16),
    Case("llama", tied=True),
    Case("gemma2"),
    Case("gemma2", torch.bfloat16),
    Case("gemma3_vl"),
]
IMAGE = 90


def make_model(case: Case, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """A tiny random model (its head scaled so the logits reach about ±5), prime-rl's forward
    and fused head injected."""
    torch.manual_seed(1234)
    t = transformers
    if case.arch == "llama":
        model = t.LlamaForCausalLM(t.LlamaConfig(**_TEXT, tie_word_embeddings=case.tied))
    elif case.arch == "gemma2":
        model = t.Gemma2ForCausalLM(t.Gemma2Config(**_TEXT, final_logit_softcapping=4.0))
    else:
        vision = t.SiglipVisionConfig(
            hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            image_size=8, patch_size=2,
        )  # fmt: skip
        config = t.Gemma3Config(
            text_config=t.Gemma3TextConfig(**_TEXT, final_logit_softcapping=4.0),
            vision_config=vision, mm_tokens_per_image=4, image_token_id=IMAGE,
            boi_token_id=91, eoi_token_id=92,
        )  # fmt: skip
        model = t.Gemma3ForConditionalGeneration._from_config(config)
        with torch.no_grad():  # zero at init: no gradient would reach the vision tower
            model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.3)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.5 if case.arch == "llama" else 2.0)
    model = model.to(dtype or case.dtype)
    P.lm_head.inject_prime_lm_head(model, chunk_size=8)
    return model


def vanilla(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` with prime-rl's vanilla head (``fused_lm_head_token_chunk_size =
    "disabled"``): the logits, turned into log-probs by the trainer."""
    model = copy.deepcopy(model)
    if getattr(model.lm_head, "softcap", None) is None:
        head = P.lm_head.VanillaOutputLinear(model.lm_head.in_features, model.lm_head.out_features)
    else:
        head = P.gemma.GemmaVanillaOutputLinear(
            model.lm_head.in_features, model.lm_head.out_features, model.lm_head.softcap
        )
    head.weight = model.lm_head.weight  # tied stays tied
    model.lm_head = head
    return model


def batch(case: Case, seed: int = 0) -> dict:
    """One packed micro-batch as prime-rl's trainer makes it: batch 1, two documents (position
    ids restarting at 0), labels = prime-rl's ``shift_tensor_left(input_ids)``, per-token
    temperatures, advantages, the loss mask, the inference log-probs."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 80, (1, S), generator=g)
    extra = {}
    if case.arch == "gemma3_vl":  # one 8x8 image: 4 placeholder tokens after the first 3
        ids[0, 3:7] = IMAGE
        extra = {
            "pixel_values": torch.randn(1, 3, 8, 8, generator=g).to(case.dtype),
            "token_type_ids": (ids == IMAGE).long(),
        }
    position_ids = torch.cat([torch.arange(14), torch.arange(S - 14)])[None]
    return {
        "input_ids": ids,
        "position_ids": position_ids,
        "labels": P.loss.shift_tensor_left(ids),
        "temperature": 0.6 + torch.rand(1, S, generator=g),
        "extra": extra,
        "advantages": torch.randn(1, S, generator=g),
        "loss_mask": torch.rand(1, S, generator=g) > 0.3,
        "inference_logprobs": -2.0 * torch.rand(1, S, generator=g),
        "g": torch.randn(1, S, generator=g, dtype=torch.float64),
        "e": torch.randn(1, S, generator=g, dtype=torch.float64),
    }


def forward(model: torch.nn.Module, d: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """prime-rl's ``trainer.model.forward`` and the lines of its ``train()`` after it: the
    model called with labels and temperatures; for the vanilla head, the trainer's log-probs
    from the logits (the entropy as ``compute_entropy`` has it, but with its gradient)."""
    out = model(
        input_ids=d["input_ids"], position_ids=d["position_ids"], labels=d["labels"],
        temperature=d["temperature"], **d["extra"],
    )  # fmt: skip
    out = P.lm_head.cast_float_and_contiguous(out)
    if out.get("logprobs") is None:
        scaled = out["logits"] / d["temperature"].to(out["logits"].dtype).unsqueeze(-1)
        logprobs = P.loss.selective_log_softmax(scaled, d["labels"])
        p = torch.softmax(scaled, dim=-1)
        entropy = torch.logsumexp(scaled, dim=-1) - (p * scaled).sum(-1)
        return logprobs, entropy
    return out["logprobs"], out["entropy"]


def loss_of(logprobs: torch.Tensor, d: dict, rl_loss_fn) -> torch.Tensor:
    """prime-rl's ``compute_loss`` as its ``train()`` calls it (shifted right, per sequence)."""
    logprobs = P.loss.shift_tensor_right(logprobs, pad_value=-4.0)
    lengths = [14, S - 14]

    def split(t):
        return t.squeeze(0).split(lengths)

    loss, _ = P.loss.compute_loss(
        trainer_logprobs=split(logprobs), inference_logprobs=split(d["inference_logprobs"]),
        ref_logprobs=None, advantages=split(d["advantages"]), loss_mask=split(d["loss_mask"]),
        rl_weights=None, ce_weights=None, ref_kl_weights=None, rl_loss_fn=rl_loss_fn,
        rl_scale=int(d["loss_mask"].sum()), ce_scale=1, ref_kl_scale=1,
    )  # fmt: skip
    return loss


def step(model, d, rl_loss_fn, *, entropy: bool) -> dict:
    """Log-probs, entropy, loss, and every parameter's gradient of the loss plus Σ g·logp (plus
    Σ e·entropy when ``entropy``)."""
    model.zero_grad(set_to_none=True)
    logprobs, ent = forward(model, d)
    loss = loss_of(logprobs, d, rl_loss_fn)
    objective = loss + (logprobs.double() * d["g"]).sum()
    if entropy:
        objective = objective + (ent.double() * d["e"]).sum()
    objective.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"logprobs": logprobs.detach(), "entropy": ent.detach(), "loss": loss.detach(), **grads}


# The loss and the parameter gradients are sums over the batch's tokens: one sample of the
# reference's rounding can cancel in them, so their floor is the fp32 summation bound
# S * eps * scale (as tests/test_hf.py holds them); per-token outputs keep the one-ulp floor.
SUM_FLOOR = S * torch.finfo(torch.float32).eps


def compare(op: dict, ref: dict, truth: dict, name: str) -> None:
    assert op.keys() == truth.keys(), f"{name}: {sorted(op.keys() ^ truth.keys())}"
    for key in truth:
        actual, expected, true = (x[key].double().reshape(-1) for x in (op, ref, truth))
        floor = {} if key in ("logprobs", "entropy") else {"floor": SUM_FLOOR}
        assert_no_worse_than_reference(actual, expected, true, f"{name} {key}", **floor)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_parity(case: Case):
    rl_loss_fn = P.loss.setup_rl_loss_fn(P.configs.DefaultLossConfig())
    d = batch(case)
    base = make_model(case)
    ours = lp.adopt(copy.deepcopy(base))
    assert type(ours.lm_head).__name__.endswith("FusedOutputLinear")
    truth_model = vanilla(make_model(case, torch.float64))
    d64 = {
        **d,
        "extra": {k: v.double() if v.is_floating_point() else v for k, v in d["extra"].items()},
    }
    ref, truth = vanilla(base), step(truth_model, d64, rl_loss_fn, entropy=True)
    op = step(ours, d, rl_loss_fn, entropy=True)
    compare(op, step(ref, d, rl_loss_fn, entropy=True), truth, f"{case.name} vs vanilla")
    # with the log-prob gradient only, as prime-rl's fused head takes it
    truth = step(truth_model, d64, rl_loss_fn, entropy=False)
    fused = step(base, d, rl_loss_fn, entropy=False)
    compare(step(ours, d, rl_loss_fn, entropy=False), fused, truth, f"{case.name} vs fused")
    with pytest.raises(AssertionError, match="Backward through entropy is not implemented"):
        step(base, d, rl_loss_fn, entropy=True)


class CountingBackbone:
    """Counts the calls of ``model.model`` (the backbone) with a forward pre-hook."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls = 0
        model.model.register_forward_pre_hook(self._count)

    def _count(self, *_):
        self.calls += 1


def _fill(key: str, position: int, value: float):
    return lambda d: d[key].index_fill_(1, torch.tensor([position]), value)


POSITIVE = "temperature must be finite and > 0"
IN_VOCAB = f"labels must be in \\[0, {V}\\)"
MISSING_T = "temperature \\(prime-rl's per-token"
BAD = {
    "temperature 0": (_fill("temperature", 5, 0.0), POSITIVE),
    "temperature nan": (_fill("temperature", 2, float("nan")), POSITIVE),
    "label >= V": (_fill("labels", 3, V), IN_VOCAB),
    "label -100": (_fill("labels", 3, -100), IN_VOCAB),
    "no temperature": (lambda d: d.update(temperature=None), MISSING_T),
    "temperature [1, S-1]": (lambda d: d.update(temperature=d["temperature"][:, 1:]), MISSING_T),
}


@pytest.mark.parametrize("bad", BAD, ids=list(BAD))
def test_bad_input_before_the_backbone(bad: str):
    case = Case("llama")
    model = lp.adopt(make_model(case))
    count = CountingBackbone(model)
    d = batch(case)
    spoil, message = BAD[bad]
    spoil(d)
    with pytest.raises(ValueError, match=message) as err:
        forward(model, d)
    assert "prime_rl" in str(err.value)
    assert count.calls == 0, "the backbone ran before the bad input was refused"
    forward(model, batch(case))  # still usable
    assert count.calls == 1


def test_adopt_takes_each_of_prime_rls_heads():
    """The vanilla heads (``fused_lm_head_token_chunk_size = "disabled"``) adopted give what
    the fused ones adopted give (logitless's head either way), Gemma's softcap included."""
    for case in (Case("llama"), Case("gemma2")):
        d = batch(case)
        base = make_model(case)
        a, b = lp.adopt(copy.deepcopy(base)), lp.adopt(vanilla(base))
        assert lp.adopted(a) and lp.adopted(b) and not lp.adopted(base)
        for x, y in zip(forward(a, d), forward(b, d), strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_adopt_refuses_a_model_without_prime_rls_head():
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_TEXT))
    with pytest.raises(ValueError, match="must be one of prime-rl's heads"):
        lp.adopt(model)
    P.lm_head.inject_prime_lm_head(model, chunk_size=8)
    del model.forward  # prime-rl's forward removed: the head would never get labels
    with pytest.raises(ValueError, match="no forward of prime-rl's"):
        lp.adopt(model)


def test_the_switch_is_a_prime_rl_config():
    """prime-rl's TrainerConfig takes the switch; resolving it with no model of prime-rl's in
    the process (the models of the other tests collected) raises, naming the option. The
    switch adopting a sharded model is tested on the gloo ranks below."""
    import gc

    config = P.configs.TrainerConfig(
        loss={"type": "custom", "import_path": SWITCH, "kwargs": {"dppo_mask_low": 0.1}}
    )
    assert isinstance(config.loss, P.configs.CustomLossConfig)
    gc.collect()
    with pytest.raises(ValueError, match="trainer.loss.import_path .* no model with prime-rl's"):
        P.loss.setup_rl_loss_fn(config.loss)
    # with a model built: adopted, and the loss is prime-rl's own with its own config's checks
    model = make_model(Case("llama"))
    ipo = P.configs.CustomLossConfig(
        import_path="logitless.integrations.prime_rl.ipo_loss", kwargs={"ipo_threshold": 0.05}
    )
    rl_fn = P.loss.setup_rl_loss_fn(ipo)
    assert lp.adopted(model)
    g = torch.Generator().manual_seed(3)
    inputs = P.loss.LossInputs(
        trainer_logprobs=-torch.rand(9, generator=g),
        inference_logprobs=-torch.rand(9, generator=g),
        ref_logprobs=None,
        advantages=torch.randn(9, generator=g),
        loss_mask=torch.ones(9, dtype=torch.bool),
    )
    want = P.loss.ipo_loss_fn(inputs, P.configs.IPOLossConfig(ipo_threshold=0.05))
    got = rl_fn(inputs)
    assert torch.equal(got.loss, want.loss) and got.metrics.keys() == want.metrics.keys()
    bad = P.configs.CustomLossConfig(import_path=SWITCH, kwargs={"dppo_mask_low": -1.0})
    with pytest.raises(ValueError, match="dppo_mask_low"):
        P.loss.setup_rl_loss_fn(bad)(inputs)


# --- 2 gloo ranks ------------------------------------------------------------------------------

WORLD = 2


def shard(model: torch.nn.Module, mesh, mixed: bool) -> None:
    """prime-rl's ``setup_fsdp`` layout: each decoder layer; ``[lm_head, norm]`` when the
    embedding is not tied (``reshard_after_forward=False``); the root."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if mixed else MixedPrecisionPolicy()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    if not model.config.tie_word_embeddings:
        fully_shard(model.model.embed_tokens, mesh=mesh, mp_policy=mp)
        fully_shard([model.lm_head, model.model.norm], mesh=mesh, mp_policy=mp,
                    reshard_after_forward=False)  # fmt: skip
    fully_shard(model, mesh=mesh, mp_policy=mp)


def _fsdp_case(rank: int, case: Case, mixed: bool, mesh) -> dict:
    """The switch on a sharded model, against prime-rl's heads sharded the same way and the
    float64 truth of this rank's batch: the log-prob gradient against the fused head, the
    entropy's too against the vanilla path; gradients gathered (FSDP2 averages them: the
    truth's are averaged over the ranks)."""
    import torch.distributed as dist

    d = batch(case, seed=rank)
    ours = make_model(case)
    shard(ours, mesh, mixed)
    rl_loss_fn = P.loss.setup_rl_loss_fn(
        P.configs.CustomLossConfig(import_path=SWITCH, kwargs={"dppo_mask_low": 0.2})
    )
    assert lp.adopted(ours), "resolving the loss did not adopt the sharded model"
    fused, van = make_model(case), vanilla(make_model(case))
    shard(fused, mesh, mixed)
    shard(van, mesh, mixed)
    default_fn = P.loss.setup_rl_loss_fn(P.configs.DefaultLossConfig(dppo_mask_low=0.2))
    truth_model = vanilla(make_model(case, torch.float64))
    out = {}
    runs = [("op", ours, rl_loss_fn, False), ("fused", fused, default_fn, False)]
    runs += [("op_e", ours, rl_loss_fn, True), ("vanilla_e", van, default_fn, True)]
    for name, model, fn, entropy in runs:
        r = step(model, d, fn, entropy=entropy)
        out[name] = {
            k: v.full_tensor() if type(v).__name__ == "DTensor" else v for k, v in r.items()
        }
    for name, entropy in (("truth", False), ("truth_e", True)):
        out[name] = step(truth_model, d, default_fn, entropy=entropy)
        for k, v in out[name].items():
            if k not in ("logprobs", "entropy", "loss"):
                dist.all_reduce(v, op=dist.ReduceOp.AVG)
    return out


def _cp_case(rank: int, group) -> dict:
    """Context parallelism as prime-rl's trainer runs it around the head: the labels and
    temperatures (and here the hidden states of a full-sequence backbone) split with
    ``shard_for_cp``, the head on each rank's shard, the log-probs gathered with
    ``gather_for_cp`` (with their gradient); against one process. The head needs no group:
    it is token-local, and prime-rl shifts the labels before it splits them."""
    import torch.distributed as dist

    case = Case("llama")
    model = lp.adopt(make_model(case), group=group)
    d = batch(case)
    hidden = model.model(input_ids=d["input_ids"], position_ids=d["position_ids"]).last_hidden_state
    hidden = hidden.detach()

    def run(h, labels, temperature, gather):
        h = h.clone().requires_grad_()
        model.zero_grad(set_to_none=True)
        out = model.lm_head(h, labels, temperature=temperature)
        logprobs = gather(out["logprobs"])
        entropy = gather(out["entropy"].detach())
        ((logprobs.double() * d["g"]).sum()).backward()
        return logprobs.detach(), entropy, h.grad, model.lm_head.weight.grad.clone()

    def shard_(t):
        return P.cp.shard_for_cp(t, cp_rank=rank, cp_world_size=WORLD)

    full = run(hidden, d["labels"], d["temperature"], lambda t: t)
    cp = run(shard_(hidden), shard_(d["labels"]), shard_(d["temperature"]),
             lambda t: P.cp.gather_for_cp(t, group))  # fmt: skip
    dist.all_reduce(cp[3], group=group)  # the head's weight gradient: summed over the CP ranks
    return {"full": full, "cp": cp, "rows": shard_(torch.arange(S)[None])[0]}


def _bad_input_case(rank: int) -> dict:
    """Rank 1 gets a temperature of 0: both ranks raise before the backbone, then both run
    the next batch (still in step)."""
    case = Case("llama")
    model = lp.adopt(make_model(case))
    count = CountingBackbone(model)
    d = batch(case)
    if rank == 1:
        d["temperature"][0, 4] = 0.0
    try:
        forward(model, d)
        error = None
    except ValueError as e:
        error = str(e)
    calls = count.calls
    forward(model, batch(case))
    return {"error": error, "calls_before": calls, "calls_after": count.calls}


def _worker(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,))
    results = {"bad": _bad_input_case(rank)}
    for case, mixed in ((Case("llama"), True), (Case("llama", tied=True), False)):
        results[f"fsdp-{case.name}-{'mp' if mixed else 'fp32'}"] = _fsdp_case(
            rank, case, mixed, mesh
        )
    results["cp"] = _cp_case(rank, dist.group.WORLD)
    return results


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return spawn(_worker, WORLD, timeout_s=120)


def test_distributed_bad_input(ranks):
    errors = [r["bad"]["error"] for r in ranks]
    assert errors[1] is not None and "temperature must be finite and > 0" in errors[1]
    assert errors[0] is not None and "another rank" in errors[0], errors[0]
    for r in ranks:
        assert r["bad"]["calls_before"] == 0 and r["bad"]["calls_after"] == 1


def test_distributed_fsdp2(ranks):
    for key in [k for k in ranks[0] if k.startswith("fsdp-")]:
        for rank, r in enumerate(ranks):
            compare(r[key]["op"], r[key]["fused"], r[key]["truth"], f"{key} rank {rank} vs fused")
            res = r[key]
            compare(res["op_e"], res["vanilla_e"], res["truth_e"], f"{key} rank {rank} vs vanilla")


def test_distributed_context_parallel(ranks):
    for r in ranks:
        full, cp, rows = r["cp"]["full"], r["cp"]["cp"], r["cp"]["rows"]
        torch.testing.assert_close(cp[0], full[0], rtol=0, atol=1e-6)  # gathered log-probs
        torch.testing.assert_close(cp[1], full[1], rtol=0, atol=1e-6)  # gathered entropy
        # gather_for_cp's backward (torch.distributed.nn.all_gather) sums the gradient over the
        # CP ranks, each of which took the objective over the whole gathered sequence (as
        # prime-rl's loss does): each shard's gradient is WORLD x the one process's
        dh = WORLD * full[2][:, rows]
        torch.testing.assert_close(cp[2], dh, rtol=1e-5, atol=1e-6)  # this shard's dh
        torch.testing.assert_close(cp[3], WORLD * full[3], rtol=1e-5, atol=1e-6)  # dW, summed


def test_benchmark_script_runs(tmp_path):
    """benchmarks/prime_rl_head.py end to end on a tiny shape (the full one is for a quiet
    machine): both variants reported, the same log-probs, a CSV row each."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    csv = tmp_path / "prime_rl_head.csv"
    args = ["--tokens", "40", "--hidden", "16", "--vocab", "300", "--chunk", "16"]
    proc = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "prime_rl_head.py"), *args, "--repeats", "1",
         "--csv", str(csv)],
        capture_output=True, text=True, timeout=600, cwd=root,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {ln.split()[0]: ln.split() for ln in proc.stdout.splitlines() if ln.strip()}
    assert {"prime_fused", "logitless"} <= rows.keys(), proc.stdout
    assert abs(float(rows["prime_fused"][-1]) - float(rows["logitless"][-1])) < 1e-3
    assert csv.read_text().count("\n") == 3  # header + 2 rows
