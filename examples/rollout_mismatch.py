"""Read the training-inference mismatch of a small GRPO run, per token, without logits.

    python examples/rollout_mismatch.py                   # 3 engines x 8 steps, ~1 min on 2 cores
    python examples/rollout_mismatch.py --plot docs/rollout_mismatch.png   # and the figure

A 2-layer Llama (hidden 64, vocabulary 4096, random weights, nothing downloaded) is the
policy. The rollout engine is a perturbed copy of it: after every policy update the engine
takes the new weights and its LM head gets Gaussian noise of a known size (``--noise``, a
relative standard deviation; 0 is an exact copy), the way a quantized or differently-kernelled
engine drifts from the trainer. The engine samples 16 answers of 10 tokens (temperature 1,
the full vocabulary) and returns what vLLM's ``logprobs=20`` returns: its top-20 log-probs of
every position and the sampled token's.

The trainer scores the rollout with ``causal_lm_logprobs(..., rollout_topk=...)``: its own
log-probs, and per token the mismatch against the engine's distribution (KL both ways and the
total variation on {the engine's 20 ids, the rest}, its mass on the engine's ids, whether the
two top-1 tokens agree), which :func:`logitless.losses.rollout_mismatch_metrics` reduces per
sequence and per step; then one GRPO update (``causal_lm_policy_loss`` with the engine's
sampled-token log-probs as ``rollout_logprobs``, TIS). The table printed at the end is the
per-step means; ``--plot`` draws each token's KL(rollout‖trainer) against the sampled token's
importance ratio ``π_trainer / π_engine``.
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch

import logitless
from logitless import RolloutTopK
from logitless.integrations import hf
from logitless.losses import rollout_mismatch_metrics

NAMES = ("kl_rollout_trainer", "kl_trainer_rollout", "total_variation", "topk_mass", "top1_agree")


def build(vocab: int, hidden: int, seed: int):
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # a peaked, non-uniform next-token distribution
        model.lm_head.weight.normal_(0.0, 5.0 / hidden**0.5)
    return model


def engine_of(policy, noise: float, g: torch.Generator):
    """The engine: the policy's weights, its LM head perturbed by ``noise`` (relative)."""
    engine = copy.deepcopy(policy).eval()
    with torch.no_grad():
        w = engine.lm_head.weight
        w.add_(noise * w.std() * torch.randn(w.shape, generator=g))
    return engine


@torch.no_grad()
def rollout(engine, prompts: torch.Tensor, length: int, k: int, g: torch.Generator):
    """Sample ``length`` tokens per prompt from the engine; per generated token its log-prob
    and the engine's top-k (plus the sampled token when outside it: vLLM's ``logprobs=k``)."""
    seq = prompts.clone()
    sampled, ids, lps = [], [], []
    for _ in range(length):
        lp = engine(seq, use_cache=False).logits[:, -1].double().log_softmax(-1)
        token = torch.multinomial(lp.exp(), 1, generator=g)[:, 0]
        top = lp.topk(k)
        extra = torch.where((top.indices == token[:, None]).any(1), -1, token)
        ids.append(torch.cat([top.indices, extra[:, None]], 1))
        lps.append(torch.cat([top.values, lp.gather(1, token[:, None])], 1).float())
        sampled.append(lp.gather(1, token[:, None])[:, 0].float())
        seq = torch.cat([seq, token[:, None]], 1)
    return seq, torch.stack(sampled, 1), torch.stack(ids, 1), torch.stack(lps, 1)


def reward(completions: torch.Tensor) -> torch.Tensor:
    """A toy reward: the fraction of even token ids."""
    return (completions % 2 == 0).float().mean(1)


