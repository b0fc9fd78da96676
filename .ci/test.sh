#!/usr/bin/env bash
# Every test, after the README's install line: the main suite (pytest in this Python), then the
# suites that need venvs of their own (.ci/verl.sh: verl pins an older transformers;
# .ci/megatron.sh, .ci/skyrl.sh and .ci/nemo_rl.sh: megatron-core 0.19, skyrl 0.4 and NeMo RL
# need Python 3.12), one after another. Arguments go to the main suite's pytest.
#
# The three venvs are built in the background while the main suite runs (pip mostly downloads
# and unpacks: about 5 minutes that no longer add to the run; its output goes to
# .ci-venvs.log, printed if it fails). Their tests do not run beside the main suite: there they
# slowed it from 16 min 44 s to 32 min 58 s on a 2-core machine (both start gloo ranks that
# compete for the same two cores), longer than running them after it.
set -euo pipefail
cd "$(dirname "$0")/.."

log=.ci-venvs.log
(bash .ci/verl.sh install && bash .ci/megatron.sh install && bash .ci/skyrl.sh install \
    && bash .ci/nemo_rl.sh install) \
    >"$log" 2>&1 &
builder=$!

status=0
python3 -m pytest -q "$@" || status=$?

if ! wait "$builder"; then
    echo "building the venvs failed (.ci/verl.sh, .ci/megatron.sh, .ci/skyrl.sh, .ci/nemo_rl.sh" \
        "install):" >&2
    grep -v "^WARNING: Location" "$log" | tail -40 >&2
    exit 1
fi
[ "$status" -eq 0 ] || exit "$status"
bash .ci/verl.sh test
bash .ci/megatron.sh test
bash .ci/skyrl.sh test
bash .ci/nemo_rl.sh test
