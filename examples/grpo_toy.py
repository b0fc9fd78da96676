"""GRPO on a tiny random-init transformers policy, on CPU: the same run as ``logitless demo``.

    python examples/grpo_toy.py               # logitless head path (about 1.5 min on 2 cores)
    python examples/grpo_toy.py --naive       # model(...).logits -> log_softmax, for comparison
    python examples/grpo_toy.py --compare     # both, one plot
    python examples/grpo_toy.py --help        # every option

A 2-layer Llama with a 16k vocabulary (built from a config, nothing is downloaded) learns to
echo the last digit of its prompt: the reward rises from chance (0.1) to ~1 in 200 steps. The
progress bar shows reward, loss, KL to the initial policy and entropy; the summary gives the
reward first -> last and the peak memory of a step; the plot (demo-results/) shows both per
step. The loop itself (sampling with the KV cache, GRPO advantages, no-grad old and reference
log-probs, the clipped loss with a KL term, AdamW) is in ``logitless/apps/demo.py``: read
``rollout``, ``step_loss`` and ``run_demo`` there.
"""

import sys

from logitless.apps.cli import main

if __name__ == "__main__":
    sys.exit(main(["demo", *sys.argv[1:]]))
