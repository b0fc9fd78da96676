#!/usr/bin/env bash
# tests/nemo_rl/ (logitless as NeMo RL's fused-linear-logprobs backend, against NeMo RL's own
# code in ../shared/peers/nemo-rl) in a venv of its own (.venv-nemo-rl): NeMo RL needs Python
# 3.12 and megatron-core 0.19 (both from the shared 3.12 layer, .ci/_python312.sh). The venv
# adds only what the NeMo RL modules the tests import need (its loss functions, its Megatron
# train / data / setup modules and GRPO's setup): NeMo RL is not installed, its source folder
# is put on sys.path by the tests; Megatron-Bridge and Megatron-LM's megatron.training are
# stubbed there (tests/nemo_rl/_nemo_shim.py says what and why).
#
# `bash .ci/nemo_rl.sh install` only builds the venv, `bash .ci/nemo_rl.sh test` only runs the
# tests (.ci/test.sh builds while the main suite runs); no argument does both.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
VENV=${NEMO_RL_VENV:-.venv-nemo-rl}  # NEMO_RL_VENV: an existing venv to reuse

source .ci/_python312.sh  # venv312

if [ "${1:-all}" != test ]; then
    venv312 "$VENV"
    "$VENV/bin/pip" install -q torch==2.13.0 'megatron-core>=0.19,<0.20' 'pytest>=7' numpy \
        'transformers>=5.5,<5.12' 'ray==2.57.0' pydantic pyzmq pynvml fastapi uvicorn requests \
        pillow hydra-core omegaconf torchdata mlflow swanlab wandb matplotlib prometheus_client \
        rich tensorboard datasets soundfile tensordict
    "$VENV/bin/pip" install -q --no-deps -e .
fi
if [ "${1:-all}" != install ]; then
    "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/nemo_rl
fi
