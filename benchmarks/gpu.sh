#!/usr/bin/env bash
# GPU checks in one go (what the README's "GPU" section reports): the CUDA tests (a whole
# captured step among them), the head, loss, distillation, replay and batch-invariance
# benchmarks against naive / floors / Liger / CCE / TRL, a kernel-level probe, the demo with and
# without logitless, and the whole CPU suite on that machine's torch. Each stage has its own
# time limit, and a failing stage does not stop the next.
#
#   bash benchmarks/gpu.sh [OUTDIR]                       (default: gpu-results/)
#   STAGES='cuda-tests demo' bash benchmarks/gpu.sh       (only those stages)
#   GPU_BUDGET_S=540 bash benchmarks/gpu.sh "$OUT"        (stop starting stages after 540 s)
#
# The stages run in the order of what a short lease must show first: correctness, then the
# log-probs head at 16384 and 65536 tokens (one invocation per size, so a limit loses one size
# only), the fused loss, the no-grad forward probe, distillation, replay, batch invariance,
# Megatron's step, the 4096-token row, the fp32 shape, the demo, the CPU suite. With GPU_BUDGET_S every stage's limit
# is cut to what is left of the budget, and a stage with under 30 s left is skipped (logged):
# a lease of 15 device minutes, a few of them spent starting the machine, holds one call of
# GPU_BUDGET_S=540 and a second call for the stages it skipped (`STAGES=...`).
#
# Needs a CUDA torch with triton, transformers and matplotlib; Liger-Kernel / CCE are used if
# importable (wheels in .whl/ are installed into a scratch dir first when present: the lent
# GPU machine has no PyPI; `bash benchmarks/gpu_wheels.sh` downloads them). Logitless is taken
# from src/ (no install).
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
budget=${GPU_BUDGET_S:-0}

stage() {  # stage NAME SECONDS CMD...: run CMD under a limit, log it, keep going on failure
    local name=$1 limit=$2
    shift 2
    if [[ -n ${STAGES:-} && " $STAGES " != *" $name "* ]]; then return; fi
    if ((budget > 0)); then
        local left=$((budget - SECONDS))
        if ((left < 30)); then
            echo "=== $name: skipped, ${left} s of GPU_BUDGET_S=$budget left" | tee -a "$log"
            return
        fi
        ((limit > left)) && limit=$left
    fi
    echo "=== $name (limit $limit s): $*" | tee -a "$log"
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
    tests/test_cuda_graph.py tests/test_packing.py::test_cuda_matches_cpu \
    tests/test_batch_invariance.py::test_cuda_probe_bits_and_ratio

# A Qwen2.5-7B-sized head in bf16 (issue 43's shape), each size alone, then the fused loss.
bench=(python3 -m logitless bench --device cuda --repeats 5 --full --csv "$out/bench.csv")
qwen=(--dtype bfloat16 --hidden 3584 --vocab 152064)
stage bench-bf16-16k 120 "${bench[@]}" "${qwen[@]}" --tokens 16384 \
    --plot "$out/bench_bf16_16k.png"
stage bench-bf16-64k 180 "${bench[@]}" "${qwen[@]}" --tokens 65536 \
    --plot "$out/bench_bf16_64k.png"
stage bench-loss 150 "${bench[@]}" --task loss "${qwen[@]}" --tokens 16384 \
    --plot "$out/bench_loss_bf16.png"
# Kernel-level breakdown: no-grad forward vs one bare matmul, kernel times, syncs, memory.
stage probe 110 python3 benchmarks/triton_probe.py --quick --skip-correctness
# Distillation: the divergence to a teacher head (naive, logitless, six matmuls, TRL's chunked).
stage bench-distill 200 "${bench[@]}" --task distill "${qwen[@]}" --tokens 16384
# Sampling replay against the full-vocabulary op (a 64-id mask, top_k=512 / top_p=0.95).
stage bench-replay 200 "${bench[@]}" --task replay "${qwen[@]}" --tokens 16384
# The batch-invariant schedule against the default one (head and fused loss).
stage bench-invariance 200 "${bench[@]}" --task invariance "${qwen[@]}" --tokens 16384
# Megatron on one GPU: TP=1, a bf16 Float16Module under the distributed optimizer, against
# Megatron's logits path (needs megatron-core: benchmarks/gpu_wheels.sh carries its wheel).
mh=(python3 benchmarks/megatron_head.py --device cuda --tp 1 --dtype bfloat16
    --distributed-optimizer --seq 16384 --hidden 3584 --vocab 152064 --repeats 5
    --csv "$out/megatron_head.csv")
stage megatron 150 "${mh[@]}"
stage megatron-loss 150 "${mh[@]}" --task loss --entropy
stage bench-bf16-4k 90 "${bench[@]}" "${qwen[@]}" --tokens 4096
stage bench-fp32 200 "${bench[@]}" --tokens 8192

stage demo 420 python3 -m logitless demo --device cuda --compare --plot "$out/demo.png" \
    --csv "$out/demo.csv" --quiet

stage cpu-suite 400 python3 -m pytest -q -p no:cacheprovider -x -n 8 -rs
