"""Sampling replay on CPU: the importance ratio against a truncating sampler, with and without.

    python examples/sampling_replay.py            # a few seconds on 2 cores

An "inference engine" samples 2048 tokens from a random policy head with temperature 1,
top_k=50 and top_p=0.9, the way vLLM's sampler does, and reports what vLLM reports in
``processed_logprobs`` mode: the log-prob of each sampled token under the truncated,
renormalized distribution, and which tokens it kept. The trainer then scores the same
tokens with the same weights, i.e. exactly on policy, three ways:

1. over the whole vocabulary (no replay): every ratio ``π_train / π_engine`` equals the
   token's kept mass ``Σ_{j∈K} p_j < 1``; a PPO clip of 0.2 discards a large share of the
   tokens, and the bias is the same in every step;
2. over the engine's kept sets (``sampling_mask=``): the ratios are 1;
3. replaying the sampler (``top_k=50, top_p=0.9``): the ratios are 1, without the masks.

The printed table gives the mean, min and max ratio and the mean log ratio, the share of
tokens a PPO clip of 0.2 clips (advantages ±1: a ratio below 0.8 with a negative advantage
gets no gradient), the fused loss's ``replay_log_kept_mass`` (the mean log kept mass: the
bias the first way carries) and ``replay_label_added``.
"""

from __future__ import annotations

import math

import torch

import logitless

VOCAB, HIDDEN, TOKENS = 2048, 64, 2048
TOP_K, TOP_P = 50, 0.9


def engine_sample(logits: torch.Tensor, top_k: int, top_p: float, gen: torch.Generator):
    """A vLLM-style sampler on full logits [N, V]: top-k (ties at the k-th value kept), then
    top-p over the renormalized top-k distribution (ascending cumulative sum, the largest
    token always kept), then a sample from what is left.

    Returns (tokens [N], processed log-probs [N], kept mask [N, V] bool)."""
    srt, idx = logits.sort(-1)
    kth = srt[:, -top_k][:, None]
    srt = srt.masked_fill(srt < kth, -math.inf)
    cum = srt.softmax(-1).cumsum(-1)
    drop = cum <= 1 - top_p
    drop[:, -1] = False
    srt = srt.masked_fill(drop, -math.inf)
    processed = torch.full_like(logits, -math.inf).scatter(1, idx, srt)
    logp = processed.log_softmax(-1)
    tokens = torch.multinomial(logp.exp(), 1, generator=gen)[:, 0]
    return tokens, logp.gather(1, tokens[:, None])[:, 0], processed > -math.inf


def run(
    seed: int = 0, vocab: int = VOCAB, hidden_size: int = HIDDEN, tokens: int = TOKENS
) -> dict[str, dict[str, float]]:
    """The three ways of scoring, as rows of ratio statistics."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, hidden_size, generator=gen)
    weight = torch.randn(vocab, hidden_size, generator=gen) * (2.5 / math.sqrt(hidden_size))
    with torch.no_grad():
        logits = hidden @ weight.t()  # the engine's own full logits
        sampled, engine_logp, kept = engine_sample(logits, TOP_K, TOP_P, gen)
    kept_ids = torch.where(kept, torch.arange(vocab), -1)
    mask = logitless.SamplingMask.from_padded(kept_ids)  # what vLLM returns per token

    config = logitless.PolicyLossConfig(clip_low=0.2, clip_high=0.2)
    advantages = torch.randn(tokens, generator=gen).sign()  # ±1 per token
    doc = torch.zeros(tokens, dtype=torch.long)
    ways = {
        "no replay (full vocabulary)": {},
        "sampling_mask= (engine's kept sets)": {"sampling_mask": mask},
        f"top_k={TOP_K}, top_p={TOP_P} (replayed)": {"top_k": TOP_K, "top_p": TOP_P},
    }
    rows = {}
    for name, replay in ways.items():
        w = weight.clone().requires_grad_()
        out = logitless.linear_logprobs(hidden, w, sampled, **replay)
        ratio = (out.logprobs.detach() - engine_logp).exp()
        loss, metrics = logitless.fused_policy_loss(
            hidden, w, sampled, engine_logp, advantages, config=config, document_ids=doc,
            with_kept_mass=bool(replay), **replay,
        )  # fmt: skip
        loss.backward()
        rows[name] = {
            "ratio_mean": float(ratio.mean()),
            "ratio_min": float(ratio.min()),
            "ratio_max": float(ratio.max()),
            "log_ratio_mean": float(ratio.log().mean()),
            "clipped": float(metrics["clip_frac_low"] + metrics["clip_frac_high"]),
            "log_kept_mass": float(metrics.get("replay_log_kept_mass", float("nan"))),
            "labels_added": float(metrics.get("replay_label_added", float("nan"))),
        }
    return rows


def main() -> None:
    rows = run()
    print(f"{TOKENS} tokens sampled with top_k={TOP_K}, top_p={TOP_P} (V={VOCAB}), on policy")
    head = f"{'trainer log-probs':38} {'ratio mean':>10} {'min':>7} {'max':>7}"
    print(head + f" {'mean log ratio':>14} {'clipped':>8} {'log kept mass':>13} {'added':>6}")
    for name, r in rows.items():
        print(
            f"{name:38} {r['ratio_mean']:10.4f} {r['ratio_min']:7.4f} {r['ratio_max']:7.4f}"
            f" {r['log_ratio_mean']:14.4f} {r['clipped']:8.1%} {_num(r['log_kept_mass'], 13)}"
            f" {_num(r['labels_added'], 6, 0)}"
        )


def _num(x: float, width: int, digits: int = 4) -> str:
    return f"{'-':>{width}}" if math.isnan(x) else f"{x:{width}.{digits}f}"


if __name__ == "__main__":
    main()
