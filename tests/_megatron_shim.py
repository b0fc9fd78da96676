"""Test-only: megatron-core 0.16 / 0.19 on CPU gloo ranks, and tiny GPTModels to test the head on.

megatron-core hard-codes CUDA in places that do not matter for what these tests check (the
head); :func:`install` points them at the CPU, in the spawned test ranks only:

- ``torch.cuda.current_device()``: where Megatron allocates its global memory buffer (the
  attention's scratch) and the output of its sequence-parallel all-gather;
- the CUDA RNG tracker's ``fork()`` (dropout regions): a tracker whose fork does nothing;
- ``torch.zeros(..., device="cuda")`` and the like in the pipeline schedules (the token
  counter), the optimizers (their scalars), the gradient clipping and ``megatron.core.utils``
  (the local l2-norm): a ``torch`` whose factories drop ``device`` for those modules;
- ``torch.cuda.current_stream()`` in DDP's gradient sync (0.19; it waits on CUDA-graph
  events the CPU never records): a stream whose waits do nothing;
- ``Tensor.type()`` of a CPU floating tensor answers its CUDA name
  (``'torch.cuda.FloatTensor'``): the distributed optimizer dispatches on it;
- ``torch.cuda.synchronize()`` in the pipeline's point-to-point exchange: nothing;
- ``Tensor.cuda()`` while a model is built (a tied last pipeline stage moves its copy of the
  word embedding there before the all-reduce with the first stage): the tensor itself.

The library itself needs none of this. Two things of the local (non-Transformer-Engine) layer
spec are replaced in the model built here: its layer norm refuses ``sequence_parallel`` (TE's
does not), so a plain ``LayerNorm`` stands in; its attention refuses packed (THD) batches and
context parallelism (only TE's supports them), so a token-local attention stands in: each
token mixes its own query, key and value (out = v·sigmoid(q·k)), which is correct under any
split of the tokens. What is under test is everything after the decoder: the layout of the
hidden states, the labels, the head and every gradient back into the decoder's parameters.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
import warnings

import torch

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
warnings.filterwarnings("ignore", category=FutureWarning)


class _CpuRngTracker:
    def add(self, *args, **kwargs) -> None:
        pass

    def fork(self, *args, **kwargs):
        return contextlib.nullcontext()

    def get_states(self) -> dict:
        return {}

    def set_states(self, states) -> None:
        pass

    def reset(self) -> None:
        pass

    def is_initialized(self) -> bool:
        return True


def _cpu_torch() -> types.ModuleType:
    """``torch`` as megatron-core's schedules and optimizers see it: tensors created with
    ``device="cuda"`` (token counters, the optimizers' scalars) land on the CPU."""
    proxy = types.ModuleType("torch_on_cpu")
    proxy.__dict__.update(vars(torch))

    def on_cpu(factory):
        def make(*args, device=None, **kwargs):
            return factory(*args, **kwargs)

        return make

    for name in ("zeros", "ones", "empty", "full", "tensor"):
        setattr(proxy, name, on_cpu(getattr(torch, name)))
    return proxy


_CUDA_TYPES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float16: "torch.cuda.HalfTensor",
}


def _tensor_type(original):
    """``Tensor.type()`` of a CPU floating tensor as its CUDA name: the distributed optimizer
    and the gradient clipping dispatch on it (``'torch.cuda.FloatTensor'``, ...)."""

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs and self.device.type == "cpu" and self.dtype in _CUDA_TYPES:
            return _CUDA_TYPES[self.dtype]
        if dtype is None:
            return original(self)
        return original(self, dtype, non_blocking, **kwargs)

    return type_


class _CpuStream:
    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass


def install() -> None:
    """Point megatron-core's CUDA hard-codings at the CPU (call in each spawned rank)."""
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.current_stream = lambda device=None: _CpuStream()
    torch.cuda.synchronize = lambda device=None: None  # the pipeline's p2p exchange
    if not getattr(torch.Tensor.type, "_megatron_shim", False):
        torch.Tensor.type = _tensor_type(torch.Tensor.type)
        torch.Tensor.type._megatron_shim = True
    from megatron.core import utils
    from megatron.core.distributed import param_and_grad_buffer
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._CUDA_RNG_STATE_TRACKER = _CpuRngTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    cpu_torch = _cpu_torch()
    for module in (
        schedules,
        optimizer,
        clip_grads,
        distrib_optimizer,
        param_and_grad_buffer,
        utils,
    ):
        module.torch = cpu_torch


