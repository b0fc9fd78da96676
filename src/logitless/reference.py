"""Naive full-logits implementations: the oracle for tests and the baseline for benchmarks.

These materialize the whole ``[..., V]`` logits tensor exactly as a hand-written training step
would. They take the same arguments as :func:`logitless.linear_logprobs` (``chunk_size`` is
accepted and ignored; there is no ``vocab_parallel`` or ``backend``) and the same input checks,
so a test or a benchmark can swap one for the other.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._checks import check_flag
from ._validate import check_chunk_size, check_head_args
from ._validate_replay import ReplayArgs, check_replay_call
from .sampling import SamplingMask
from .types import LogProbs, ReplayLogProbs


def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float | torch.Tensor = 1.0,
    softcap: float | None = None,
    with_entropy: bool = False,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    head_dtype: torch.dtype | None = None,
    sampling_mask: SamplingMask | torch.Tensor | None = None,
    top_k: int | torch.Tensor | None = None,
    top_p: float | torch.Tensor | None = None,
    min_p: float | torch.Tensor | None = None,
    with_kept_mass: bool = False,
) -> LogProbs:
    """Per-token log-probs (and entropy) of ``labels`` from full logits.

    Computes, in plain PyTorch::

        logits = F.linear(hidden, weight, bias).float()        # [..., V]
        logits = softcap * tanh(logits / softcap)              # if softcap
        logits = logits / temperature                          # scalar or [...] per token
        logp   = log_softmax(logits).gather(labels)            # [...]
        H      = -(softmax(logits) * log_softmax(logits)).sum(-1)

    with 0.0 (and a zero gradient) at rows whose label is ``ignore_index``. ``chunk_size`` is
    accepted for signature parity and ignored.

    With sampling replay (``sampling_mask`` / ``top_k`` / ``top_p`` / ``min_p``, as in
    :func:`logitless.linear_logprobs`), the logits outside each row's kept set ``K`` are set to
    ``-inf`` before the log-softmax (a masked log-softmax; :func:`kept_set` builds ``K`` as a
    ``[N, V]`` mask from the full logits), and the result is a ``ReplayLogProbs``.
    """
    check_chunk_size(chunk_size)
    check_flag("with_entropy", with_entropy)
    args = check_head_args(
        hidden,
        weight,
        labels,
        bias=bias,
        temperature=temperature,
        softcap=softcap,
        ignore_index=ignore_index,
        head_dtype=head_dtype,
    )
    replay = check_replay_call(
        args,
        ignore_index,
        vocab_parallel=None,
        sampling_mask=sampling_mask,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        with_kept_mass=with_kept_mass,
    )
    dt = args.head_dtype
    b = None if bias is None else bias.to(dt)
    stats = torch.float64 if dt == torch.float64 else torch.float32  # float64 heads stay so
    logits = F.linear(args.hidden.to(dt), weight.to(dt), b).to(stats)  # [N, V]
    if args.softcap is not None:
        logits = args.softcap * torch.tanh(logits / args.softcap)
    if isinstance(args.temperature, torch.Tensor):
        logits = logits / args.temperature[:, None]
    else:
        logits = logits / args.temperature
    valid = args.labels != ignore_index
    safe_labels = torch.where(valid, args.labels, 0)
    if replay is not None:
        out = _masked_logprobs(logits, safe_labels, valid, replay, with_entropy, with_kept_mass)
        shape = args.batch_shape
        return ReplayLogProbs(*(None if t is None else t.reshape(shape) for t in _fields(out)))
    logp_all = torch.log_softmax(logits, dim=-1)  # [N, V]
    zero = logp_all.new_zeros(())
    logp = torch.where(valid, logp_all.gather(1, safe_labels[:, None]).squeeze(1), zero)
    entropy = None
    if with_entropy:
        ent = -(logp_all.exp() * logp_all).sum(-1)
        entropy = torch.where(valid, ent, zero).reshape(args.batch_shape)
    return LogProbs(logp.reshape(args.batch_shape), entropy)


def kept_set(
    logits: torch.Tensor, labels: torch.Tensor, replay: ReplayArgs
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, V]`` bool kept set of each row (label included) and ``[N]`` bool "label added".

    logits: ``[N, V]`` the sampler's logits (after softcap and temperature); labels: ``[N]``
    ids in ``[0, V)``. With a mask: the mask's ids (every id where a row has none). With the
    sampler's parameters, in vLLM's order: min-p (``z >= max z + log min_p``), top-k (``z >=``
    the k-th largest value, ties kept), then top-p over the renormalized rest: a token is kept
    when the mass of the tokens with a strictly larger logit is below ``p`` (float64 sums).
    """
    n, vocab = logits.shape
    dev = logits.device
    z = logits.detach()
    if replay.is_mask:
        counts = replay.mask_offsets[1:] - replay.mask_offsets[:-1]
        keep = torch.zeros(n, vocab, dtype=torch.bool, device=dev)
        row = torch.repeat_interleave(torch.arange(n, device=dev), counts)
        keep[row, replay.mask_ids] = True
        keep[counts == 0] = True
    else:
        keep = torch.ones(n, vocab, dtype=torch.bool, device=dev)
        if replay.min_p is not None:
            top = z.amax(-1, keepdim=True)
            cut = top + torch.log(replay.min_p.clamp(min=1e-300)).float()[:, None]
            keep &= (z >= cut) | (replay.min_p[:, None] == 0)
        if replay.top_k is not None:
            k = replay.top_k.clamp(1, vocab)
            kth = z.sort(-1, descending=True).values.gather(1, (k - 1)[:, None])
            keep &= (z >= kth) | (replay.top_k[:, None] >= vocab)
        if replay.top_p is not None:
            masked = torch.where(keep, z.double(), float("-inf"))
            probs = masked.softmax(-1)
            sv, order = masked.sort(-1, descending=True)
            sp = probs.gather(1, order)
            excl = sp.cumsum(-1) - sp  # mass before each token, in decreasing order
            # tokens tied in value share the mass strictly before their group
            starts = torch.ones_like(sv, dtype=torch.bool)
            starts[:, 1:] = sv[:, 1:] != sv[:, :-1]
            group = starts.long().cumsum(-1) - 1
            first = torch.full_like(excl, float("inf")).scatter_reduce(
                1, group, excl, "amin", include_self=True
            )
            keep_sorted = first.gather(1, group) < replay.top_p[:, None]
            keep_p = torch.zeros_like(keep).scatter(1, order, keep_sorted)
            keep &= keep_p | (replay.top_p[:, None] >= 1)
    rows = torch.arange(n, device=dev)
    added = ~keep[rows, labels]
    keep[rows, labels] = True
    return keep, added


