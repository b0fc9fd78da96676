"""GRPO on a tiny random-init transformers policy, on CPU: the same run as ``logitless demo``.

    python examples/grpo_toy.py               # logitless head path (about 1 min on 2 cores)
    python examples/grpo_toy.py --naive       # model(...).logits -> log_softmax (about 3 min)
    python examples/grpo_toy.py --compare     # both, 3 seeds each, one plot (about 11 min)
    python examples/grpo_toy.py --check-step  # one update of both paths in float64 (seconds)
    python examples/grpo_toy.py --help        # every option

A 2-layer Llama with a 16k vocabulary (built from a config, nothing is downloaded) learns to
echo the last digit of its prompt: the reward rises from chance (0.1) to 0.8-1 in 200 steps,
depending on the seed. The progress bars show the warm-up, then reward, loss, KL to the
initial policy and entropy per step; the summary gives the reward first -> last, the peak
memory of a step and the run time; the plot (demo-results/) shows reward and memory per step.
--compare reports the final reward of each mode over seeds (one run of either mode lands
anywhere in that spread) and checks that both compute the same update.

The loop itself (sampling with the KV cache, GRPO advantages, no-grad old and reference
log-probs, the clipped loss with a KL term, AdamW) is in the package ``logitless/apps/demo/``:
read ``rollout`` and ``step_loss`` in ``step.py``, ``run_demo`` in ``loop.py``.
"""

import sys

from logitless.apps.cli import main

if __name__ == "__main__":
    sys.exit(main(["demo", *sys.argv[1:]]))
