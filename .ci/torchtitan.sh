#!/usr/bin/env bash
# tests/torchtitan_backend/ (logitless.integrations.torchtitan.LogitlessLoss against
# torchtitan's ChunkedLossWrapper) in a venv of its own (.venv-torchtitan): torchtitan 0.3.0 from
# PyPI without its dependencies (datasets<4.8, wandb, tensorboard, ... would move the main
# suite's huggingface_hub, fsspec and datasets under transformers and TRL), plus what its loss
# module and RL losses import (tyro, spmd_types); torch 2.13 from the shared 3.12 layer
# (.ci/_python312.sh). The RL package's __init__ imports vLLM, which is not installed:
# tests/torchtitan_backend/_torchtitan.py stands in for that __init__.
#
# `bash .ci/torchtitan.sh install` only builds the venv, `bash .ci/torchtitan.sh test` only runs
# the tests (.ci/test.sh builds while the main suite runs); no argument does both.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
VENV=${TORCHTITAN_VENV:-.venv-torchtitan}  # TORCHTITAN_VENV: an existing venv to reuse

source .ci/_python312.sh  # venv312

if [ "${1:-all}" != test ]; then
    venv312 "$VENV"
    "$VENV/bin/pip" install -q --no-deps 'torchtitan==0.3.0'
    "$VENV/bin/pip" install -q torch==2.13.0 'spmd_types==0.2.3' 'tyro==1.0.17' 'pytest>=7' numpy
    "$VENV/bin/pip" install -q --no-deps -e .
fi
if [ "${1:-all}" != install ]; then
    "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/torchtitan_backend
fi
