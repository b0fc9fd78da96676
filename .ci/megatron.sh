#!/usr/bin/env bash
# tests/test_megatron.py and tests/test_megatron_production.py against the newest megatron-core,
# and verl's Megatron engine in its hook mode (tests/verl_backend/test_verl_megatron_hook.py),
# in a venv of their own (.venv-megatron): megatron-core 0.17 and later need Python 3.12, where
# the main suite's Python 3.11 stops at 0.16.x. 0.19 is the first release tested whose
# GPTModel.forward takes an output_processor, so this run covers that seam (logitless's own, and
# the one verl 0.9 passes its fused_output_processor through) and the main suite covers the
# output_layer-forward one. Torch and megatron-core come from the shared 3.12 layer
# (.ci/_python312.sh); this venv adds verl's CPU dependencies (not its GPU extras).
#
# `bash .ci/megatron.sh install` only builds the venv, `bash .ci/megatron.sh test` only runs the
# tests (.ci/test.sh builds while the main suite runs); no argument does both.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
VENV=.venv-megatron

source .ci/_python312.sh  # venv312

if [ "${1:-all}" != test ]; then
    venv312 "$VENV"
    "$VENV/bin/pip" install -q torch==2.13.0 'megatron-core>=0.19,<0.20' 'verl>=0.9.1,<0.10'
    "$VENV/bin/pip" install -q --no-deps -e .
fi
if [ "${1:-all}" != install ]; then
    "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/test_megatron.py \
        tests/test_megatron_production.py tests/verl_backend/test_verl_megatron_hook.py
fi
