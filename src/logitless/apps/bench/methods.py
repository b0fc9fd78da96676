"""Registry of benchmark tasks and the methods that implement each.

A *method* turns a workload's inputs into a ``step``: a zero-argument callable that runs one
timed iteration (forward + backward for real methods, bare matmuls for floors). A *task* is a
named set of methods measured on the same workload; ``logprobs`` is the only task now, and a
fused policy-loss task can be added as another entry of :data:`TASKS` without touching the
harness.

Adapters for peer libraries import them lazily, inside the worker subprocess, and report why
they cannot run instead of raising.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .workload import DTYPES, IGNORE_INDEX, Inputs, Workload

Step = Callable[[], None]


@dataclass(frozen=True)
class Method:
    """One way of computing a task.

    name: CLI / CSV name.
    role: ``"baseline"`` (the naive reference), ``"op"`` (logitless), ``"floor"`` (time floor,
        not a usable implementation) or ``"peer"`` (another library).
    build: inputs -> step; may raise.
    unavailable: workload -> reason this method cannot run here, or None.
    note: caveat shown in the table and the CSV (e.g. "log-probs only").
    by_default: device ("cpu", "cuda", ...) -> whether a run without ``--methods`` includes
        it (a method too slow there to time in the default run is named to run).
    """

    name: str
    role: str
    build: Callable[[Workload, Inputs], Step]
    unavailable: Callable[[Workload], str | None] = lambda work: None
    note: Callable[[Workload], str] = lambda work: ""
    by_default: Callable[[str], bool] = lambda device: True


def _backward(inputs: Inputs, logprobs: torch.Tensor, entropy: torch.Tensor | None) -> None:
    """Backpropagate the random upstream gradients through log-probs (and entropy)."""
    objective = (logprobs * inputs.grad_logprobs).sum()
    if entropy is not None:
        objective = objective + (entropy * inputs.grad_entropy).sum()
    objective.backward()


def _build_naive(work: Workload, inputs: Inputs) -> Step:
    """Full-logits reference: ``logitless.reference.linear_logprobs`` + backward."""
    from logitless.reference import linear_logprobs

    def step() -> None:
        out = linear_logprobs(inputs.hidden, inputs.weight, inputs.labels, with_entropy=True)
        _backward(inputs, out.logprobs, out.entropy)

    return step


def _build_logitless(
    backend: str, capture: str = "off", invariant: bool = False
) -> Callable[[Workload, Inputs], Step]:
    """The fused op: ``logitless.linear_logprobs(..., backend=backend)`` + backward;
    ``capture``: ``"off"`` (the default mode), ``"all"`` (``capturable=True``: every row) or
    ``"capacity"`` (``capturable=True, row_capacity=`` the workload's valid rows);
    ``invariant``: ``batch_invariant=True``."""

    def build(work: Workload, inputs: Inputs) -> Step:
        from logitless import linear_logprobs

        mode = {} if capture == "off" else {"capturable": True}
        if capture == "capacity":
            mode["row_capacity"] = work.valid_rows
        if invariant:
            mode["batch_invariant"] = True

        def step() -> None:
            out = linear_logprobs(
                inputs.hidden,
                inputs.weight,
                inputs.labels,
                with_entropy=True,
                backend=backend,
                **mode,
            )
            _backward(inputs, out.logprobs, out.entropy)

        return step

    return build


def _resolved_backend(work: Workload) -> str:
    """The backend ``backend="auto"`` runs for this workload."""
    from logitless.contract.backend import resolve_backend

    return resolve_backend("auto", torch.device(work.device), DTYPES[work.dtype])


def _same_as_auto(work: Workload) -> str | None:
    """The explicit torch-tiles method is only worth a row where ``auto`` picks Triton."""
    if _resolved_backend(work) == "torch":
        return "backend='auto' already runs the torch tiles here (see the logitless row)"
    return None


def _backend_note(work: Workload) -> str:
    return f"backend=auto -> {_resolved_backend(work)}"


def _build_floor(num_matmuls: int) -> Callable[[Workload, Inputs], Step]:
    """Bare matmuls of the head's sizes over the valid rows: the time floor, no softmax.

    3 = forward ``h @ W.T``, ``dz @ W`` (dh) and ``dz.T @ h`` (dW) -- the naive / fused-loss
    schedule; 4 adds the recomputed forward of logitless's backward.
    """

    def build(work: Workload, inputs: Inputs) -> Step:
        h = inputs.hidden.detach().index_select(0, inputs.valid_idx)  # [M, H]
        w = inputs.weight.detach()  # [V, H]
        # Outputs are allocated once, outside the timed step: the floor is matmul time alone,
        # not page faults of fresh [M, V] buffers.
        z = h.new_empty(h.shape[0], w.shape[0])  # [M, V]
        dh = torch.empty_like(h)  # [M, H]
        dw = torch.empty_like(w)  # [V, H]

        def step() -> None:
            with torch.no_grad():
                for _ in range(num_matmuls - 2):  # forward (and the recompute, for 4)
                    torch.mm(h, w.T, out=z)
                torch.mm(z, w, out=dh)
                torch.mm(z.T, h, out=dw)

        return step

    return build


def _missing(module: str, package: str) -> str | None:
    """Reason string if ``module`` is not importable."""
    if importlib.util.find_spec(module) is None:
        return f"{package} is not installed (pip install -e '.[peers]' in a logitless checkout)"
    return None


def _liger_unavailable(work: Workload) -> str | None:
    """Liger-Kernel is Triton-only: it needs an accelerator."""
    missing = _missing("liger_kernel", "liger-kernel")
    if missing:
        return missing
    if not work.device.startswith("cuda"):
        return f"Liger-Kernel runs Triton kernels, which need a GPU (device is {work.device})"
    return None


def _build_liger(work: Workload, inputs: Inputs) -> Step:
    """Liger's fused linear cross-entropy, ``reduction="none"``, negated: log-probs only."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    def step() -> None:
        loss = liger_fused_linear_cross_entropy(
            inputs.hidden,
            inputs.weight,
            inputs.labels,
            ignore_index=IGNORE_INDEX,
            reduction="none",
        )
        _backward(inputs, -loss.float(), None)

    return step


def _cce_impl(work: Workload) -> str:
    """CCE's Triton kernel on GPU; its ``torch_compile`` implementation elsewhere."""
    return "cce" if work.device.startswith("cuda") else "torch_compile"


def _cce_unavailable(work: Workload) -> str | None:
    """CCE must be importable (it imports Triton on Linux); its GPU kernel's backward takes
    bf16 / fp16 embeddings only (an fp32 run fails inside CCE with an AssertionError)."""
    missing = _missing("cut_cross_entropy", "cut-cross-entropy")
    if missing:
        return missing
    if _cce_impl(work) == "cce" and work.dtype == "float32":
        return "CCE's GPU kernel has no float32 backward (use --dtype bfloat16)"
    return None


def _cce_note(work: Workload) -> str:
    """Caveats of the CCE numbers."""
    note = "log-probs only (no entropy)"
    if _cce_impl(work) == "torch_compile":
        note += "; impl=torch_compile, which materializes logits (CCE kernel is GPU-only)"
    return note


def _build_cce(work: Workload, inputs: Inputs) -> Step:
    """Cut Cross-Entropy ``linear_cross_entropy(reduction="none")`` negated: log-probs only."""
    from cut_cross_entropy import linear_cross_entropy

    impl = _cce_impl(work)

    def step() -> None:
        loss = linear_cross_entropy(
            inputs.hidden,
            inputs.weight,
            inputs.labels,
            ignore_index=IGNORE_INDEX,
            reduction="none",
            impl=impl,
        )
        _backward(inputs, -loss.float(), None)

    return step


def _torch_lce_unavailable(work: Workload) -> str | None:
    """PyTorch's chunked ``F.linear_cross_entropy`` ships with newer torch releases only."""
    import torch.nn.functional as F

    if not hasattr(F, "linear_cross_entropy") or not hasattr(torch.nn, "LinearCrossEntropyOptions"):
        return f"torch {torch.__version__} has no F.linear_cross_entropy"
    return None


def _build_torch_lce(work: Workload, inputs: Inputs) -> Step:
    """``F.linear_cross_entropy(reduction="none", options=LinearCrossEntropyOptions())``, the
    chunked path with its defaults, negated: log-probs only."""
    import torch.nn.functional as F

    options = torch.nn.LinearCrossEntropyOptions()

    def step() -> None:
        loss = F.linear_cross_entropy(
            inputs.hidden,
            inputs.weight,
            inputs.labels,
            reduction="none",
            ignore_index=IGNORE_INDEX,
            options=options,
        )
        _backward(inputs, -loss.float(), None)

    return step


def _trl_unavailable(work: Workload) -> str | None:
    """TRL's chunked LM head ships with TRL itself."""
    if importlib.util.find_spec("trl") is None:
        return "trl is not installed (pip install -e '.[trl]' in a logitless checkout)"
    return None


def _trl_note(work: Workload) -> str:
    how = "valid rows (Triton)" if work.device.startswith("cuda") else "all rows (torch tiles)"
    return f"TRL's ChunkedLogProbFunction as GRPOTrainer calls it: {how}"


def _build_trl(work: Workload, inputs: Inputs) -> Step:
    """TRL's own chunked head (``trl.kernels.ChunkedLogProbFunction``) with log-probs and entropy,
    called as ``GRPOTrainer``'s fused LM head calls it: on CUDA the valid rows only, elsewhere
    every row with clamped labels, masked afterwards (TRL keeps tile shapes fixed off Triton)."""
    from trl.kernels import ChunkedLogProbFunction

    try:  # the vocabulary tile GRPOTrainer uses
        from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE as chunk
    except ImportError:  # pragma: no cover - another TRL layout
        chunk = 32768
    compact = work.device.startswith("cuda")
    mask = inputs.labels != IGNORE_INDEX

    def step() -> None:
        if compact:
            h, y = inputs.hidden[mask], inputs.labels[mask]
        else:
            h, y = inputs.hidden, inputs.labels.clamp(min=0)
        out = ChunkedLogProbFunction.apply(
            h, inputs.weight, None, y, 1.0, chunk, None, 1.0, ("log_probs", "entropy")
        )
        logp, ent = out[0], out[1]
        if compact:
            logp = logp.new_zeros(mask.shape).masked_scatter(mask, logp)
            ent = ent.new_zeros(mask.shape).masked_scatter(mask, ent)
        else:
            logp, ent = logp.masked_fill(~mask, 0.0), ent.masked_fill(~mask, 0.0)
        _backward(inputs, logp, ent)

    return step


# ---- task "loss": LM head + DAPO / GSPO policy loss, forward + backward ---------------------

_SEQ_LEN = 256  # tokens per sequence of the loss workload (one sequence if tokens % 256 != 0)


def _dapo_config():
    from logitless import PolicyLossConfig

    return PolicyLossConfig(clip_low=0.2, clip_high=0.28, aggregation="token_mean")


def _gspo_config():
    from logitless import PolicyLossConfig

    return PolicyLossConfig(
        ratio_level="sequence", clip_low=3e-4, clip_high=4e-4, aggregation="seq_mean_token_mean"
    )


@dataclass(frozen=True)
class _RLBatch:
    """The RL side of the loss workload: sequences of ``seq_len`` tokens, one advantage each.

    old_logprobs: [N] the current policy's log-probs plus small noise (a realistic ratio
    spread, so clipping happens); advantages: [B]; document_ids: [N]; mask: [N] bool.
    """

    seq_len: int
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    document_ids: torch.Tensor
    mask: torch.Tensor


def _rl_batch(work: Workload, inputs: Inputs) -> _RLBatch:
    from logitless import linear_logprobs

    n = work.tokens
    seq_len = _SEQ_LEN if n % _SEQ_LEN == 0 else n
    gen = torch.Generator().manual_seed(work.seed + 1)
    mask = inputs.labels != IGNORE_INDEX
    with torch.no_grad():  # setup, not timed
        lp = linear_logprobs(inputs.hidden, inputs.weight, inputs.labels).logprobs
    noise = 0.05 * torch.randn(n, generator=gen).to(lp.device)
    return _RLBatch(
        seq_len=seq_len,
        old_logprobs=torch.where(mask, lp + noise, 0.0),
        advantages=torch.randn(n // seq_len, generator=gen).to(lp.device),
        document_ids=torch.arange(n, device=lp.device) // seq_len,
        mask=mask,
    )


def _build_loss_composed(head: str) -> Callable[[Workload, Inputs], Step]:
    """``policy_loss(<head>.linear_logprobs(...))`` + backward, DAPO config."""

    def build(work: Workload, inputs: Inputs) -> Step:
        import logitless

        linear_logprobs = (
            logitless.reference.linear_logprobs if head == "naive" else logitless.linear_logprobs
        )
        rl, cfg = _rl_batch(work, inputs), _dapo_config()

        def step() -> None:
            lp = linear_logprobs(inputs.hidden, inputs.weight, inputs.labels).logprobs
            loss, _ = logitless.policy_loss(
                lp,
                rl.old_logprobs,
                rl.advantages,
                rl.mask,
                config=cfg,
                document_ids=rl.document_ids,
            )
            loss.backward()

        return step

    return build


def _build_loss_fused(
    config: Callable, backend: str = "auto", invariant: bool = False
) -> Callable[[Workload, Inputs], Step]:
    """``logitless.fused_policy_loss(..., backend=backend, batch_invariant=invariant)`` +
    backward."""

    def build(work: Workload, inputs: Inputs) -> Step:
        from logitless import fused_policy_loss

        rl, cfg = _rl_batch(work, inputs), config()

        def step() -> None:
            loss, _ = fused_policy_loss(
                inputs.hidden,
                inputs.weight,
                inputs.labels,
                rl.old_logprobs,
                rl.advantages,
                config=cfg,
                document_ids=rl.document_ids,
                backend=backend,
                batch_invariant=invariant,
            )
            loss.backward()

        return step

    return build


def _fused_note(name: str, work: Workload, backend: str = "auto") -> str:
    """How many head matmuls the fused loss runs on this workload's backend."""
    resolved = _resolved_backend(work) if backend == "auto" else backend
    if resolved == "triton":
        how = "statistics pass, loss gradient, gradient pass: 4 matmuls"
    elif name == "GSPO":
        how = "no-grad pass + gradient pass"
    else:
        how = "3 matmuls"
    return f"fused_policy_loss ({name}), {resolved}: {how}"


def _liger_loss_unavailable(work: Workload) -> str | None:
    return _missing("liger_kernel", "liger-kernel")


def _build_liger_grpo(work: Workload, inputs: Inputs) -> Step:
    """Liger's ``LigerFusedLinearGRPOLoss(loss_type="dapo")``: the same DAPO loss, [B, T] form."""
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    rl = _rl_batch(work, inputs)
    b, t = work.tokens // rl.seq_len, rl.seq_len
    loss_fn = LigerFusedLinearGRPOLoss(
        beta=0.0, use_ref_model=False, loss_type="dapo", epsilon_low=0.2, epsilon_high=0.28
    )
    hidden = inputs.hidden.view(b, t, -1)
    ids = inputs.labels.clamp(min=0).view(b, t)
    mask = rl.mask.view(b, t).to(hidden.dtype)
    old = rl.old_logprobs.view(b, t)

    def step() -> None:
        out = loss_fn(hidden, inputs.weight, ids, mask, rl.advantages, old_per_token_logps=old)
        (out[0] if isinstance(out, tuple) else out).backward()

    return step


# ---- task "replay": sampling replay (docs/sampling-replay.md) vs the full-vocabulary op ----

_MASK_KEPT = 64  # kept ids per row of the sampling_mask workload (a top-64 sampler)


def _replay_mask(work: Workload, inputs: Inputs):
    """A SamplingMask of ``_MASK_KEPT`` distinct ids per valid row, the label among them, the
    others uniformly random (no locality: the worst case for the gathers)."""
    from logitless import SamplingMask

    gen = torch.Generator().manual_seed(work.seed + 2)
    n, v = work.tokens, work.vocab
    kept = min(_MASK_KEPT, v)
    ids = torch.rand(n, v, generator=gen).topk(kept, dim=1).indices  # distinct per row
    labels = inputs.labels.cpu()
    valid = labels != IGNORE_INDEX
    has = (ids == labels[:, None]).any(1)
    ids[valid & ~has, 0] = labels[valid & ~has]  # the sampled token is always kept
    ids[~valid] = -1
    return SamplingMask.from_padded(ids.to(inputs.labels.device))


def _build_replay(kind: str) -> Callable[[Workload, Inputs], Step]:
    """``linear_logprobs`` with a sampling mask (``kind="mask"``) or with ``top_k=512,
    top_p=0.95`` replay (``kind="topk"``), entropy included, + backward."""

    def build(work: Workload, inputs: Inputs) -> Step:
        from logitless import linear_logprobs

        if kind == "mask":
            replay = {"sampling_mask": _replay_mask(work, inputs)}
        else:
            replay = {"top_k": 512, "top_p": 0.95}

        def step() -> None:
            out = linear_logprobs(
                inputs.hidden, inputs.weight, inputs.labels, with_entropy=True, **replay
            )
            _backward(inputs, out.logprobs, out.entropy)

        return step

    return build


# ---- task "distill": the divergence to a teacher head, forward + backward --------------------

_DISTILL_BETA = 0.0  # TRL's forward KL(teacher || student): one pass over both heads' tiles


def _teacher(work: Workload, inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """A frozen teacher of the workload's sizes (seeded apart from the student):
    hidden ``[N, H]`` and head ``[V, H]``, no grad."""
    gen = torch.Generator().manual_seed(work.seed + 1)
    n, h, v = work.tokens, work.hidden, work.vocab
    dtype, device = DTYPES[work.dtype], torch.device(work.device)
    t_hidden = torch.randn(n, h, generator=gen).to(device, dtype)
    t_weight = (torch.randn(v, h, generator=gen) * 0.02).to(device, dtype)
    return t_hidden, t_weight


def _build_distill(kind: str) -> Callable[[Workload, Inputs], Step]:
    """``kind``: ``"naive"`` (``logitless.reference.linear_divergence``: both heads' full
    logits) or ``"logitless"`` (``linear_divergence``); the divergence's upstream gradient
    is the workload's random per-token one."""

    def build(work: Workload, inputs: Inputs) -> Step:
        if kind == "naive":
            from logitless.reference import linear_divergence
        else:
            from logitless import linear_divergence
        t_hidden, t_weight = _teacher(work, inputs)

        def step() -> None:
            out = linear_divergence(
                inputs.hidden, inputs.weight, inputs.labels, t_hidden, t_weight,
                beta=_DISTILL_BETA,
            )  # fmt: skip
            (out.divergence * inputs.grad_logprobs).sum().backward()

        return step

    return build


def _build_distill_floor(work: Workload, inputs: Inputs) -> Step:
    """Six bare matmuls over the valid rows: both heads' statistics, both recomputed in
    backward, dh and dW (the KL schedule's floor; no softmax)."""
    h = inputs.hidden.detach().index_select(0, inputs.valid_idx)  # [M, H]
    t_hidden, t_weight = _teacher(work, inputs)
    t_h = t_hidden.index_select(0, inputs.valid_idx)
    w = inputs.weight.detach()
    z = h.new_empty(h.shape[0], w.shape[0])  # [M, V], allocated outside the timed step
    dh, dw = torch.empty_like(h), torch.empty_like(w)

    def step() -> None:
        with torch.no_grad():
            for _ in range(2):  # statistics, then the recompute of backward
                torch.mm(h, w.T, out=z)
                torch.mm(t_h, t_weight.T, out=z)
            torch.mm(z, w, out=dh)
            torch.mm(z.T, h, out=dw)

    return step


def _trl_distill_unavailable(work: Workload) -> str | None:
    """TRL >= 1.16 ships its chunked divergence (``trl.kernels.chunked_divergence``)."""
    if importlib.util.find_spec("trl") is None:
        return "trl is not installed (pip install -e '.[trl]' in a logitless checkout)"
    try:
        from trl.kernels.chunked_divergence import ChunkedDivergenceFunction  # noqa: F401
    except ImportError:
        return "this TRL has no trl.kernels.chunked_divergence (TRL >= 1.16)"
    return None


def _build_trl_distill(work: Workload, inputs: Inputs) -> Step:
    """TRL's ``ChunkedDivergenceFunction`` as ``DistillationTrainer``'s
    ``_chunked_divergence_loss`` calls it: the valid rows on CUDA (Triton), every row
    elsewhere, masked afterwards."""
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

    t_hidden, t_weight = _teacher(work, inputs)
    compact = work.device.startswith("cuda")
    mask = inputs.labels != IGNORE_INDEX

    def step() -> None:
        h, t_h = (inputs.hidden[mask], t_hidden[mask]) if compact else (inputs.hidden, t_hidden)
        div, _ = ChunkedDivergenceFunction.apply(
            h, inputs.weight, None, t_h, t_weight, None, _DISTILL_BETA, 1.0, 1.0, None, 1.0, None
        )
        if compact:
            div = div.new_zeros(mask.shape).masked_scatter(mask, div)
        else:
            div = div.masked_fill(~mask, 0.0)
        (div * inputs.grad_logprobs).sum().backward()

    return step


def _by_name(*methods: Method) -> dict[str, Method]:
    return {m.name: m for m in methods}


# Methods several tasks run as they are.
_NAIVE = Method("naive", "baseline", _build_naive)
_FLOOR4 = Method("floor4", "floor", _build_floor(4), note=lambda w: "4 bare matmuls")
_FUSED_DAPO = Method(
    "fused", "op", _build_loss_fused(_dapo_config), note=lambda w: _fused_note("DAPO", w)
)

TASKS: dict[str, dict[str, Method]] = {
    "logprobs": _by_name(
        _NAIVE,
        Method("logitless", "op", _build_logitless("auto"), note=_backend_note),
        Method(
            "logitless_torch",
            "op",
            _build_logitless("torch"),
            unavailable=_same_as_auto,
            note=lambda w: "backend=torch (the tiles)",
        ),
        Method("floor3", "floor", _build_floor(3), note=lambda w: "3 bare matmuls"),
        _FLOOR4,
        Method(
            "liger",
            "peer",
            _build_liger,
            unavailable=_liger_unavailable,
            note=lambda w: "log-probs only (no entropy)",
        ),
        Method("cce", "peer", _build_cce, unavailable=_cce_unavailable, note=_cce_note),
        Method("trl", "peer", _build_trl, unavailable=_trl_unavailable, note=_trl_note),
        Method(
            "torch_lce",
            "peer",
            _build_torch_lce,
            unavailable=_torch_lce_unavailable,
            note=lambda w: "F.linear_cross_entropy, chunked options; log-probs only",
            # 11x naive's time on a 2-core CPU (docs/benchmarks.md): named to run there
            by_default=lambda device: not device.startswith("cpu"),
        ),
    ),
    "loss": _by_name(
        Method(
            "naive",
            "baseline",
            _build_loss_composed("naive"),
            note=lambda w: "full logits + policy_loss (DAPO)",
        ),
        Method(
            "composed",
            "op",
            _build_loss_composed("logitless"),
            note=lambda w: "linear_logprobs + policy_loss (DAPO): 4 matmuls",
        ),
        _FUSED_DAPO,
        Method(
            "fused_torch",
            "op",
            _build_loss_fused(_dapo_config, "torch"),
            unavailable=_same_as_auto,
            note=lambda w: _fused_note("DAPO", w, "torch"),
        ),
        Method(
            "fused_gspo",
            "op",
            _build_loss_fused(_gspo_config),
            note=lambda w: _fused_note("GSPO", w),
        ),
        Method("floor3", "floor", _build_floor(3), note=lambda w: "3 bare matmuls"),
        _FLOOR4,
        Method(
            "liger",
            "peer",
            _build_liger_grpo,
            unavailable=_liger_loss_unavailable,
            note=lambda w: "LigerFusedLinearGRPOLoss(loss_type='dapo'); all rows computed",
        ),
    ),
    "capturable": _by_name(
        _NAIVE,
        Method(
            "logitless",
            "op",
            _build_logitless("auto"),
            note=lambda w: "the default mode: the valid rows, their count read on the host",
        ),
        Method(
            "capturable",
            "op",
            _build_logitless("auto", "all"),
            note=lambda w: "capturable=True: every row projected, the ignored ones masked",
        ),
        Method(
            "capacity",
            "op",
            _build_logitless("auto", "capacity"),
            note=lambda w: f"capturable=True, row_capacity={w.valid_rows} (the valid rows)",
        ),
        _FLOOR4,
    ),
    "distill": _by_name(
        Method(
            "naive",
            "baseline",
            _build_distill("naive"),
            note=lambda w: "full logits of both heads, forward KL",
        ),
        Method(
            "logitless",
            "op",
            _build_distill("logitless"),
            note=lambda w: "linear_divergence(beta=0): 6 matmuls",
        ),
        Method(
            "floor6",
            "floor",
            _build_distill_floor,
            note=lambda w: "6 bare matmuls: both heads, recomputed, dh, dW",
        ),
        Method(
            "trl",
            "peer",
            _build_trl_distill,
            unavailable=_trl_distill_unavailable,
            note=lambda w: "TRL 1.16 ChunkedDivergenceFunction (DistillationTrainer)",
        ),
    ),
    "replay": _by_name(
        Method(
            "logitless",
            "op",
            _build_logitless("auto"),
            note=lambda w: "full vocabulary, the reference point of the replay rows",
        ),
        Method(
            "replay_mask",
            "op",
            _build_replay("mask"),
            note=lambda w: f"sampling_mask, {_MASK_KEPT} random kept ids per row",
        ),
        Method(
            "replay_topk",
            "op",
            _build_replay("topk"),
            note=lambda w: "top_k=512, top_p=0.95 replayed (streaming top-k)",
        ),
        _FLOOR4,
    ),
    # what the mode buys is printed under the table: invariance.ratio_report
    "invariance": _by_name(
        _NAIVE,
        Method(
            "logitless",
            "op",
            _build_logitless("auto"),
            note=lambda w: "linear_logprobs, the default mode",
        ),
        Method(
            "invariant",
            "op",
            _build_logitless("auto", invariant=True),
            note=lambda w: "linear_logprobs(batch_invariant=True)",
        ),
        _FUSED_DAPO,
        Method(
            "fused_invariant",
            "op",
            _build_loss_fused(_dapo_config, invariant=True),
            note=lambda w: "fused_policy_loss(batch_invariant=True), DAPO",
        ),
        _FLOOR4,
    ),
}


# What each task measures, for ``logitless bench --help`` (one line each, every task).
TASK_SUMMARY: dict[str, str] = {
    "logprobs": "log-probs + entropy",
    "loss": "the fused policy loss (DAPO, GSPO) against the composed and naive losses",
    "capturable": "the capturable mode against the default mode",
    "distill": "the divergence to a teacher head (forward KL)",
    "replay": "sampling replay (a kept-id mask, top-k / top-p) against the full vocabulary",
    "invariance": "batch_invariant=True against the default mode; the trainer pattern's ratios",
}


def get_method(task: str, name: str) -> Method:
    """Look up a method; ``KeyError`` with the valid names if it does not exist."""
    methods = TASKS[task]
    if name not in methods:
        raise KeyError(f"unknown method {name!r} for task {task!r}; choose from {list(methods)}")
    return methods[name]
