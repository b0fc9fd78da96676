#!/usr/bin/env bash
# Download the peers the GPU benchmarks compare against, as wheels for the lent GPU machine
# (Python 3.12, no PyPI there) into .whl/ (git-ignored; name it in the device call's `carry`).
# benchmarks/gpu.sh installs them into a scratch directory before its first stage.
#
#   bash benchmarks/gpu_wheels.sh
#
# Pinned to the versions the published GPU tables used (Liger-Kernel 0.8.5, Cut Cross-Entropy
# 25.1.1), the TRL of the CPU suite and the megatron-core of its Megatron tests (0.19); TRL's
# chunked heads import `datasets`, which needs `dill` and `multiprocess` beside what that
# machine's image already holds.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl \
    liger-kernel==0.8.5 cut-cross-entropy==25.1.1 trl==1.16.0 datasets==5.2.0 dill==0.4.1 \
    multiprocess==0.70.19 megatron-core==0.19.2
du -sh .whl && ls .whl
