"""Test-only: slime's own code (``../shared/peers/slime``, the pinned commit of its README) on
CPU gloo ranks, and logitless's switch through it.

What runs is slime's: its argument parser (``slime.utils.arguments``, every option's default),
its model provider (``get_model_provider_func``: the custom-provider path that loads
``--custom-model-provider-path`` by name, and its default path building the ``GPTModel``), its
``get_batch`` / ``DataIterator`` (the packed THD stream, the zigzag and all-gather context-
parallel slices), its ``loss_function`` (the dispatch on ``--loss-type``, the scaling for
Megatron's schedule), ``policy_loss_function`` and ``get_log_probs_and_entropy``, and
megatron-core 0.19 (``GPTModel``, its DDP, the distributed optimizer, the pipeline schedules).
What is not slime's, and why:

- stubs of modules imported but not run by what the tests call: ``wandb`` (slime's logging),
  ``sglang.srt.server_args`` and ``sglang_router.launch_router`` (the rollout engine's
  arguments, imported by ``slime.utils.arguments``);
- Megatron-LM's ``megatron.training`` is not a package on PyPI (megatron-core ships without
  it): ``global_vars.get_args`` / ``set_args`` hold the parsed arguments, as Megatron-LM's do
  (slime's provider and logitless's read them), and ``arguments.core_transformer_config_from_args``
  is a stand-in that builds the ``TransformerConfig`` from the fields the tests set;
- slime's ``Accelerator`` for the CPU, installed through slime's own ``set_accelerator`` (its
  registry has CUDA and MUSA only);
- slime's loss helpers are ``torch.compile(dynamic=True)``-decorated: Dynamo is disabled so
  they run eagerly (inductor needs a C++ compiler and tens of seconds per rank on CPU);
- the model's layer spec (``--spec``, slime's own hook for it) is tests/_megatron_shim.py's
  local spec with a token-local attention: megatron-core's local attention refuses packed
  (THD) batches and context parallelism on CPU (only Transformer Engine's takes them).
  ``train_one_step``'s ``forward_step`` (``slime/backends/megatron_utils/model.py``, which
  imports wandb and Megatron-LM's training loop) is copied in :func:`forward_step`, its call
  shape unchanged.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
SLIME = ROOT.parent / "shared" / "peers" / "slime"
V, H, LAYERS = 256, 32, 2
OURS = ("--custom-model-provider-path", "logitless.integrations.slime.model_provider",
        "--loss-type", "custom_loss",
        "--custom-loss-function-path", "logitless.integrations.slime.policy_loss")  # fmt: skip
# train_one_step's keys
KEYS = (
    "tokens", "multimodal_train_inputs", "packed_seq_params", "total_lengths",
    "response_lengths", "loss_masks", "log_probs", "ref_log_probs", "values", "advantages",
    "returns", "rollout_log_probs", "teacher_log_probs", "rollout_mask_sums",
)  # fmt: skip


def _module(name: str, **attrs) -> types.ModuleType:
    module = sys.modules.get(name) or types.ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, module)
    return module


_ARGS: list[argparse.Namespace] = []


def _config_from_args(args: argparse.Namespace):
    """Stand-in for Megatron-LM's ``core_transformer_config_from_args``."""
    from megatron.core.transformer import TransformerConfig

    names = {f.name for f in dataclasses.fields(TransformerConfig)} & set(_TRANSFORMER)
    return TransformerConfig(**{k: getattr(args, k) for k in names if hasattr(args, k)})


# the TransformerConfig fields the tests set (slime's parser has others of the same names,
# which Megatron-LM's own function reads with its own defaults)
_TRANSFORMER = (
    "num_layers", "hidden_size", "num_attention_heads", "use_cpu_initialization",
    "tensor_model_parallel_size", "context_parallel_size", "sequence_parallel",
    "pipeline_model_parallel_size", "params_dtype", "pipeline_dtype", "bf16", "hidden_dropout",
    "attention_dropout", "calculate_per_token_loss", "variable_seq_lengths",
    "moe_token_dispatcher_type",
)  # fmt: skip


