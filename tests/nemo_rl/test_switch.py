"""The switch: NeMo RL's own model-setup refusals of its fused path, lifted for a config that
selects logitless and kept for any other; the config value that carries the switch to NeMo
RL's workers; uninstall. NeMo RL's ``megatron/setup.py`` is imported with Megatron-Bridge
stubbed (tests/nemo_rl/_nemo_shim.py): the two functions run here are NeMo RL's own, the
config containers they build are recorded arguments."""

from __future__ import annotations

import functools
import os
import pickle
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core (the 3.12 layer, .ci/nemo_rl.sh)")
pytest.importorskip("ray", reason="NeMo RL's imports (.ci/nemo_rl.sh)")

import _nemo_shim  # noqa: E402

_nemo_shim.install()

import logitless.integrations.nemo_rl as nemo  # noqa: E402


def _policy(backend: str = "logitless", cp: int = 2, overlap: bool = True) -> dict:
    return {
        "sequence_packing": {"enabled": True},
        "train_global_batch_size": 8,
        "megatron_cfg": {
            "use_fused_linear_logprobs": True,
            "fused_linear_logprobs_backend": backend,
            "tensor_model_parallel_size": 1,
            "pipeline_model_parallel_size": 1,
            "num_layers_in_first_pipeline_stage": None,
            "num_layers_in_last_pipeline_stage": None,
            "sequence_parallel": False,
            "context_parallel_size": cp,
            "train_iters": 1,
            "optimizer": {"optimizer": "adam", "use_distributed_optimizer": True},
            "scheduler": {},
            "distributed_data_parallel_config": {
                "overlap_param_gather": overlap,
                "overlap_grad_reduce": True,
                "grad_reduce_in_fp32": True,
                "data_parallel_sharding_strategy": "optim_grads_params",
            },
        },
    }


def test_context_parallelism_refusal_lifted():
    """``setup._apply_parallelism_config`` (NeMo RL: 'Context Parallelism is not supported
    with linear CE fusion loss') passes with logitless and still refuses NeMo RL's own."""
    from nemo_rl.models.megatron import setup

    model_cfg = types.SimpleNamespace()
    setup._apply_parallelism_config(model_cfg, _policy())
    assert model_cfg.context_parallel_size == 2
    with pytest.raises(AssertionError, match="Context Parallelism is not supported"):
        setup._apply_parallelism_config(model_cfg, _policy(backend="nemo"))


def test_overlap_param_gather_refusal_lifted():
    """``setup._create_megatron_config`` (NeMo RL: 'use_fused_linear_logprobs is incompatible
    with overlap_param_gather') builds the config with logitless, and the distributed
    optimizer's ``overlap_param_gather`` reaches it; NeMo RL's own fused path still refuses."""
    from nemo_rl.models.megatron import setup

    config = _policy(cp=1)
    out = setup._create_megatron_config(None, None, config, "tiny", torch.bfloat16)
    assert out.ddp.overlap_param_gather is True and out.optimizer.overlap_param_gather is True
    assert config["megatron_cfg"]["use_fused_linear_logprobs"] is True  # not changed in place
    with pytest.raises(AssertionError, match="incompatible with overlap_param_gather"):
        setup._create_megatron_config(None, None, _policy("nemo", 1), "tiny", torch.bfloat16)


