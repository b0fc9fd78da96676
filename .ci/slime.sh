#!/usr/bin/env bash
# tests/slime/ (logitless as slime's model provider and custom policy loss,
# logitless.integrations.slime) against slime's own source, ../shared/peers/slime (slime is not
# on PyPI), in a venv of its own (.venv-slime): slime needs Python 3.12 and the switch
# megatron-core 0.19 (GPTModel.forward's output_processor). The venv is layered over the
# shared 3.12 layer (.ci/_python312.sh: torch 2.13, megatron-core 0.19, pytest) and adds only
# what the slime modules the tests import need: httpx (slime.utils.misc), pyyaml and requests
# (slime.utils.arguments, its argument parser); logitless without dependencies. The rest of what
# slime imports there (wandb, sglang's argument classes, Megatron-LM's megatron.training) is
# stubbed by the tests, which say so (tests/slime/_slime.py).
#
# `bash .ci/slime.sh install` only builds the venv, `bash .ci/slime.sh test` only runs the tests
# (.ci/test.sh builds while the main suite runs); no argument does both. SLIME_VENV: an existing
# venv to reuse.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
VENV=${SLIME_VENV:-.venv-slime}

source .ci/_python312.sh  # venv312

if [ "${1:-all}" != test ]; then
    venv312 "$VENV"
    "$VENV/bin/pip" install -q 'httpx==0.28.1' 'pyyaml==6.0.3' 'requests==2.32.5'
    "$VENV/bin/pip" install -q --no-deps -e .
fi
if [ "${1:-all}" != install ]; then
    if have_peer slime; then
        "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/slime
    fi
fi
