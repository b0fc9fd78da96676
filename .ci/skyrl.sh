#!/usr/bin/env bash
# tests/skyrl_backend/ (logitless as SkyRL's trainer.fused_lm_head_logprob_backend) in a venv of
# its own (.venv-skyrl): skyrl 0.4 needs Python 3.12, and its Megatron backend megatron-core
# 0.19. Installs skyrl without its extras, plus the packages of its `skyrl-train` extra that its
# config, its Megatron log-prob functions and its `main_base` entrypoint import (Ray among them;
# not flash-attn, vLLM or megatron.bridge: the tests do not start Ray workers) and logitless
# without dependencies; torch 2.13 and megatron-core come from the shared 3.12 layer
# (.ci/_python312.sh).
#
# `bash .ci/skyrl.sh install` only builds the venv, `bash .ci/skyrl.sh test` only runs the tests
# (.ci/test.sh builds while the main suite runs); no argument does both.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
VENV=${SKYRL_VENV:-.venv-skyrl}  # SKYRL_VENV: an existing venv to reuse

source .ci/_python312.sh  # venv312

if [ "${1:-all}" != test ]; then
    venv312 "$VENV"
    "$VENV/bin/pip" install -q torch==2.13.0 'skyrl>=0.4,<0.5' 'megatron-core>=0.19,<0.20' \
        'pytest>=7' numpy omegaconf loguru skyrl-gym 'ray==2.57.0' aiohttp orjson pybase64 \
        jaxtyping torchdata
    "$VENV/bin/pip" install -q --no-deps -e .
fi
if [ "${1:-all}" != install ]; then
    "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/skyrl_backend
fi
