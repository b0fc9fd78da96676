#!/usr/bin/env bash
# tests/fast_llm_backend/ (head type logitless in Fast-LLM) in a venv of its own
# (.venv-fastllm): Fast-LLM needs Python 3.12 and is not on PyPI; its source is the vendored peer
# ../shared/peers/fast-llm (put on sys.path by tests/fast_llm_backend/conftest.py, read-only).
# The venv adds only what Fast-LLM's head, losses, Stage and command line import (PyYAML,
# requests); torch 2.13 comes from the shared 3.12 layer (.ci/_python312.sh). Fast-LLM's Triton
# kernels and its torch.compile'd losses are not used on this CPU (see the conftest).
#
# `bash .ci/fast_llm.sh install` only builds the venv, `bash .ci/fast_llm.sh test` only runs the
# tests (.ci/test.sh builds while the main suite runs); no argument does both.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
VENV=${FAST_LLM_VENV:-.venv-fastllm}  # FAST_LLM_VENV: an existing venv to reuse

source .ci/_python312.sh  # venv312

if [ "${1:-all}" != test ]; then
    venv312 "$VENV"
    "$VENV/bin/pip" install -q torch==2.13.0 'PyYAML==6.0.2' 'requests==2.32.5' 'pytest>=7' numpy
    "$VENV/bin/pip" install -q --no-deps -e .
fi
if [ "${1:-all}" != install ] && have_peer fast-llm; then
    "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/fast_llm_backend
fi
