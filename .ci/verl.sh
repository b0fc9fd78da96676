#!/usr/bin/env bash
# The verl backend's tests (tests/verl_backend/, benchmarks/verl_step.py at a tiny shape) in a
# venv of their own, .venv-verl: verl 0.9 pins transformers<5.11, older than what the main
# suite runs, so verl is never installed into the main environment. Creates the venv when it is
# missing (CI starts from a fresh clone), installs verl's CPU dependencies (not its GPU extras;
# torch pinned to the CPU build, or pip pulls a CUDA one), megatron-core 0.16 for verl's Megatron
# engine (tests/verl_backend/test_verl_megatron.py; 0.17+ needs Python 3.12) and logitless
# without dependencies.
#
# `bash .ci/verl.sh install` only builds the venv, `bash .ci/verl.sh test` only runs the tests
# (.ci/test.sh builds while the main suite runs); no argument does both.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
VENV=.venv-verl
if [ "${1:-all}" != test ]; then
    [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q torch==2.13.0 'verl>=0.9.1,<0.10' 'megatron-core==0.16.1' \
        'pytest>=7' numpy
    "$VENV/bin/pip" install -q --no-deps -e .
fi
if [ "${1:-all}" != install ]; then
    "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/verl_backend
fi
