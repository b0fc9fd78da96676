"""verl's FSDP engine forward on CPU, as verl runs it: ``FSDPEngineWithLMHead.forward_step``
(``prepare_model_inputs`` -> ``module(**inputs)`` -> ``prepare_model_outputs`` -> the loss
function) on a tiny transformers model patched by verl's own ``apply_monkey_patch``.

The engine object is made without ``__init__`` (which builds device meshes and FSDP from a
checkpoint on disk) and given the attributes ``forward_step`` reads; verl's device helpers are
pointed at the CPU (they assume an accelerator). Everything between the micro-batch and the
loss is verl's code, and the model's forward is the one ``apply_monkey_patch`` chose.
"""

from __future__ import annotations

import copy
import inspect

import torch
import transformers
import verl.utils.tensordict_utils as tu
import verl.workers.engine.fsdp.transformer_impl as impl
from verl.models.transformers.monkey_patch import apply_monkey_patch
from verl.utils import torch_functional as verl_F
from verl.utils.dataset.dataset_utils import DatasetPadMode
from verl.workers.config.engine import FSDPEngineConfig

import logitless.integrations.verl as lv  # installs the backend values, as external_lib does

V, H = 163, 32


def tiny_model(layers: int = 2, seed: int = 0) -> transformers.Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(
        vocab_size=V, hidden_size=H, intermediate_size=48, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
        attn_implementation="sdpa",
    )  # fmt: skip
    model = transformers.Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # logits of a trained model's spread, not a random init's ~0
        model.lm_head.weight.normal_(0, 0.6)
    return model


def tiny_gemma2(seed: int = 0) -> transformers.Gemma2ForCausalLM:
    """A tiny Gemma-2 from its config (no download), with Gemma-2's final-logit softcap of 30
    and its tied embedding; the head weight's spread (std 1) puts many logits beyond the
    softcap's near-linear range, as a trained Gemma-2's are."""
    torch.manual_seed(seed)
    cfg = transformers.Gemma2Config(
        vocab_size=V, hidden_size=H, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, attn_implementation="eager",
    )  # fmt: skip
    assert cfg.final_logit_softcapping == 30.0 and cfg.tie_word_embeddings
    model = transformers.Gemma2ForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 1.0)
    return model


_OWN_CLASSES: dict[type, type] = {}


def _own_class(cls: type) -> type:
    """verl's torch and triton backends set ``model.__class__.forward``: a subclass of its own
    keeps that patch off every other model of the test."""
    if cls not in _OWN_CLASSES:
        _OWN_CLASSES[cls] = type(f"_VerlTorch{cls.__name__}", (cls,), {})
    return _OWN_CLASSES[cls]


def patched(model: torch.nn.Module, backend: str | None, *, sp: int = 1, rmpad: bool = True):
    """A copy of ``model`` patched by verl's ``apply_monkey_patch`` (``backend`` None: unfused,
    the model's own forward returning logits)."""
    model = copy.deepcopy(model)
    if backend in ("torch", "triton", "liger"):
        model.__class__ = _own_class(type(model))
    apply_monkey_patch(
        model=model,
        ulysses_sp_size=sp,
        use_remove_padding=rmpad,
        use_fused_kernels=backend is not None,
        fused_kernels_backend=backend,
    )
    return model


def engine(module: torch.nn.Module, *, sp: int = 1, dtype=torch.float32, group=None):
    eng = object.__new__(impl.FSDPEngineWithLMHead)
    eng.module = module
    eng.engine_config = FSDPEngineConfig(ulysses_sequence_parallel_size=sp, use_torch_compile=False)
    eng.use_ulysses_sp = sp > 1
    eng.ulysses_sequence_parallel_size = sp
    eng.ulysses_device_mesh = None
    eng.ulysses_parallel_group = group
    eng.pad_to_length = False
    eng.pad_to_length_bucket = 1
    eng._autocast_dtype = dtype
    eng.compute_entropy_from_logits = verl_F.entropy_from_logits
    # as verl's _build_model_optimizer decides it: the packed row's cu_seqlens go to a forward
    # whose signature names them (verl's Qwen3.5 forwards, logitless's forward for Qwen3.5)
    eng.pass_packed_cu_seqlens = "cu_seqlens" in inspect.signature(module.forward).parameters
    return eng


def micro_batch(
    seqs, *, temperature=1.0, fused=True, rmpad=True, positions=None, multi_modal_inputs=None
):
    """verl's micro-batch of sequences (lists of ids): nested input_ids and position_ids
    (``positions``: one tensor a sequence, ``[T]`` or ``[4, T]``; default ``arange(T)``), and
    a vision-language model's image inputs (one dict a sequence, verl's
    ``multi_modal_inputs``)."""
    ids = torch.nested.nested_tensor([torch.tensor(s) for s in seqs], layout=torch.jagged)
    if positions is None:
        positions = [torch.arange(len(s)) for s in seqs]
    tensors = {
        "input_ids": ids,
        "position_ids": torch.nested.as_nested_tensor(positions, layout=torch.jagged),
    }
    if multi_modal_inputs is not None:
        tensors["multi_modal_inputs"] = multi_modal_inputs
    return tu.get_tensordict(
        tensors,
        {
            "temperature": temperature,
            "use_remove_padding": rmpad,
            "use_fused_kernels": fused,
            "calculate_entropy": True,
            "pad_mode": DatasetPadMode.NO_PADDING,
            "pad_token_id": 0,
        },
    )


