#!/usr/bin/env bash
# tests/prime_rl/ (logitless as prime-rl's model.lm_head, switched on by prime-rl's custom loss
# import path) in a venv of its own (.venv-prime-rl): prime-rl (v0.8.0, vendored in
# ../shared/peers/prime-rl, not on PyPI) needs Python 3.12. The tests put its source on
# sys.path; the venv holds only what its head, loss and config modules import (loguru,
# beartype, jaxtyping, prime-pydantic-config and pydantic, transformers as prime-rl pins it,
# wandb) and logitless without dependencies; torch 2.13 comes from the shared 3.12 layer
# (.ci/_python312.sh).
#
# `bash .ci/prime_rl.sh install` only builds the venv, `bash .ci/prime_rl.sh test` only runs the
# tests (.ci/test.sh builds while the main suite runs); no argument does both.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
VENV=${PRIME_RL_VENV:-.venv-prime-rl}  # PRIME_RL_VENV: an existing venv to reuse

source .ci/_python312.sh  # venv312

if [ "${1:-all}" != test ]; then
    venv312 "$VENV"
    "$VENV/bin/pip" install -q torch==2.13.0 'loguru==0.7.3' 'beartype==0.23.1' \
        'jaxtyping==0.3.11' 'prime-pydantic-config==0.4.3' 'transformers==5.6.2' 'wandb==0.31.0' \
        'pytest>=7' numpy
    "$VENV/bin/pip" install -q --no-deps -e .
fi
if [ "${1:-all}" != install ] && have_peer prime-rl; then
    "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/prime_rl
fi
