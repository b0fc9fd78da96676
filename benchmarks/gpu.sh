#!/usr/bin/env bash
# GPU checks in one go (what the README's "GPU" section reports): the CUDA tests, the head and
# loss benchmarks against naive / floors / Liger / CCE, the demo with and without logitless,
# and the whole CPU suite on that machine's torch. Each stage has its own time limit, and a
# failing stage does not stop the next.
#
#   bash benchmarks/gpu.sh [OUTDIR]          (default: gpu-results/)
#   STAGES='cuda-tests demo' bash benchmarks/gpu.sh    (only those stages)
#
# Needs a CUDA torch with triton, transformers and matplotlib; Liger-Kernel / CCE are used if
# importable (wheels in .whl/ are installed into a scratch dir first when present: the lent
# GPU machine has no PyPI). Logitless is taken from src/ (no install).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-results}
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/peers .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/peers"
fi
log="$out/gpu.log"

stage() {  # stage NAME SECONDS CMD...: run CMD under a limit, log it, keep going on failure
    local name=$1 limit=$2
    shift 2
    if [[ -n ${STAGES:-} && " $STAGES " != *" $name "* ]]; then return; fi
    echo "=== $name: $*" | tee -a "$log"
    local t0=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee -a "$log"
    echo "=== $name: exit ${PIPESTATUS[0]} after $((SECONDS - t0)) s" | tee -a "$log"
}

: >>"$log"
stage versions 60 python3 -c "
import torch, transformers, triton, importlib.util as u
print('torch', torch.__version__, '| triton', triton.__version__, '| transformers', transformers.__version__,
      '| device', torch.cuda.get_device_name(), '| liger', bool(u.find_spec('liger_kernel')),
      '| cce', bool(u.find_spec('cut_cross_entropy')))"

stage cuda-tests 240 python3 -m pytest -q -p no:cacheprovider -rs -n 8 tests/test_cuda.py \
    tests/test_packing.py::test_cuda_matches_cpu

# A Qwen2.5-7B-sized head in bf16, then the default fp32 shape (H=896), then the fused loss.
bench=(python3 -m logitless bench --device cuda --repeats 5 --csv "$out/bench.csv")
stage bench-bf16 300 "${bench[@]}" --dtype bfloat16 --hidden 3584 --vocab 152064 \
    --tokens 4096 16384 65536 --plot "$out/bench_bf16.png"
stage bench-fp32 200 "${bench[@]}" --tokens 8192
stage bench-loss 170 "${bench[@]}" --task loss --dtype bfloat16 --hidden 3584 --vocab 152064 \
    --tokens 16384
# Sampling replay against the full-vocabulary op (a 64-id mask, top_k=512 / top_p=0.95).
stage bench-replay 200 "${bench[@]}" --task replay --dtype bfloat16 --hidden 3584 \
    --vocab 152064 --tokens 16384
# Distillation: the divergence to a teacher head (naive, logitless, six matmuls, TRL's chunked).
stage bench-distill 200 "${bench[@]}" --task distill --dtype bfloat16 --hidden 3584 \
    --vocab 152064 --tokens 16384
# Kernel-level breakdown: no-grad forward vs one bare matmul, kernel times, syncs, memory.
stage probe 110 python3 benchmarks/triton_probe.py --quick --skip-correctness

stage demo 420 python3 -m logitless demo --device cuda --compare --plot "$out/demo.png" \
    --csv "$out/demo.csv" --quiet

stage cpu-suite 400 python3 -m pytest -q -p no:cacheprovider -x -n 8 -rs
