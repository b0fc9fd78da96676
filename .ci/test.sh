#!/usr/bin/env bash
# Every test, after the README's install line: the main suite (pytest in this Python), then the
# three suites that need venvs of their own (.ci/verl.sh: verl pins an older transformers;
# .ci/megatron.sh and .ci/skyrl.sh: megatron-core 0.19 and skyrl 0.4 need Python 3.12), one
# after another. Arguments go to the main suite's pytest.
#
# Not in parallel: run beside the main suite, the venv suites slowed it from 16 min 44 s to
# 32 min 58 s on a 2-core machine (their tests start gloo ranks that compete for the same two
# cores), so the whole took longer than running them after it.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pytest -q "$@"
bash .ci/verl.sh
bash .ci/megatron.sh
bash .ci/skyrl.sh
