#!/usr/bin/env bash
# Every test, after the README's install line: the main suite (pytest in this Python) and the
# three suites that need venvs of their own (.ci/verl.sh: verl pins an older transformers;
# .ci/megatron.sh and .ci/skyrl.sh: megatron-core 0.19 and skyrl 0.4 need Python 3.12).
#
# The venv suites build their venvs and run one after another *beside* the main suite, in the
# background: a venv build is mostly downloading and unpacking wheels, and the main suite
# leaves a core idle for much of its run (process start-up, imports, single-threaded test
# code), so the whole takes about the main suite's time plus a few minutes instead of the sum.
# Their output is printed once they are done; the exit status is that of the first part that
# failed (the main suite's first). Arguments go to the main suite's pytest.
set -uo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1

log=$(mktemp)
trap 'rm -f "$log"' EXIT
(bash .ci/verl.sh && bash .ci/megatron.sh && bash .ci/skyrl.sh) >"$log" 2>&1 &
venvs=$!

python3 -m pytest -q "$@"
main=$?
wait "$venvs"
venv=$?
echo "--- the venv suites: .ci/verl.sh, .ci/megatron.sh, .ci/skyrl.sh (exit status $venv) ---"
cat "$log"
[ "$main" -ne 0 ] && exit "$main"
exit "$venv"