def install() -> None:
    """slime's source on the path, the stubs above, the CPU accelerator (call in each rank)."""
    if str(SLIME) not in sys.path:
        sys.path.insert(0, str(SLIME))
    torch._dynamo.config.disable = True
    _module("wandb")
    _module("sglang")
    _module("sglang.srt")
    _module("sglang.srt.server_args", ServerArgs=type("ServerArgs", (), {}))
    _module("sglang_router")
    _module("sglang_router.launch_router", RouterArgs=type("RouterArgs", (), {}))
    import megatron

    _module("megatron.training")
    _module("megatron.training.global_vars", get_args=lambda: _ARGS[-1], set_args=_ARGS.append)
    _module("megatron.training.arguments", core_transformer_config_from_args=_config_from_args)
    from slime.utils import accelerator

    accelerator.set_accelerator(_cpu_accelerator())
    assert megatron.training.global_vars.get_args is not None


def _cpu_accelerator():
    from slime.utils.accelerator.base import Accelerator

    class Cpu(Accelerator):
        name, device_type, communication_backend_name = "cpu", "cpu", "gloo"

        def is_available(self):
            return True

        def device(self, index=None):
            return torch.device("cpu")

        def device_name(self, index=None):
            return "cpu"

        def set_device(self, index):
            pass

        def current_device(self):
            return "cpu"

        def device_count(self):
            return 1

        def synchronize(self, device=None):
            pass

        def current_stream(self, device=None):
            return None

        def empty_cache(self):
            pass

        def mem_get_info(self, device=None):
            return (0, 0)

        def memory_allocated(self, device=None):
            return 0

        def memory_reserved(self, device=None):
            return 0

        def get_device_properties(self, device=None):
            return None

    return Cpu()


def slime_args(cli: list[str], *, tp: int = 1, cp: int = 1, pp: int = 1, sp: bool = False,
               dtype: torch.dtype = torch.float32, **megatron) -> argparse.Namespace:  # fmt: skip
    """slime's parsed arguments for ``cli`` (its own parser, its defaults), plus the
    Megatron-LM arguments slime's provider and loss read, for a tiny model."""
    from slime.utils.arguments import get_slime_extra_args_provider

    parser = argparse.ArgumentParser()
    get_slime_extra_args_provider()(parser)
    args = parser.parse_args(["--rollout-batch-size", "1", "--data-pad-size-multiplier", "4", *cli])
    fields = dict(
        num_layers=LAYERS, hidden_size=H, num_attention_heads=4, use_cpu_initialization=True,
        tensor_model_parallel_size=tp, context_parallel_size=cp, sequence_parallel=sp,
        pipeline_model_parallel_size=pp, params_dtype=dtype, pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16, hidden_dropout=0.0, attention_dropout=0.0,
        calculate_per_token_loss=False, padded_vocab_size=V, max_position_embeddings=512,
        fp16_lm_cross_entropy=False, untie_embeddings_and_output_weights=True,
        position_embedding_type="none", rotary_percent=1.0, rotary_base=10000,
        use_rope_scaling=False, transformer_impl="local", num_experts=None,
        fp8_param_gather=False, mtp_num_layers=None, spec=("_slime", "layer_spec"),
        qk_layernorm=False, multi_latent_attention=False, moe_grouped_gemm=False,
        moe_use_legacy_grouped_gemm=False, variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",
    )  # fmt: skip
    fields.update(megatron)
    for k, v in fields.items():
        setattr(args, k, v)
    if args.eps_clip_high is None:  # as slime_validate_args sets it (the rest needs files)
        args.eps_clip_high = args.eps_clip
    return args


