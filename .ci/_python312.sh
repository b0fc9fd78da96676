# Sourced by .ci/megatron.sh and .ci/skyrl.sh. Both need Python 3.12 (megatron-core 0.19, skyrl
# 0.4), where torch comes from PyPI as a CUDA build of about 4.7 GB (no GPU is needed to run it).
# They cannot share one venv: skyrl 0.4.0 needs tokenizers>=0.23.1, which only transformers 5.11
# and later accept, and verl 0.9.1 (in .venv-megatron for its hook-mode test) needs
# transformers<5.11 (pip: ResolutionImpossible). So the heavy part is installed once, into
# .venv-py312 (torch, megatron-core 0.19, pytest, numpy), and each suite's venv holds only what
# it adds, with a .pth file that puts .venv-py312's site-packages after its own on sys.path: a
# package a suite pins differently is installed into the suite's venv and wins. Two full venvs
# ran a CI machine out of disk (stop 45: "No space left on device" while installing the second).

python312() {  # $PYTHON312, else pyenv's newest 3.12, else python3.12 on PATH
    local c
    for c in "${PYTHON312:-}" \
        "$(command -v pyenv >/dev/null && echo "$(pyenv root)/versions/$(pyenv latest 3.12 2>/dev/null)/bin/python")" \
        python3.12; do
        if [ -n "$c" ] && "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
            echo "$c"
            return 0
        fi
    done
    echo "no Python 3.12 found (set PYTHON312=/path/to/python3.12)" >&2
    return 1
}

BASE312=${BASE312:-.venv-py312}  # the shared layer

_site_packages() { "$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }

venv312() {  # venv312 DIR: make DIR a 3.12 venv layered over $BASE312 (both made when missing)
    local dir=$1 py
    py=$(python312)
    [ -x "$BASE312/bin/python" ] || "$py" -m venv "$BASE312"
    "$BASE312/bin/python" -m pip install -q torch==2.13.0 'megatron-core>=0.19,<0.20' 'pytest>=7' \
        'hypothesis>=6.80' numpy
    [ -x "$dir/bin/python" ] || "$py" -m venv "$dir"
    _site_packages "$(cd "$BASE312" && pwd -P)" >"$(_site_packages "$dir")/_logitless_py312_base.pth"
}

have_peer() {  # have_peer NAME: whether ../shared/peers/NAME (a vendored trainer) is there.
    # Its suite runs against that source: where it is missing, CI fails (CI=true: the folder is
    # part of CI's checkout) and a user's clone skips the suite with this note.
    [ -d "../shared/peers/$1" ] && return 0
    echo "../shared/peers/$1 is missing: its suite runs against that trainer's source" >&2
    [ "${CI:-}" = true ] && exit 1
    return 1
}
