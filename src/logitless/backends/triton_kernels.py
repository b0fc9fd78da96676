"""The Triton backend: log-probs and entropy with the logits kept in registers.

Forward (:func:`forward_rows`). One kernel, ``_stats_kernel``, tiles ``[M, V]`` into
``[BLOCK_M, BLOCK_N]`` blocks of ``h·Wᵀ`` (``tl.dot``, fp32 accumulation). Each program owns
one row block and one *vocabulary split* (a run of consecutive vocab blocks); the epilogue
applies the logit transform (bias, logit scale, softcap, temperature: the Triton twin of
:class:`logitless.transform.LogitTransform`) to the fp32 tile in registers, masks the
vocabulary tail and folds the tile into the row's online statistics

    m = max z        s = Σ exp(z - m)        q = Σ exp(z - m)·(z - m)        z_y (label logit)

which it writes once per (split, row): ``[4, splits, M]`` fp32, a few MB. The splits are merged
in torch (:func:`_merge_splits`, the same algebra as the vocab-parallel combine), giving
``lse = m + log s``, ``H = log s - q / s`` and ``logp = z_y - lse``. No logit is ever written.

Backward (:func:`backward_rows`). The vocabulary is cut into chunks of ``vc`` columns sized so
that a ``[rows, vc]`` workspace in the compute dtype stays within ``_WORKSPACE_BYTES``. For each
chunk ``_dz_kernel`` recomputes the tile and writes, in registers,

    dz = -p ⊙ (g + e·(log p + H)) + g·onehot(y)      then · (s/T) and · softcap'(x)

into the workspace (the label term is a compare, never a one-hot); then cuBLAS writes that
chunk's ``dW`` rows once (``dzᵀ·h``) and adds ``dz·W_chunk`` into an fp32 hidden gradient, so
16-bit inputs never see a 16-bit partial sum. With ``chunk_size`` the rows are also cut into
passes; ``dW`` then accumulates in fp32, as the torch tiles do.

The gradient-in-forward path of the fused loss (:func:`fused_rows`) is the same two kernels:
the statistics, then the loss gradient of every row at once, then the backward pass.

The tile code both kernels share with the divergence's is :mod:`.triton_tiles`; the
configuration tables, the launcher and the head gradients are :mod:`.triton_launch` (with what
the interpreter changes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .base import (
    GradFn,
    HeadGrads,
    KernelOptions,
    Needs,
    ProbeStats,
    RowBatch,
    RowStats,
    Upstream,
    extend_rows,
    finish_probed,
    finish_stats,
    padded_backward,
)
from .triton_launch import KernelHead, head_grads, launch, register, row_passes, vocab_splits
from .triton_tiles import (
    chunk_program,
    logits_tile,
    online_step,
    row_factor,
    row_inv_temperature,
    split_program,
    store_dz,
    store_row_stats,
)

# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})
@triton.jit
def _stats_kernel(
    h_ptr, w_ptr, b_ptr, y_ptr, t_ptr, stats_ptr, p_ptr, zp_ptr,
    M, V, K, stride_h, stride_w, num_splits, inv_temp, scale, softcap,
    HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    TEMP_MODE: tl.constexpr, WITH_ENTROPY: tl.constexpr, PROBE_K: tl.constexpr,
    HEAD_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """Online (m, s, q, z_y) of one row block over one vocabulary split -> stats[:, split, rows].

    stats: [4, num_splits, M] fp32. A split with no vocab block (possible when the blocks do not
    divide evenly) writes m = -inf, s = q = z_y = 0, which :func:`_merge_splits` ignores.

    PROBE_K > 0 (the rollout engine's top-k, :func:`_probe_tile`): p ``[M, PROBE_K]`` int32
    ids per row, ascending (``_NO_ID`` in unused slots); the kernel also writes each id's logit
    into zp ``[M, PROBE_K]`` (fp32, at the id's slot: one program holds its column) and a fifth
    plane of stats, Σ exp(z - m) over the columns that are not ids.
    """
    pid_s, offs_m, row_ok, rows, first, last = split_program(
        M, V, num_splits, BLOCK_M, BLOCK_N, GROUP_M
    )
    y = tl.load(y_ptr + rows)
    inv_t = row_inv_temperature(t_ptr, rows, inv_temp, TEMP_MODE)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    s_i = tl.zeros((BLOCK_M,), tl.float32)
    q_i = tl.zeros((BLOCK_M,), tl.float32)
    zy = tl.zeros((BLOCK_M,), tl.float32)
    so_i = tl.zeros((BLOCK_M,), tl.float32)
    p_rows = p_ptr + rows.to(tl.int64) * PROBE_K
    for nb in range(first, last):
        offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = offs_n < V
        z, _ = logits_tile(
            h_ptr, w_ptr, b_ptr, rows, offs_n % V, inv_t, K, stride_h, stride_w, scale, softcap,
            HAS_BIAS, HAS_SCALE, HAS_SOFTCAP, TEMP_MODE, HEAD_DTYPE, DOT_DTYPE, IEEE, EVEN_K,
            BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip
        z = tl.where(col_ok[None, :], z, -1.0e30)  # the tail: exp() = 0, no inf arithmetic
        # (a shard-local label of another rank's shard may equal a tail column: mask it)
        is_label = (offs_n[None, :] == y[:, None]) & col_ok[None, :]
        zy += tl.sum(tl.where(is_label, z, 0.0), axis=1)
        m_new, shift, d, e, alpha = online_step(m_i, z)  # d = z - m_new <= 0
        if WITH_ENTROPY:
            ed = tl.where(e > 0.0, e * d, 0.0)  # 0·(-inf) would be NaN for a -inf logit
            q_i = alpha * (q_i + shift * s_i) + tl.sum(ed, axis=1)
        s_i = alpha * s_i + tl.sum(e, axis=1)
        m_i = m_new
        if PROBE_K > 0:
            e = _probe_tile(p_rows, zp_ptr, rows, row_ok, offs_n, nb * BLOCK_N, z, e, PROBE_K,
                            BLOCK_M, BLOCK_N)  # fmt: skip
            so_i = alpha * so_i + tl.sum(e, axis=1)

    out, plane = store_row_stats(stats_ptr, pid_s, M, offs_m, num_splits, row_ok, m_i, s_i, q_i, zy)
    if PROBE_K > 0:
        tl.store(out + 4 * plane, so_i, mask=row_ok)


@triton.jit
def _probe_tile(
    p_rows, zp_ptr, rows, row_ok, offs_n, n0, z, e, PROBE_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """The probed ids of one ``[BLOCK_M, BLOCK_N]`` tile of columns ``[n0, n0 + BLOCK_N)``:
    stores each id's logit ``z`` at its slot of ``zp`` and returns ``e`` (``exp(z - m)``) with
    the ids' columns set to 0.

    A row's ids are ascending, so those inside the tile are the slots ``[lo, hi)``, counted
    slot by slot (``[BLOCK_M]`` vectors: no ``[BLOCK_M, PROBE_K]`` tile held beside the
    logits). The loop then runs over the longest such run in the row block (usually 0 or 1:
    ``k`` ids in ``V / BLOCK_N`` tiles), one compare of the tile against one id per row per
    step, not ``k``.
    """
    lo = tl.zeros((BLOCK_M,), tl.int32)
    hi = tl.zeros((BLOCK_M,), tl.int32)
    for j in range(PROBE_K):
        v = tl.load(p_rows + j)
        lo += (v < n0).to(tl.int32)
        hi += (v < n0 + BLOCK_N).to(tl.int32)
    for t in range(0, tl.max(hi - lo, axis=0)):
        slot = lo + t
        has = slot < hi
        cand = tl.load(p_rows + slot, mask=has, other=-1)  # -1 matches no column
        hit = offs_n[None, :] == cand[:, None]
        tl.store(zp_ptr + rows.to(tl.int64) * PROBE_K + slot,
                 tl.sum(tl.where(hit, z, 0.0), axis=1), mask=has & row_ok)  # fmt: skip
        e = tl.where(hit, 0.0, e)
    return e


@triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})
@triton.jit
def _dz_kernel(
    h_ptr, w_ptr, b_ptr, y_ptr, t_ptr, lse_ptr, ent_ptr, g_ptr, e_ptr, dz_ptr,
    M, V, K, stride_h, stride_w, v_start, width, inv_temp, scale, softcap,
    HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    TEMP_MODE: tl.constexpr, HAS_G: tl.constexpr, HAS_E: tl.constexpr,
    HEAD_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """d loss / d raw logits of rows [0, M) and columns [v_start, v_start + width) -> dz.

    dz: [M, width] contiguous, in the compute dtype; lse, ent, g, e: [M] fp32.
    """
    offs_m, offs_c, row_ok, col_ok, rows = chunk_program(M, width, BLOCK_M, BLOCK_N, GROUP_M)
    offs_n = v_start + offs_c  # offs_c: the column inside the chunk
    inv_t = row_inv_temperature(t_ptr, rows, inv_temp, TEMP_MODE)
    z, th = logits_tile(
        h_ptr, w_ptr, b_ptr, rows, offs_n % V, inv_t, K, stride_h, stride_w, scale, softcap,
        HAS_BIAS, HAS_SCALE, HAS_SOFTCAP, TEMP_MODE, HEAD_DTYPE, DOT_DTYPE, IEEE, EVEN_K,
        BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    logp = z - tl.load(lse_ptr + rows)[:, None]
    p = tl.exp(logp)
    factor = row_factor(inv_t, scale, HAS_SCALE)  # dz/dx's per-row part: s / T
    if HAS_G:
        g_t = tl.load(g_ptr + rows) * factor  # g · s / T
    else:
        g_t = tl.zeros((BLOCK_M,), tl.float32)
    if HAS_E:
        e_t = tl.load(e_ptr + rows) * factor  # e · s / T
        ent = tl.load(ent_ptr + rows)
        dz = -p * (g_t[:, None] + e_t[:, None] * (logp + ent[:, None]))
    else:
        dz = -p * g_t[:, None]
    y = tl.load(y_ptr + rows)
    dz = tl.where(offs_n[None, :] == y[:, None], dz + g_t[:, None], dz)
    if HAS_SOFTCAP:
        dz = dz * (1.0 - th * th)
    store_dz(dz_ptr, dz, offs_m, offs_c, row_ok, col_ok, width)


# PROBE_K shares the tuned configuration: a probed call's statistics are the same bits as an
# unprobed one's (the rollout-mismatch diagnostics change no log-prob)
register("stats", _stats_kernel, ("h_ptr", "w_ptr"), ("IEEE",), ["K"], shared=("PROBE_K",))
register("dz", _dz_kernel, ("h_ptr", "w_ptr"), ("IEEE",), ["K"])


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------


def _merge_splits(stats: torch.Tensor) -> list[torch.Tensor]:
    """stats [4 or 5, splits, R] -> per-row (m, s, q, z_y[, s_out]) [R] over all splits (empty
    splits have s = 0 and drop out; s_out, the probe's plane, rescales like s)."""
    m, s, q, zy, *probed = stats.unbind(0)
    m_all = m.amax(0)
    shift = m - m_all[None]  # <= 0; -inf for an empty split
    alpha = shift.exp()
    s_all = (alpha * s).sum(0)
    q_all = torch.where(s > 0, alpha * (q + shift * s), 0.0).sum(0)
    return [m_all, s_all, q_all, zy.sum(0), *((alpha * p).sum(0) for p in probed)]


# The id of an unused probe slot: above every column, so it sorts last and is never in a tile.
_NO_ID = 2**31 - 1


class _Probe:
    """Probed ids ``[M, K]`` (shard-local, -1 unused) as the statistics kernel takes them: each
    row's ids ascending in ``PROBE_K`` (a power of two) int32 slots, and the order back."""

    def __init__(self, ids: torch.Tensor) -> None:
        k = ids.shape[1]
        self.k, self.width = k, triton.next_power_of_2(max(k, 2))
        padded = torch.full(
            (ids.shape[0], self.width), _NO_ID, dtype=torch.int64, device=ids.device
        )
        padded[:, :k] = torch.where(ids >= 0, ids, _NO_ID)
        self.ids, self.order = padded.sort(1)
        self.ids = self.ids.to(torch.int32).contiguous()

    def found(self, zp: torch.Tensor, r0: int) -> torch.Tensor:
        """``[R, K]`` logits of rows ``r0...`` at their ids in the given order, from the
        kernel's sorted slots ``zp`` ``[R, PROBE_K]``."""
        order = self.order[r0 : r0 + zp.shape[0]]
        return torch.zeros_like(zp).scatter_(1, order, zp)[:, : self.k]


def _stats_pass(call: KernelHead, r0: int, r1: int, opts: KernelOptions, probe: _Probe | None):
    """logp, lse, entropy (or None) of rows [r0, r1) (and their probe stats, or None): one
    kernel launch and the merge."""
    rows, vocab, dev = r1 - r0, call.weight.shape[0], call.hidden.device
    splits = vocab_splits(rows, vocab, dev)
    stats = torch.empty(4 if probe is None else 5, splits, rows, device=dev)
    if probe is None:  # placeholders, never read, of the probe's dtypes: Triton's autotuner
        # keys on the pointers' dtypes, and both launches share the tuned configuration
        p_args, width = (torch.empty(1, dtype=torch.int32, device=dev), stats), 0
    else:
        zp = torch.zeros(rows, probe.width, device=dev)
        p_args, width = (probe.ids[r0:r1], zp), probe.width
    launch(
        "stats",
        rows * vocab,
        lambda meta: triton.cdiv(rows, meta["BLOCK_M"]) * splits,
        *call.tensors(r0, r1), stats, *p_args, rows, *call.sizes(), splits, *call.scalars(),
        pinned=call.pinned, WITH_ENTROPY=opts.with_entropy, PROBE_K=width, **call.meta,
    )  # fmt: skip
    m, s, q, zy, *s_out = _merge_splits(stats)
    q = q if opts.with_entropy else None
    if probe is None:
        return (*finish_stats(m, s, q, zy, opts.vocab_parallel), None)
    z = probe.found(zp, r0)
    return finish_probed(m, s, q, zy, s_out[0], z, opts.vocab_parallel)


def forward_rows(
    rows: RowBatch,
    opts: KernelOptions,
    keep_tile: bool = False,
    probe: torch.Tensor | None = None,
) -> RowStats:
    """Log-prob of each row's label, its log-sum-exp and (optionally) entropy.

    rows: M valid rows (labels shard-local under vocab parallelism, possibly outside [0, V)
    then). Returns fp32 :class:`RowStats` with nothing kept for backward (it recomputes);
    ``keep_tile`` is accepted for the interface and ignored; ``probe``: ``[M, K]`` shard-local
    ids to report (:class:`~.base.ProbeStats`), or None. In the batch-invariant mode the rows
    are padded to whole blocks (as the torch tiles pad them) and the results cut back.
    """
    num_rows = rows.hidden.shape[0]
    pad = opts.schedule.padding(num_rows)
    if pad:
        return forward_rows(rows.padded(pad), opts, probe=extend_rows(probe, pad)).cut(num_rows)
    dev = rows.hidden.device
    logp = torch.empty(num_rows, device=dev)
    lse = torch.empty(num_rows, device=dev)
    ent = torch.empty(num_rows, device=dev) if opts.with_entropy else None
    call = KernelHead(rows, opts)
    sorted_probe = None if probe is None else _Probe(probe)
    parts = []
    for r0, r1 in row_passes(num_rows, opts):
        lp, ls, en, found = _stats_pass(call, r0, r1, opts, sorted_probe)
        logp[r0:r1], lse[r0:r1] = lp, ls
        if ent is not None:
            ent[r0:r1] = en
        parts.append(found)
    if probe is None:
        return RowStats(logp, lse, ent)
    if not parts:  # no row: empty statistics of the probe's shape
        z = torch.zeros(probe.shape, device=dev)
        parts.append(ProbeStats(z, logp, logp, logp))
    return RowStats(
        logp, lse, ent, None, ProbeStats(*(torch.cat(x) for x in zip(*parts, strict=True)))
    )


def _dz_chunk(call: KernelHead, r0: int, r1: int, v0: int, dz, lse, ent, g, e) -> None:
    """Write d loss / d raw logits of rows [r0, r1) and columns [v0, v0 + width) into ``dz``
    [rows, width] (one launch). lse, g: [M] fp32 (g None: no log-prob gradient); ent / e:
    [M] fp32 or None (no entropy gradient)."""
    rows, width = dz.shape
    placeholder = lse  # any fp32 tensor; never read when its flag is off
    use_e = ent is not None
    per_row = (
        lse[r0:r1],
        ent[r0:r1] if use_e else placeholder,
        g[r0:r1] if g is not None else placeholder,
        e[r0:r1] if use_e else placeholder,
    )
    launch(
        "dz",
        rows * width,
        lambda meta: triton.cdiv(rows, meta["BLOCK_M"]) * triton.cdiv(width, meta["BLOCK_N"]),
        *call.tensors(r0, r1), *per_row, dz, rows, *call.sizes(), v0, width, *call.scalars(),
        HAS_G=g is not None, HAS_E=use_e, pinned=call.pinned, **call.meta,
    )  # fmt: skip


def backward_rows(
    rows: RowBatch, stats: RowStats, up: Upstream, opts: KernelOptions, needs: Needs
) -> HeadGrads:
    """Gradients for hidden [M, H], weight [V, H] and bias [V], in those tensors' dtypes.

    stats: the forward's lse and entropy; up: the [M] upstream gradients (None
    when that output is unused); needs: which of (hidden, weight, bias) want a gradient.
    """
    num_rows = rows.hidden.shape[0]
    pad = opts.schedule.padding(num_rows)
    if pad:
        return padded_backward(backward_rows, rows, stats, up, opts, needs, pad)
    grad_logp, grad_ent = up
    use_e = opts.with_entropy and grad_ent is not None
    call = KernelHead(rows, opts)
    f32 = lambda t: None if t is None else t.float().contiguous()  # noqa: E731
    lse, ent, g_all, e_all = f32(stats.lse), f32(stats.entropy), f32(grad_logp), f32(grad_ent)

    def write_dz(r0: int, r1: int, v0: int, dz: torch.Tensor) -> None:
        _dz_chunk(call, r0, r1, v0, dz, lse, ent if use_e else None, g_all, e_all)

    return head_grads(rows, opts, needs, write_dz)


def fused_rows(
    rows: RowBatch, opts: KernelOptions, grad_fn: GradFn, needs: Needs
) -> tuple[torch.Tensor, torch.Tensor | None, HeadGrads]:
    """Log-probs, entropy and parameter gradients of a loss whose per-row gradient
    ``grad_fn(0, M, logp, entropy)`` gives: the statistics kernel, one evaluation of the loss
    gradient for every row, then :func:`backward_rows`. Same contract as the torch backend's
    ``fused_rows`` (which calls ``grad_fn`` once per row chunk)."""
    stats = forward_rows(rows, opts)
    g, e = grad_fn(0, rows.hidden.shape[0], stats.logp, stats.entropy)
    if e is not None and stats.entropy is None:
        raise ValueError("grad_fn returned an entropy gradient but with_entropy is False")
    return stats.logp, stats.entropy, backward_rows(rows, stats, Upstream(g, e), opts, needs)


__all__ = ["backward_rows", "forward_rows", "fused_rows", "head_grads"]