def test_switch_value_imports_logitless_where_the_config_goes():
    """``mark`` stores :data:`BACKEND`; a config pickled to a fresh Python (a Ray worker)
    imports logitless there, which installs its fused forward before any model is built."""
    policy = _policy()
    nemo.mark(policy)
    value = policy["megatron_cfg"]["fused_linear_logprobs_backend"]
    assert value == "logitless" and value is nemo.BACKEND
    blob = pickle.dumps(policy)
    root = Path(__file__).resolve().parents[2]
    code = (
        "import pickle, sys; sys.path.insert(0, sys.argv[1]); import _nemo_shim; "
        "_nemo_shim.install(); assert 'logitless' not in sys.modules; "
        "cfg = pickle.loads(bytes.fromhex(sys.argv[2])); "
        "from logitless.integrations import nemo_rl; "
        "print(nemo_rl.installed(), nemo_rl.selected(cfg))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), *sys.path])}
    out = subprocess.run(
        [sys.executable, "-c", code, str(Path(__file__).parent), blob.hex()],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert out.stdout.split() == ["True", "True"], out.stderr[-2000:]


def test_uninstall_gives_nemo_rl_its_functions_back():
    from nemo_rl.distributed import model_utils
    from nemo_rl.models.megatron import setup, train

    assert nemo.installed()
    nemo.uninstall()
    try:
        assert not nemo.installed()
        assert train.apply_temperature_scaling.__module__ == "nemo_rl.models.megatron.train"
        with pytest.raises(AssertionError, match="Context Parallelism is not supported"):
            setup._apply_parallelism_config(types.SimpleNamespace(), _policy())
    finally:
        nemo.install()
    assert model_utils._gpt_forward_with_linear_ce_fusion is nemo.fused_forward


# --- GRPO's setup (the driver) --------------------------------------------------------------

PEER = Path(__file__).resolve().parents[3] / "shared" / "peers" / "nemo-rl"


class _Reached(Exception):
    """Raised where the test stops NeMo RL's ``grpo.setup``: after its loss function, before
    it starts Ray clusters and vLLM."""


def _grpo_config(tmp_path, backend: str):
    """NeMo RL's reference GRPO config (its unit tests'), through its own loader, its Hydra
    overrides (the ``+`` of a key the file does not have) and its pydantic ``MasterConfig``:
    Megatron, packing on, top-k 50, the fused path with ``backend``."""
    from nemo_rl.algorithms.grpo import MasterConfig
    from nemo_rl.utils.config import (
        load_config,
        parse_hydra_overrides,
        register_omegaconf_resolvers,
    )
    from omegaconf import OmegaConf

    register_omegaconf_resolvers()
    cfg = load_config(str(PEER / "tests" / "unit" / "reference_configs" / "grpo_math_1B.yaml"))
    cfg = parse_hydra_overrides(cfg, [
        "policy.megatron_cfg.enabled=true", "policy.dtensor_cfg.enabled=false",
        "policy.megatron_cfg.use_fused_linear_logprobs=true",
        f"+policy.megatron_cfg.fused_linear_logprobs_backend={backend}",
        "policy.sequence_packing.enabled=true", "policy.generation.top_k=50",
        "grpo.val_period=0", "logger.monitor_gpus=false", f"logger.log_dir={tmp_path}",
        "checkpointing.enabled=false", f"checkpointing.checkpoint_dir={tmp_path}",
    ])  # fmt: skip
    return MasterConfig(**OmegaConf.to_container(cfg, resolve=True))


def test_grpo_refusals_lifted(tmp_path, monkeypatch):
    """NeMo RL's real ``grpo.setup`` with packing and top-k refuses its own fused path
    ('not supported with sequence packing for GRPO') and passes with logitless: its loss
    function is built (seen with the flag read as false there), the flag is true again after,
    and the policy factory NeMo RL calls gives the workers the flag and the marked backend."""
    from nemo_rl.algorithms import grpo

    from logitless.integrations.nemo_rl import hooks

    nemo.install(driver=True)  # the driver's part: grpo.setup
    built, seen = [], []

    def stop(*_a, **_k):
        raise _Reached

    spy = lambda cfg, use_fused_linear_logprobs=False: built.append(use_fused_linear_logprobs)  # noqa: E731
    monkeypatch.setattr(grpo, "ClippedPGLossFn", spy)
    monkeypatch.setattr(grpo, "_validate_use_kl_in_reward_compat", stop)
    original = hooks._ORIGINAL[("nemo_rl.algorithms.grpo", "setup")]
    factories: list = []

    @functools.wraps(original)
    def recording(*args, **kwargs):
        factories.append(kwargs.get("policy_factory"))
        return original(*args, **kwargs)

    monkeypatch.setitem(hooks._ORIGINAL, ("nemo_rl.algorithms.grpo", "setup"), recording)
    with pytest.raises(AssertionError, match="not supported with sequence packing for GRPO"):
        grpo.setup(_grpo_config(tmp_path, "nemo"), None, list(range(64)), None)

    master = _grpo_config(tmp_path, "logitless")

    def factory(**kw):
        seen.append(dict(kw["config"]["megatron_cfg"]))

    with pytest.raises(_Reached):
        grpo.setup(master, None, list(range(64)), None, policy_factory=factory)
    assert built == [False], built  # NeMo RL's checks of its own forward saw it off
    megatron = master.policy["megatron_cfg"]
    assert megatron["use_fused_linear_logprobs"] is True
    megatron["use_fused_linear_logprobs"] = False  # as during setup
    factories[-1](config=master.policy)  # what grpo.setup's init_policy calls
    assert seen[0]["use_fused_linear_logprobs"] is True
    assert seen[0]["fused_linear_logprobs_backend"] is nemo.BACKEND
