# Sourced by .ci/megatron.sh and .ci/skyrl.sh: python312 prints a Python 3.12 interpreter.
# The two keep venvs of their own (.venv-megatron, .venv-skyrl): skyrl 0.4.0 needs
# tokenizers>=0.23.1, which only transformers 5.11 and later accept, and verl 0.9.1 needs
# transformers<5.11, so pip finds no set of versions for skyrl, verl and megatron-core 0.19
# in one venv (pip: ResolutionImpossible).
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