def init_parallel(
    tp: int = 1, cp: int = 1, pp: int = 1, gloo_groups: bool = False, vpp: int | None = None
) -> None:
    """``initialize_model_parallel`` on the gloo world (data-parallel size: the rest);
    ``gloo_groups``: also Megatron's gloo copies of its groups (the distributed optimizer's);
    ``vpp``: virtual pipeline stages (model chunks) per pipeline rank."""
    install()
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        create_gloo_process_groups=gloo_groups,
        virtual_pipeline_model_parallel_size=vpp,
    )


@contextlib.contextmanager
def _cuda_is_cpu():
    """``Tensor.cuda()`` returns the tensor itself, for the block."""
    cuda = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.cuda = cuda


class _Norm(torch.nn.LayerNorm):
    def __init__(self, config, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)


class _TokenLocalAttention(torch.nn.Module):
    """out[t] = v[t] · sigmoid(q[t] · k[t]) per head: no token sees another."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, **kwargs) -> None:
        super().__init__()
        self.config = config

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):  # fmt: skip
        gate = torch.sigmoid((query * key).sum(-1, keepdim=True) / query.shape[-1] ** 0.5)
        out = value * gate  # [s, b, np, hn], or [t, np, hn] for a packed batch
        if packed_seq_params is not None:
            return out
        return out.reshape(*out.shape[:2], -1)


def gpt_model(
    *,
    tp: int = 1,
    cp: int = 1,
    sequence_parallel: bool = False,
    vocab: int = 1000,
    hidden: int = 32,
    layers: int = 1,
    tied: bool = False,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    pp: int = 1,
    vpp: int | None = None,
    vp_stage: int | None = None,
    position_embedding_type: str = "learned_absolute",
    **config: object,
):
    """A tiny GPTModel, the same full weights on every rank (each rank holds its shards);
    ``config``: more TransformerConfig fields (``use_mup=True``, ...). ``pp``: this rank's
    pipeline stage of ``layers`` layers (``parallel_state``'s pipeline rank); with ``vpp``,
    its model chunk ``vp_stage`` (of ``vpp`` per pipeline rank). ``position_embedding_type``:
    GPTModel's (``"none"`` where the caller sends no position ids)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=4,
        use_cpu_initialization=True,
        tensor_model_parallel_size=tp,
        context_parallel_size=cp,
        sequence_parallel=sequence_parallel,
        params_dtype=dtype,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=dtype,
        virtual_pipeline_model_parallel_size=vpp,
        **config,
    )
    spec = block_spec(layers // (pp * (vpp or 1)))
    torch.manual_seed(seed)  # use_cpu_initialization: the master weight, then this rank's part
    with _cuda_is_cpu():  # a tied last stage's word embedding: .cuda() before its all-reduce
        model = GPTModel(
            config,
            spec,
            vocab_size=vocab,
            max_sequence_length=256,
            parallel_output=True,
            share_embeddings_and_output_weights=tied,
            position_embedding_type=position_embedding_type,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            **({} if vp_stage is None else {"vp_stage": vp_stage}),
        )
    perturb_norms(model)
    return model


def block_spec(layers: int):
    """The local layer spec for ``layers`` layers (this pipeline stage's), with the plain
    ``LayerNorm`` and the token-local attention of the module docstring."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    layer = get_gpt_layer_local_spec()
    sub = layer.submodules
    attention = dataclasses.replace(
        sub.self_attention,
        submodules=dataclasses.replace(
            sub.self_attention.submodules, core_attention=_TokenLocalAttention
        ),
    )
    layer = dataclasses.replace(
        layer,
        submodules=dataclasses.replace(
            sub, input_layernorm=_Norm, pre_mlp_layernorm=_Norm, self_attention=attention
        ),
    )
    return TransformerBlockSubmodules(layer_specs=[layer] * layers, layer_norm=_Norm)


def perturb_norms(model) -> None:
    """Layer norms away from the identity, so their gradients are tested."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
