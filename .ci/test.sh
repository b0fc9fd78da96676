#!/usr/bin/env bash
# Every test, after the README's install line: the main suite (pytest in this Python), then the
# suites that need venvs of their own, one after another (SUITES below, each .ci/<suite>.sh):
# verl (it pins an older transformers); megatron (megatron-core 0.19), skyrl (skyrl 0.4),
# nemo_rl, prime_rl, slime and fast_llm (the vendored trainers' source in ../shared/peers), all on
# Python 3.12 over one shared layer (.ci/_python312.sh); torchtitan (0.3, without the
# dependencies that would move the main suite's). Arguments go to the main suite's pytest.
#
# The venvs are built in the background while the main suite runs (pip mostly downloads
# and unpacks: about 5 minutes that no longer add to the run; its output goes to
# .ci-venvs.log, printed if it fails). Their tests do not run beside the main suite: there they
# slowed it from 16 min 44 s to 32 min 58 s on a 2-core machine (both start gloo ranks that
# compete for the same two cores), longer than running them after it.
set -euo pipefail
cd "$(dirname "$0")/.."

SUITES=(verl megatron skyrl nemo_rl prime_rl slime fast_llm torchtitan)

log=.ci-venvs.log
(for suite in "${SUITES[@]}"; do bash ".ci/$suite.sh" install || exit 1; done) >"$log" 2>&1 &
builder=$!

status=0
# Two workers (pytest-xdist, the [test] extra), one file per worker at a time (--dist loadfile: a
# file's module-level fixtures and its gloo ports stay in one process): the suite's slow files
# (the ahead-of-time compile check, DeepSpeed's JIT build, the interpreter runs) overlap instead
# of queuing, which took a cold run's main suite from 44 min 28 s to about half (README).
python3 -m pytest -q -n 2 --dist loadfile --durations=25 "$@" || status=$?

if ! wait "$builder"; then
    echo "building the venvs failed (.ci/<suite>.sh install for ${SUITES[*]}):" >&2
    grep -v "^WARNING: Location" "$log" | tail -40 >&2
    exit 1
fi
[ "$status" -eq 0 ] || exit "$status"
echo "main suite and venv builds: ${SECONDS} s"
for suite in "${SUITES[@]}"; do
    start=$SECONDS
    bash ".ci/$suite.sh" test
    echo "suite $suite: $((SECONDS - start)) s"
done
