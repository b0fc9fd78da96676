"""slime's model provider with logitless's head.

Part of :mod:`logitless.integrations.slime`. :func:`model_provider` is what
``--custom-model-provider-path logitless.integrations.slime.model_provider`` names: slime's own
model (what slime builds without that option: ``get_model_provider_func`` of
``slime/backends/megatron_utils/model_provider.py``, from the same arguments), whose forward
passes megatron-core 0.19's ``output_processor=`` (:func:`~.head.with_head`).
"""

from __future__ import annotations

import argparse

from torch import nn

from .config import check_switch, loss_config
from .head import with_head

__all__ = ["model_provider"]


def model_provider(
    pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None
) -> nn.Module:
    """slime's model provider with logitless's head (``--custom-model-provider-path``).

    Reads slime's arguments (Megatron-LM's ``get_args()``, as slime's own provider does),
    checks them first (:func:`~.config.check_switch`, :func:`~.config.loss_config`: a
    ``ValueError`` naming the option, before any model is built), builds slime's own model from
    them and returns it :func:`with_head`."""
    from megatron.training.global_vars import get_args

    args = get_args()
    check_switch(args)
    loss_config(args)
    from slime.backends.megatron_utils.model_provider import get_model_provider_func

    own = argparse.Namespace(**{**vars(args), "custom_model_provider_path": None})
    build = get_model_provider_func(own, "actor")  # slime's wrapper adds a critic's head
    model = build(pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)
    return with_head(model)
