"""The ``invariance`` bench task: what ``batch_invariant=True`` costs and what it buys.

Cost: the log-prob op (forward + backward, log-probs and entropy) and the fused DAPO loss, each
in the default mode and with ``batch_invariant=True``, timed by the harness like every task
(``bench.methods.TASKS["invariance"]``; the table's ``invariant`` / ``logitless`` and
``fused_invariant`` / ``fused`` time ratio is the mode's price).

What it buys (:func:`ratio_report`, printed under the table): the trainer pattern. The
workload's tokens are cut into 16 sequences; the old log-probs are recorded on batches of 8
sequences without gradients, then the log-probs are computed again, with gradients, on
micro-batches of 1 and of 2 sequences, on the same weights: every PPO ratio should be exactly
1.0. The report gives the share of valid tokens whose ratio ``exp(new - old)`` is not exactly
1.0 for the naive code in fp32 and bf16 (``log_softmax`` of the full logits), the default mode
and the batch-invariant mode (this one: 0), with the largest ``|new - old|``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .workload import IGNORE_INDEX, Workload

SEQUENCES = 16  # the workload's tokens cut into this many sequences
OLD_BATCH = 8  # sequences per no-grad pass recording the old log-probs
MICRO_BATCHES = (1, 2)  # sequences per training micro-batch


def _naive(dtype: torch.dtype) -> Callable:
    """``log_softmax(h @ W.T)`` in ``dtype`` (the softmax in fp32), the label's entry."""

    def logprobs(hidden, weight, labels):
        logits = (hidden.to(dtype) @ weight.to(dtype).t()).float()
        picked = logits.log_softmax(-1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
        return torch.where(labels != IGNORE_INDEX, picked, 0.0)

    return logprobs


def _logitless(dtype: torch.dtype, invariant: bool) -> Callable:
    def logprobs(hidden, weight, labels):
        from logitless import linear_logprobs

        return linear_logprobs(
            hidden.to(dtype), weight.to(dtype), labels, batch_invariant=invariant
        ).logprobs

    return logprobs


def _pattern(logprobs: Callable, hidden, weight, labels) -> tuple[int, int, float]:
    """(tokens whose ratio is not exactly 1.0, valid tokens, max |new - old|) of the trainer
    pattern: old log-probs on batches of :data:`OLD_BATCH` sequences (no grad), new ones on
    micro-batches of each size in :data:`MICRO_BATCHES` (with gradients, forward only)."""
    seqs = hidden.shape[0]
    with torch.no_grad():
        batches = range(0, seqs, OLD_BATCH)
        old = torch.cat(
            [
                logprobs(hidden[s : s + OLD_BATCH], weight, labels[s : s + OLD_BATCH])
                for s in batches
            ]
        )
    valid = labels != IGNORE_INDEX
    off = total = 0
    worst = 0.0
    w = weight.detach().requires_grad_(True)
    for size in MICRO_BATCHES:
        for s in range(0, seqs, size):
            h = hidden[s : s + size].detach().requires_grad_(True)
            new = logprobs(h, w, labels[s : s + size]).detach()
            keep = valid[s : s + size]
            ratio = torch.exp(new - old[s : s + size])[keep]
            off += int((ratio != 1.0).sum())
            total += int(keep.sum())
            gap = (new - old[s : s + size])[keep].abs()
            worst = max(worst, float(gap.max()) if gap.numel() else 0.0)
    return off, total, worst


def ratio_report(work: Workload) -> str:
    """The trainer pattern's table (see the module doc) on the workload's shape, seed and
    valid share; the hidden states are cut into :data:`SEQUENCES` sequences."""
    from .workload import make_inputs

    torch.set_num_threads(work.threads)
    inputs = make_inputs(work)
    seq_len = work.tokens // SEQUENCES
    if seq_len < 1:
        return f"(trainer pattern skipped: --tokens must be at least {SEQUENCES})"
    n = seq_len * SEQUENCES
    hidden = inputs.hidden.detach()[:n].view(SEQUENCES, seq_len, -1)
    labels = inputs.labels[:n].view(SEQUENCES, seq_len)
    weight = inputs.weight.detach()
    cases = [
        ("naive fp32", _naive(torch.float32)),
        ("naive bf16", _naive(torch.bfloat16)),
        ("default fp32", _logitless(torch.float32, False)),
        ("default bf16", _logitless(torch.bfloat16, False)),
        ("batch_invariant fp32", _logitless(torch.float32, True)),
        ("batch_invariant bf16", _logitless(torch.bfloat16, True)),
    ]
    lines = [
        f"trainer pattern: {SEQUENCES} sequences of {seq_len} tokens, old log-probs on batches "
        f"of {OLD_BATCH} (no grad), new ones on micro-batches of "
        f"{' and '.join(map(str, MICRO_BATCHES))} (with grad), same weights "
        f"(H={work.hidden} V={work.vocab} {work.device})",
        "| code | ratio != 1.0 | tokens | max abs(new - old) |",
        "|---|---:|---:|---:|",
    ]
    for name, fn in cases:
        off, total, worst = _pattern(fn, hidden, weight, labels)
        lines.append(f"| {name} | {100.0 * off / max(total, 1):.2f}% | {total} | {worst:.2e} |")
    return "\n".join(lines)