def _fields(out: ReplayLogProbs) -> tuple:
    return (out.logprobs, out.entropy, out.label_added, out.kept_size, out.log_kept_mass)


def _masked_logprobs(logits, labels, valid, replay, with_entropy, with_kept_mass):
    """The replay branch of :func:`linear_logprobs`: a log-softmax over each row's kept set."""
    keep, added = kept_set(logits, labels, replay)  # [N, V], [N]
    masked = logits.masked_fill(~keep, float("-inf"))
    logp_all = torch.log_softmax(masked, dim=-1)
    zero = logits.new_zeros(())
    logp = torch.where(valid, logp_all.gather(1, labels[:, None]).squeeze(1), zero)
    entropy = None
    if with_entropy:
        # H = lse_K - Σ_K p z: z outside K is replaced by 0 (p = 0 there) so no 0·inf appears
        lse = torch.logsumexp(masked, dim=-1)
        ent = lse - (logp_all.exp() * logits.masked_fill(~keep, 0.0)).sum(-1)
        entropy = torch.where(valid, ent, zero)
    kept_mass = None
    if with_kept_mass:
        with torch.no_grad():
            gap = torch.logsumexp(masked, -1) - torch.logsumexp(logits, -1)
            kept_mass = torch.where(valid, gap.clamp(max=0.0), zero)
    size = torch.where(valid, keep.sum(-1), 0)
    return ReplayLogProbs(
        logp,
        entropy,
        label_added=added & valid,
        kept_size=size,
        log_kept_mass=kept_mass,
    )