def step(policy, opt, engine, prompts, args, g):
    """One rollout, the trainer's scoring with the diagnostics, one GRPO update."""
    p, c = prompts.shape[1], args.length
    seq, sampled, ids, lps = rollout(engine, prompts, c, args.k, g)
    response = torch.zeros_like(seq, dtype=torch.bool)
    response[:, p:] = True
    labels = hf.causal_lm_labels(seq, response_mask=response)  # position t scores token t + 1
    full = torch.full((seq.shape[0], p + c, args.k + 1), -1)
    full_lps = torch.zeros(full.shape)
    full[:, p - 1 : p - 1 + c], full_lps[:, p - 1 : p - 1 + c] = ids, lps
    with torch.no_grad():
        out = hf.causal_lm_logprobs(
            policy, seq, target_ids=labels, rollout_topk=RolloutTopK(full, full_lps)
        )
    m = out.mismatch
    cols = slice(p - 1, p - 1 + c)
    metrics = rollout_mismatch_metrics(m, labels != -100).metrics
    log_ratio = out.logprobs[:, cols] - sampled  # the sampled token's log π_trainer / π_engine
    tokens = (m.kl_rollout_trainer[:, cols].reshape(-1), log_ratio.reshape(-1))
    r = reward(seq[:, p:])
    groups = r.view(-1, args.group)
    adv = (groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)
    old = torch.zeros_like(out.logprobs)
    old[:, cols] = out.logprobs[:, cols]
    rollout_lp = old.clone()
    rollout_lp[:, cols] = sampled
    config = logitless.PolicyLossConfig(mismatch_is="token", mismatch_is_cap=2.0)
    loss, _ = hf.causal_lm_policy_loss(
        policy, seq, old, adv.reshape(-1), target_ids=labels, rollout_logprobs=rollout_lp,
        config=config,
    )  # fmt: skip
    opt.zero_grad()
    loss.backward()
    opt.step()
    return {k[len("rollout_mismatch/") :]: float(v) for k, v in metrics.items()}, tokens, r


def run(args: argparse.Namespace) -> dict:
    """Every engine's run: per-step metrics and every token's (KL, log ratio)."""
    results = {}
    for noise in args.noise:
        policy = build(args.vocab, args.hidden, args.seed)
        opt = torch.optim.SGD(policy.parameters(), lr=args.lr)
        g = torch.Generator().manual_seed(args.seed + 1)
        steps, kls, ratios = [], [], []
        for _ in range(args.steps):
            prompts = torch.randint(0, args.vocab, (args.prompts, 4), generator=g)
            prompts = prompts.repeat_interleave(args.group, 0)
            engine = engine_of(policy, noise, g)
            found, (kl, lr), r = step(policy, opt, engine, prompts, args, g)
            found["reward"] = float(r.mean())
            steps.append(found)
            kls.append(kl)
            ratios.append(lr)
        results[noise] = {"steps": steps, "kl": torch.cat(kls), "log_ratio": torch.cat(ratios)}
    return results


def table(results: dict) -> str:
    """Mean over steps of each per-step metric, one row per engine (a markdown table)."""
    head = "| engine noise | " + " | ".join(NAMES) + " | mean abs log ratio | tokens/step |"
    lines = [head, "|" + "---|" * (len(NAMES) + 3)]
    for noise, res in results.items():
        steps = res["steps"]
        means = [sum(s[n] for s in steps) / len(steps) for n in NAMES]
        abs_ratio = float(res["log_ratio"].abs().mean())
        cells = " | ".join(f"{v:.3g}" for v in means)
        lines.append(f"| {noise} | {cells} | {abs_ratio:.3g} | {steps[0]['tokens']:.0f} |")
    return "\n".join(lines)


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for noise, res in results.items():
        kl = res["kl"].clamp(min=1e-9)
        left.scatter(kl, res["log_ratio"].exp(), s=4, alpha=0.35, label=f"noise {noise}")
        right.plot(
            [s["kl_rollout_trainer"] for s in res["steps"]], marker="o", label=f"noise {noise}"
        )
    left.set_xscale("log")
    left.set_yscale("log")
    left.set_xlabel("per-token KL(rollout ‖ trainer) on {engine's top-20, rest}")
    left.set_ylabel("sampled-token ratio π_trainer / π_engine")
    left.axhline(1.0, color="k", lw=0.5)
    left.legend(markerscale=3)
    right.set_yscale("log")
    right.set_xlabel("GRPO step")
    right.set_ylabel("rollout_mismatch/kl_rollout_trainer (token mean)")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str]) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--noise", type=float, nargs="+", default=[0.0, 0.05, 0.2])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=4, help="answers per prompt")
    p.add_argument("--length", type=int, default=10)
    p.add_argument("--k", type=int, default=20)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=None, help="write the figure here (needs matplotlib)")
    args = p.parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    results = run(args)
    print(table(results))
    if args.plot:
        plot(results, args.plot)
        print(f"wrote {args.plot}")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
