"""Test-only: import NeMo RL's Megatron worker code (train.py, data.py, setup.py, the loss
functions) on a CPU machine without Megatron-Bridge or Megatron-LM.

- ``megatron.bridge`` (Megatron-Bridge: NeMo RL's model providers, checkpointing, its training
  config containers) is not installed: it needs Transformer Engine. A stub package whose
  modules hand out a plain recording class for any name lets ``megatron/config.py``,
  ``data.py`` and ``setup.py`` import; nothing of it runs in these tests except the config
  containers ``setup._create_megatron_config`` builds (recorded keyword arguments:
  :class:`Recorded`), and ``get_packed_seq_cp_partition_indices`` is never reached (NeMo RL
  calls it for router replay only).
- ``megatron.training.utils.get_ltor_masks_and_position_ids`` (Megatron-LM, not a package
  here) is run for a padded batch: the stub returns what Megatron-LM's does for NeMo RL's
  arguments (no reset, no loss-mask changes): a causal mask ``[1, 1, S, S]`` (True above the
  diagonal: masked) and ``arange`` position ids. The tiny model's token-local attention
  (tests/_megatron_shim.py) reads neither.
- NeMo RL's own logits path hard-codes CUDA where it gathers over the context-parallel group
  (``AllGatherCPTensor.backward``: ``torch.tensor(..., pin_memory=True).cuda()``) and moves
  data with ``.cuda()``: in the spawned ranks ``Tensor.cuda`` returns the tensor and
  ``model_utils.torch.tensor`` drops ``pin_memory``.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types

import torch


class Recorded:
    """Any Megatron-Bridge class: its keyword arguments as attributes."""

    def __init__(self, *args, **kwargs) -> None:
        self.args = args
        self.__dict__.update(kwargs)

    def __class_getitem__(cls, item):
        return cls


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(name, (Recorded,), {})
        setattr(self, name, value)
        return value


class _Finder:
    """Answers every ``megatron.bridge.*`` import with a stub module."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "megatron.bridge" or fullname.startswith("megatron.bridge."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module) -> None:
        pass


def _ltor(data, eod_token, pad_token, reset_position_ids, reset_attention_mask, eod_mask_loss,
          pad_mask_loss):  # fmt: skip
    b, s = data.shape
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=data.device), 1)[None, None]
    loss_mask = torch.ones(b, s, dtype=torch.float, device=data.device)
    return mask, loss_mask, torch.arange(s, device=data.device).expand(b, s)


def install() -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    if "megatron.training" not in sys.modules:
        training = types.ModuleType("megatron.training")
        utils = types.ModuleType("megatron.training.utils")
        utils.get_ltor_masks_and_position_ids = _ltor
        training.utils = utils
        sys.modules["megatron.training"] = training
        sys.modules["megatron.training.utils"] = utils


def cpu_reference_path() -> None:
    """NeMo RL's logits path on CPU (see the module): call in each spawned rank."""
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    from nemo_rl.distributed import model_utils

    proxy = types.ModuleType("torch_without_pinning")
    proxy.__dict__.update(vars(torch))
    proxy.tensor = lambda *a, pin_memory=False, device=None, **kw: torch.tensor(*a, **kw)
    model_utils.torch = proxy