def layer_spec(args, config, vp_stage):
    """``--spec``: tests/_megatron_shim.py's spec for this pipeline stage's layers."""
    from _megatron_shim import block_spec

    return block_spec(args.num_layers // args.pipeline_model_parallel_size)


def build(args: argparse.Namespace, seed: int = 0):
    """The model slime builds from ``args`` (through ``--custom-model-provider-path`` when it is
    set), on this rank's pipeline stage, with its layer norms away from the identity."""
    from _megatron_shim import _cuda_is_cpu, perturb_norms
    from megatron.core import parallel_state as ps
    from megatron.training.global_vars import set_args
    from slime.backends.megatron_utils.model_provider import get_model_provider_func

    set_args(args)
    torch.manual_seed(seed)
    provider = get_model_provider_func(args, "actor")
    with _cuda_is_cpu():
        model = provider(
            pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage()
        )
    perturb_norms(model)
    return model


def float64_copy(model, args: argparse.Namespace):
    """slime's own model (its default provider) in float64, with ``model``'s weights."""
    own = dict(OURS_OFF, params_dtype=torch.float64, pipeline_dtype=torch.float64, bf16=False)
    truth = build(argparse.Namespace(**{**vars(args), **own}))
    with torch.no_grad():
        for p64, p in zip(truth.parameters(), model.parameters(), strict=True):
            p64.copy_(p)
    return truth


OURS_OFF = {"custom_model_provider_path": None, "loss_type": "policy_loss"}


# --- the data: a rollout of five samples, the same on every rank -----------------------------

TOTALS = [13, 9, 22, 7, 17]
RESPONSES = [6, 5, 12, 3, 9]
MICRO_BATCHES = [[0, 1, 2], [3, 4]]


def rollout(seed: int = 1) -> dict:
    """Per-sample tokens, loss masks (sample 1 partly masked, sample 3 fully) and advantages
    (per token, mixed signs), on the CPU like the actor's data after ``_get_rollout_data``."""
    g = torch.Generator().manual_seed(seed)
    masks = [torch.ones(r, dtype=torch.int) for r in RESPONSES]
    masks[1][1:3] = 0
    masks[3][:] = 0
    advantages = [torch.randn(r, generator=g) for r in RESPONSES]
    noise = [0.25 * torch.randn(3, r, generator=g) for r in RESPONSES]  # old, ref, rollout
    # a few tokens far off: ratios past the dual clip (3) where A < 0, KL values past
    # low_var_kl's clamp (10), IS weights past both TIS bounds
    advantages[2][2:4] = -1.0
    noise[2][0, 2:4] = -1.5
    noise[2][1, 5:7] = 3.0
    return {
        "tokens": [torch.randint(0, V, (t,), generator=g) for t in TOTALS],
        "total_lengths": list(TOTALS),
        "response_lengths": list(RESPONSES),
        "loss_masks": masks,
        "rollout_mask_sums": torch.stack([m.sum() for m in masks]).float(),
        "full_advantages": advantages,
        "noise": noise,
    }


def local(values: list[torch.Tensor], data: dict) -> list[torch.Tensor]:
    """Each sample's full response values as slime hands them to the loss on this rank: its
    context-parallel slice (``slice_log_prob_with_cp``, zigzag in both CP modes)."""
    from slime.backends.megatron_utils.cp_utils import slice_log_prob_with_cp

    return [
        slice_log_prob_with_cp(v, t, r)
        for v, t, r in zip(values, data["total_lengths"], data["response_lengths"], strict=True)
    ]


def iterator(data: dict, micro_batches=MICRO_BATCHES):
    from slime.backends.megatron_utils.data import DataIterator

    return DataIterator(data, micro_batches)


def with_log_probs(model, args, data: dict) -> dict:
    """``data`` with the old, reference and rollout log-probs: the model's own plus noise, and
    the advantages, all sliced for this rank (on the last pipeline stage; the others hold no
    loss input). The model's log-probs come from slime's ``forward_only`` pass as it runs it:
    Megatron's schedule with ``forward_only=True`` (no gradient), ``get_log_probs_and_entropy``
    on what the model returns."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from slime.backends.megatron_utils.data import get_batch
    from slime.backends.megatron_utils.loss import get_log_probs_and_entropy

    keys = ["tokens", "loss_masks", "multimodal_train_inputs", "total_lengths", "response_lengths"]

    def step(data_iterator, model, return_schedule_plan: bool = False):  # forward_only's
        batch = get_batch(data_iterator, keys, args.data_pad_size_multiplier, args.allgather_cp)
        out = model(input_ids=batch["tokens"], position_ids=None, attention_mask=None,
                    labels=None, packed_seq_params=batch["packed_seq_params"],
                    loss_mask=batch["full_loss_masks"])  # fmt: skip
        return out, partial(
            get_log_probs_and_entropy, args=args, unconcat_tokens=batch["unconcat_tokens"],
            total_lengths=batch["total_lengths"], response_lengths=batch["response_lengths"],
            with_entropy=args.use_rollout_entropy,
        )  # fmt: skip

    with torch.no_grad():
        store = get_forward_backward_func()(
            forward_step_func=step, data_iterator=iterator(data), model=[model],
            num_microbatches=len(MICRO_BATCHES), seq_length=max(TOTALS), micro_batch_size=1,
            forward_only=True,
        )  # fmt: skip
    if not ps.is_pipeline_last_stage():
        return dict(data, advantages=local(data["full_advantages"], data))
    log_probs = [lp for res in store for lp in res["log_probs"]]
    noise = [local([n[k] for n in data["noise"]], data) for k in range(3)]
    return dict(
        data,
        log_probs=[lp + e for lp, e in zip(log_probs, noise[0], strict=True)],
        ref_log_probs=[lp + e for lp, e in zip(log_probs, noise[1], strict=True)],
        rollout_log_probs=[lp + 0.5 * e for lp, e in zip(log_probs, noise[2], strict=True)],
        advantages=local(data["full_advantages"], data),
        model_log_probs=log_probs,
    )


def forward_step(args, num_microbatches: int, step_global_batch_size: int):
    """slime's ``train_one_step.forward_step`` (model.py), without routing replay, MTP and
    multimodal inputs: ``get_batch``, the model, ``partial(loss_function, ...)``."""
    from slime.backends.megatron_utils.data import get_batch
    from slime.backends.megatron_utils.loss import loss_function

    def step(data_iterator, model, return_schedule_plan: bool = False):
        batch = get_batch(data_iterator, list(KEYS), args.data_pad_size_multiplier,
                          args.allgather_cp)  # fmt: skip
        output = model(input_ids=batch["tokens"], position_ids=None, attention_mask=None,
                       labels=None, packed_seq_params=batch["packed_seq_params"],
                       loss_mask=batch["full_loss_masks"])  # fmt: skip
        loss = partial(loss_function, args, batch, num_microbatches, step_global_batch_size)
        return output, loss

    return step


def float64_log_probs(logits, *, args, unconcat_tokens, total_lengths, response_lengths,
                      with_entropy=False, non_loss_data=True, **_):  # fmt: skip
    """slime's ``get_log_probs_and_entropy`` in float64 (it asserts fp32 logits): the
    tensor-parallel-gathered log-softmax, then slime's own shifted targets, per-sample
    extraction and all-gather redistribution."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    from slime.backends.megatron_utils import loss as sl

    logits = logits.squeeze(0) / getattr(args, "rollout_temperature", 1.0)
    full = gather_from_tensor_model_parallel_region(logits).log_softmax(-1)  # [T, V]
    tokens = sl._build_shifted_tokens(
        logits.shape[0], logits.device, unconcat_tokens, total_lengths, response_lengths,
        args.allgather_cp,
    )  # fmt: skip
    logp = full.gather(-1, tokens[:, None])[:, 0]
    entropy = -(full.exp() * full).sum(-1) if with_entropy else None
    lps, ents = sl._extract_per_sample(logp, entropy, total_lengths, response_lengths,
                                       args.allgather_cp)  # fmt: skip
    res = {"log_probs": lps}
    if with_entropy:
        res["entropy"] = ents
    if args.allgather_cp:
        sl._allgather_cp_redistribute(res, logits_local_len=logits.shape[0],
                                      total_lengths=total_lengths,
                                      response_lengths=response_lengths)  # fmt: skip
    return torch.empty(0), res


def in_float64():
    """slime's loss module with :func:`float64_log_probs` for the block (the truth's run)."""
    import contextlib

    from slime.backends.megatron_utils import loss as sl

    @contextlib.contextmanager
    def patched():
        own = sl.get_log_probs_and_entropy
        sl.get_log_probs_and_entropy = float64_log_probs
        try:
            yield
        finally:
            sl.get_log_probs_and_entropy = own

    return patched()
