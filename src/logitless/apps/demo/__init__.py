"""A small but real GRPO loop on a tiny random-init transformers policy: ``logitless demo``.

The policy is a 2-layer Llama built from a config (nothing is downloaded) with a 16k
vocabulary, so the LM head holds most of the parameters and the ``[tokens, vocab]`` logits
dominate the memory of a training step. It learns a verifiable toy task: given
``<bos> d1 d2 d3``, answer ``d3 d3 d3`` (echo the last digit); the reward is the fraction of
answer tokens that are right. The toy tokenizer maps ``<pad> <bos>`` and the ten digits to
ids 0-11; the other ids never occur in the data, but the policy spreads probability over them
and every log-prob is normalized over the whole vocabulary.

One step is what an RL trainer does:

1. sample ``group`` completions per prompt from the policy itself (temperature 1, KV cache);
2. score them; group-relative (GRPO) advantages;
3. under ``torch.no_grad()``: the log-probs of the response tokens under the sampling policy
   (``old``) and under the frozen initial policy (``ref``, for the KL term);
4. ``updates`` AdamW steps on the clipped policy loss (DAPO clip-higher, token mean) with a k3
   KL to the reference; the second update sees ratios != 1, so the clip matters.

The head path is the only difference between the two modes. ``logitless`` runs the backbone
and calls :func:`logitless.integrations.hf.causal_lm_logprobs` /
:func:`~logitless.integrations.hf.causal_lm_policy_loss` (prompt rows are never projected,
the loss's head gradients are taken in forward). ``naive`` takes ``model(...).logits`` ->
``log_softmax`` -> :func:`logitless.policy_loss`, the code people write by hand. Both give
the same numbers (tests/test_demo.py, and :func:`check_step` on the demo's own policy, in
float64); the naive one holds several ``[tokens, vocab]`` fp32 tensors. Same numbers is not the
same run: from the first sampled token that float rounding turns another way, two runs part,
and each lands anywhere in the spread of its seeds; :func:`seeds_summary` compares the modes
over seeds.

A random-init policy spreads its mass over the 16k ids, so a reward on digits would start at
~0 and GRPO would see no signal. A short supervised warm-up (``warmup`` steps of
cross-entropy on *random* digit answers) first teaches the format; the answers are random, so
the RL reward starts at chance (0.1) and what it gains above that is RL's work. The warm-up
policy is the KL reference.

The package, one concern a module: :mod:`.config` (:class:`DemoConfig`, the per-step and
per-run results), :mod:`.task` (the toy task and tokenizer), :mod:`.policy` (the model,
sampling, log-probs by either head path), :mod:`.step` (a rollout batch and its loss),
:mod:`.loop` (warm-up, GRPO steps, :func:`run_demo`), :mod:`.check` (one update of both paths
in float64), :mod:`.stats` (several seeds), :mod:`.report` (the CSV) and :mod:`.plot`. What
they write goes through :mod:`logitless.apps.output`, which ``logitless bench`` uses too.

>>> from logitless.apps.demo import DemoConfig, run_demo
>>> result = run_demo(DemoConfig(steps=2, vocab=256, warmup=2), progress=False)
>>> [row.step for row in result.rows]
[1, 2]
"""

# The names of __all__, and (`x as x`, importable as from the one module the demo was, not in
# __all__) the toy tokenizer's ids, a few helpers, and two private functions the tests check.
from .check import StepCheck, check_step
from .config import DemoConfig, DemoResult, StepMetrics
from .loop import memory_meaning as memory_meaning
from .loop import run_demo, show_samples
from .plot import MODE_COLORS as MODE_COLORS
from .plot import plot_demo
from .policy import _sample_rows as _sample_rows
from .policy import build_policy, sample, token_logprobs
from .report import read_csv, write_csv
from .stats import PairedDifference as PairedDifference
from .stats import _t975 as _t975
from .stats import final_rewards, paired_difference, seeds_summary
from .step import Batch, rollout, step_loss
from .task import BOS as BOS
from .task import DIGIT0 as DIGIT0
from .task import IGNORE as IGNORE
from .task import PAD as PAD
from .task import ToyTask
from .task import response_labels as response_labels

__all__ = [
    "Batch",
    "DemoConfig",
    "DemoResult",
    "StepCheck",
    "StepMetrics",
    "ToyTask",
    "build_policy",
    "check_step",
    "final_rewards",
    "paired_difference",
    "plot_demo",
    "read_csv",
    "rollout",
    "run_demo",
    "sample",
    "seeds_summary",
    "show_samples",
    "step_loss",
    "token_logprobs",
    "write_csv",
]