def forward_step(eng, batch, g=None, e=None, monkeypatch=None):
    """verl's ``forward_step`` on ``batch``; with upstream gradients ``g`` (log-probs) and
    ``e`` (entropy), per packed token, backward through it. Returns (log_probs, entropy)
    packed ``[total_nnz]`` and every parameter's gradient by name."""
    seen = {}

    def loss_function(model_output, data, dp_group):
        lp, ent = model_output["log_probs"].values(), model_output["entropy"].values()
        seen["lp"], seen["ent"] = lp, ent
        if g is None:
            return lp.sum() * 0.0, {}
        return (lp * g).sum() + (ent * e).sum(), {}

    for p in eng.module.parameters():
        p.grad = None
    loss, _ = eng.forward_step(batch, loss_function=loss_function, forward_only=g is None)
    if g is not None:
        loss.backward()
    grads = {}
    if g is not None:
        grads = {n: p.grad.detach().clone() for n, p in eng.module.named_parameters()}
    return seen["lp"].detach(), seen["ent"].detach(), grads


def cpu_devices(monkeypatch) -> None:
    """verl's device helpers assume an accelerator; the engine module reads them by name."""
    monkeypatch.setattr(impl, "get_device_id", lambda: "cpu")
    monkeypatch.setattr(impl, "get_device_name", lambda: "cpu")


def sharded_step(model, backend, mesh, group, world, batch, g, e, *, patch=None, unit=False):
    """``forward_step`` under Ulysses on ``world`` ranks: ``model`` patched by verl for
    ``backend`` (``patch``: the patching function, default :func:`patched`), then
    ``fully_shard``-ed over ``mesh`` (verl's order; ``unit``: ``lm_head`` an FSDP2 unit of its
    own first, accelerate's way, so its weight exists only inside its forward). Returns the
    gathered (log_probs, entropy) and every parameter's whole gradient."""
    from torch.distributed.fsdp import fully_shard

    mod = (patch or patched)(model, backend, sp=world)
    if unit:
        fully_shard(mod.lm_head, mesh=mesh)
    mod = fully_shard(mod, mesh=mesh)
    lp, ent, grads = forward_step(engine(mod, sp=world, group=group), batch, g, e)
    return lp, ent, {n: t.full_tensor() for n, t in grads.items()}


def check_ranks_equal_one_process(ranks, one, unfused, truth, check, ours=("logitless",)):
    """The Ulysses comparison of test_verl_engine.py and test_verl_vlm.py. Every rank holds the
    gathered outputs of the whole packed row: each run of ``ours`` gives the one-process run
    ``one``'s log-probs and entropy bit for bit, and verl's torch backend's on the same ranks
    (``r["torch"]``) within fp32 reassociation. verl's gather scales each rank's gradient by
    the group size and FSDP2 averages over the mesh, so the reduced gradient is the
    one-process one: ``check(got, refs, truth, what)`` holds each run to ``refs``, the unfused
    one-process run and verl's torch backend, against ``truth``."""
    for r in ranks:
        for key in ours:
            for i in range(2):
                torch.testing.assert_close(r[key][i], one[i], rtol=0, atol=0)
                torch.testing.assert_close(r[key][i], r["torch"][i], rtol=1e-5, atol=1e-6)
            check(r[key], {"unfused, 1 process": unfused, "torch backend": r["torch"]}, truth, key)


def ulysses_worker(rank: int, world: int) -> dict:
    """One rank of the one 2-process launch that every Ulysses check of this folder shares
    (CI time: one launch instead of one per test file). Both ranks form one Ulysses group and
    one FSDP2 mesh, as verl's engine puts its sp ranks in the FSDP mesh; each test module's
    ``ulysses_case(group, mesh, world)`` runs its models there. The ``ulysses`` fixture
    (conftest.py) starts it."""
    import test_verl_engine
    import test_verl_vlm
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from verl.utils.ulysses import set_ulysses_sequence_parallel_group

    impl.get_device_id = lambda: "cpu"
    impl.get_device_name = lambda: "cpu"
    group = dist.new_group(list(range(world)))
    set_ulysses_sequence_parallel_group(group)
    mesh = init_device_mesh("cpu", (world,))
    return {
        "text": test_verl_engine.ulysses_case(group, mesh, world),
        "vlm": test_verl_vlm.ulysses_case(group, mesh, world),
    }


__all__ = [
    "lv", "patched", "engine", "micro_batch", "forward_step", "tiny_model", "tiny_gemma2",
    "cpu_devices", "check_ranks_equal_one_process",
]  # fmt: skip
