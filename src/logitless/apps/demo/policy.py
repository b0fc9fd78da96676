"""The policy: a random-init Llama built from a config, sampling from it with its KV cache, and
the log-probs of labels under it by either head path (logitless or full logits)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .config import DemoConfig
from .task import BOS, IGNORE, PAD

if TYPE_CHECKING:  # transformers is an optional dependency (extra "hf")
    from transformers import PreTrainedModel


def build_policy(config: DemoConfig) -> PreTrainedModel:
    """A random-init ``LlamaForCausalLM`` from a config, seeded by ``config.seed``.

    Raises:
        ImportError: transformers is not installed (``pip install -e '.[hf]'`` in a logitless
            checkout).
    """
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as exc:
        raise ImportError(
            "logitless demo needs transformers: pip install -e '.[hf]' in a logitless checkout"
        ) from exc
    model_config = LlamaConfig(
        vocab_size=config.vocab,
        hidden_size=config.hidden,
        intermediate_size=4 * config.hidden,
        num_hidden_layers=config.layers,
        num_attention_heads=config.heads,
        num_key_value_heads=config.heads,
        max_position_embeddings=2 * config.digits + 1,
        tie_word_embeddings=False,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = LlamaForCausalLM(model_config)
    return model.to(config.device)


def _sample_rows(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One index per row of ``probs`` ``[B, V]`` by inverse CDF: ``[B, 1]`` int64.

    The distribution of ``torch.multinomial(probs, 1)``, which is ~10x slower on CPU.
    """
    cdf = probs.cumsum(dim=-1)  # [B, V]
    u = torch.rand(probs.shape[0], 1, generator=generator, device=probs.device, dtype=cdf.dtype)
    idx = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)  # first j with cdf_j > u·total
    return idx.clamp_(max=probs.shape[-1] - 1)


@torch.no_grad()
def sample(
    model: PreTrainedModel,
    prompt_ids: torch.Tensor,
    new_tokens: int,
    generator: torch.Generator,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Sample ``new_tokens`` per row from the policy, with its KV cache.

    ``prompt_ids`` ``[B, P]`` (no padding) -> response ids ``[B, new_tokens]``. Only the last
    position's logits are computed, ``[B, V]`` per new token (inference needs them).
    """
    out = model(input_ids=prompt_ids, use_cache=True, logits_to_keep=1)
    tokens = []
    for i in range(new_tokens):
        probs = torch.softmax(out.logits[:, -1].float() / temperature, dim=-1)  # [B, V]
        nxt = _sample_rows(probs, generator)  # [B, 1]
        tokens.append(nxt)
        if i + 1 < new_tokens:
            out = model(input_ids=nxt, past_key_values=out.past_key_values, use_cache=True)
    return torch.cat(tokens, dim=1)


def _naive_logprobs(
    model: PreTrainedModel, ids: torch.Tensor, labels: torch.Tensor, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``model(ids).logits`` -> ``log_softmax``: the full-logits code people write by hand."""
    logits = model(input_ids=ids, use_cache=False).logits  # [B, S, V]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32 (or fp64)
    logp_all = torch.log_softmax(logits, dim=-1)  # [B, S, V]
    valid = labels != IGNORE
    logp = logp_all.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # [B, S]
    logp = torch.where(valid, logp, 0.0)
    entropy = None
    if with_entropy:
        entropy = torch.where(valid, -(logp_all.exp() * logp_all).sum(-1), 0.0)  # [B, S]
    return logp, entropy


def token_logprobs(
    model: PreTrainedModel,
    ids: torch.Tensor,
    labels: torch.Tensor,
    *,
    naive: bool,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each label (and the entropy), ``[B, S]``, 0 where the label is ``IGNORE``.

    ``naive=False``: :func:`logitless.integrations.hf.causal_lm_logprobs` (backbone + head op,
    ignored rows never projected); ``naive=True``: full logits. Differentiable: wrap in
    ``torch.no_grad()`` for old / reference log-probs.
    """
    if naive:
        return _naive_logprobs(model, ids, labels, with_entropy)
    from ...integrations.hf import causal_lm_logprobs

    out = causal_lm_logprobs(model, ids, target_ids=labels, with_entropy=with_entropy)
    return out.logprobs, out.entropy
