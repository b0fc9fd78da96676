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
    # the releases the suite was run with (what NeMo RL's imported modules need, pinned so a
    # new release of one of them cannot break the suite unseen)
    "$VENV/bin/pip" install -q torch==2.13.0 'megatron-core>=0.19,<0.20' 'pytest>=7' numpy \
        'transformers==5.11.0' 'ray==2.57.0' 'pydantic==2.14.4' 'pyzmq==27.3.0' \
        'pynvml==13.0.1' 'fastapi==0.165.0' 'uvicorn==0.55.0' 'requests==2.34.2' \
        'pillow==13.0.0' 'hydra-core==1.3.8' 'omegaconf==2.3.1' 'torchdata==0.11.0' \
        'mlflow==3.17.2' 'swanlab==0.10.3' 'wandb==0.31.0' 'matplotlib==3.11.2' \
        'prometheus_client==0.26.0' 'rich==15.0.0' 'tensorboard==2.21.0' 'datasets==5.2.0' \
        'soundfile==0.14.0' 'tensordict==0.15.3'
    "$VENV/bin/pip" install -q --no-deps -e .
fi
if [ "${1:-all}" != install ] && have_peer nemo-rl; then
    "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/nemo_rl
fi
