"""The divergence op in Triton: both heads' GEMM tiles in one program, logits in registers.

The algorithm is the torch tiles' (:mod:`logitless.backends.torch_divergence`, whose docstring
states the math); here each program owns a ``[BLOCK_M, BLOCK_N]`` block of rows × vocabulary
and computes *both* heads' tiles of it, the student's ``z_s = transform_s(h·Wᵀ)`` and the
teacher's ``z_t = transform_t(h_t·W_tᵀ)`` (each with its own bias, logit scale, softcap, hidden
width and head dtype; one temperature), with
:func:`~logitless.backends.triton_tiles.logits_tile`, the Triton twin of the logit transform.
No logit of either head is written to memory.

Forward. ``_div_stats_kernel`` folds each program's run of vocabulary blocks (a *split*) into
the student's online ``m_s, Σ exp(z_s - m_s), Σ exp(z_s - m_s)·(z_s - m_s)`` and label logit,
the teacher's ``m_t, Σ exp(z_t - m_t)`` and the cross sum of the KL asked for (``Σ e_t·(z_t -
z_s)`` at beta 0, ``Σ e_s·(z_s - z_t)`` at beta 1), written once per (split, row); the splits
are merged in torch. The JSD runs a second kernel, ``_jsd_kernel``, once both normalizers are
known: ``Σ p·(lp - log m)`` of each head per split.

Backward. ``_div_dz_kernel`` recomputes both tiles of a vocabulary chunk and writes the
student's logit gradient (the teacher's tile only when the divergence has a gradient)

    dz_s = d·∂D/∂z_s + g·(onehot(y) - p_s) - e·p_s ⊙ (lp_s + H)      · (s/T) · softcap'

into the bounded workspace of :func:`~logitless.backends.triton_launch.head_grads`, which
multiplies it out into the student's ``dW``, ``dh`` and ``db`` with cuBLAS.

Not here (the contract refuses them under ``backend="triton"``; ``"auto"`` runs the torch
tiles): the sparse teacher (``teacher_topk``) and vocab parallelism.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .base import DivOptions, DivRows, DivStats, DivUpstream, HeadGrads, Needs, padded_backward
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

_MODES = {"forward": 0, "reverse": 1, "jsd": 2}

# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _log_mixture(lp_s, lp_t, log_1mb, log_b):
    """``log((1-β)·p_s + β·p_t)`` of two log-prob tiles (a log-add-exp)."""
    a = lp_s + log_1mb
    b = lp_t + log_b
    hi = tl.maximum(a, b)
    return hi + tl.log(1.0 + tl.exp(tl.minimum(a, b) - hi))


_EVEN_K = {
    "S_EVEN_K": lambda args: args["Ks"] % args["BLOCK_K"] == 0,
    "T_EVEN_K": lambda args: args["Kt"] % args["BLOCK_K"] == 0,
}


@triton.heuristics(_EVEN_K)
@triton.jit
def _div_stats_kernel(
    hs_ptr, ws_ptr, bs_ptr, y_ptr, t_ptr, ht_ptr, wt_ptr, bt_ptr, stats_ptr,
    M, V, Ks, Kt, stride_hs, stride_ws, stride_ht, stride_wt, num_splits,
    inv_temp, scale_s, softcap_s, scale_t, softcap_t,
    MODE: tl.constexpr, WITH_ENTROPY: tl.constexpr, TEMP_MODE: tl.constexpr,
    S_HAS_BIAS: tl.constexpr, S_HAS_SCALE: tl.constexpr, S_HAS_SOFTCAP: tl.constexpr,
    S_HEAD_DTYPE: tl.constexpr, S_DOT_DTYPE: tl.constexpr, S_IEEE: tl.constexpr,
    S_EVEN_K: tl.constexpr,
    T_HAS_BIAS: tl.constexpr, T_HAS_SCALE: tl.constexpr, T_HAS_SOFTCAP: tl.constexpr,
    T_HEAD_DTYPE: tl.constexpr, T_DOT_DTYPE: tl.constexpr, T_IEEE: tl.constexpr,
    T_EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """Both heads' online statistics of one row block over one vocabulary split.

    stats: ``[7, num_splits, M]`` fp32: the student's max, Σexp, Σexp·(z - m), label logit;
    the teacher's max, Σexp; the cross sum centred on the split's maxima (``d = z - m`` of
    each head): ``Σ exp(d_t)·(d_t - d_s)`` at MODE 0, ``Σ exp(d_s)·(d_s - d_t)`` at MODE 1,
    0 for the JSD. An empty split writes max = -inf and zero sums.
    """
    pid_s, offs_m, row_ok, rows, first, last = split_program(
        M, V, num_splits, BLOCK_M, BLOCK_N, GROUP_M
    )
    y = tl.load(y_ptr + rows)
    inv_t = row_inv_temperature(t_ptr, rows, inv_temp, TEMP_MODE)
    m_s = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    m_t = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    s_s = tl.zeros((BLOCK_M,), tl.float32)
    q_s = tl.zeros((BLOCK_M,), tl.float32)
    s_t = tl.zeros((BLOCK_M,), tl.float32)
    cross = tl.zeros((BLOCK_M,), tl.float32)
    zy = tl.zeros((BLOCK_M,), tl.float32)
    for nb in range(first, last):
        offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = offs_n < V
        z_s, _ = logits_tile(
            hs_ptr, ws_ptr, bs_ptr, rows, offs_n % V, inv_t, Ks, stride_hs, stride_ws,
            scale_s, softcap_s, S_HAS_BIAS, S_HAS_SCALE, S_HAS_SOFTCAP, TEMP_MODE,
            S_HEAD_DTYPE, S_DOT_DTYPE, S_IEEE, S_EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip
        z_t, _ = logits_tile(
            ht_ptr, wt_ptr, bt_ptr, rows, offs_n % V, inv_t, Kt, stride_ht, stride_wt,
            scale_t, softcap_t, T_HAS_BIAS, T_HAS_SCALE, T_HAS_SOFTCAP, TEMP_MODE,
            T_HEAD_DTYPE, T_DOT_DTYPE, T_IEEE, T_EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip
        # the tail: exp() = 0 and z_s - z_t = 0, no inf arithmetic
        z_s = tl.where(col_ok[None, :], z_s, -1.0e30)
        z_t = tl.where(col_ok[None, :], z_t, -1.0e30)
        is_label = (offs_n[None, :] == y[:, None]) & col_ok[None, :]
        zy += tl.sum(tl.where(is_label, z_s, 0.0), axis=1)
        # each head's new max, m_old - m_new, d = z - m_new, exp(d), exp(m_old - m_new)
        ms_new, shift_s, d_s, e_s, alpha_s = online_step(m_s, z_s)
        mt_new, shift_t, d_t, e_t, alpha_t = online_step(m_t, z_t)
        if WITH_ENTROPY:
            q_s = alpha_s * (q_s + shift_s * s_s) + tl.sum(tl.where(e_s > 0.0, e_s * d_s, 0.0), 1)
        # the cross sum Σ e·(d_own - d_other): its old terms move by shift_own - shift_other
        if MODE == 0:  # Σ exp(d_t)·(d_t - d_s), rescaled to the teacher's max
            cross = alpha_t * (cross + (shift_t - shift_s) * s_t)
            cross += tl.sum(tl.where(col_ok[None, :], e_t * (d_t - d_s), 0.0), axis=1)
        if MODE == 1:  # Σ exp(d_s)·(d_s - d_t), rescaled to the student's max
            cross = alpha_s * (cross + (shift_s - shift_t) * s_s)
            cross += tl.sum(tl.where(col_ok[None, :], e_s * (d_s - d_t), 0.0), axis=1)
        s_s = alpha_s * s_s + tl.sum(e_s, axis=1)
        m_s = ms_new
        s_t = alpha_t * s_t + tl.sum(e_t, axis=1)
        m_t = mt_new
    out, plane = store_row_stats(stats_ptr, pid_s, M, offs_m, num_splits, row_ok, m_s, s_s, q_s, zy)
    tl.store(out + 4 * plane, m_t, mask=row_ok)
    tl.store(out + 5 * plane, s_t, mask=row_ok)
    tl.store(out + 6 * plane, cross, mask=row_ok)


@triton.heuristics(_EVEN_K)
@triton.jit
def _jsd_kernel(
    hs_ptr, ws_ptr, bs_ptr, t_ptr, ht_ptr, wt_ptr, bt_ptr, norm_ptr, out_ptr,
    M, V, Ks, Kt, stride_hs, stride_ws, stride_ht, stride_wt, num_splits,
    inv_temp, scale_s, softcap_s, scale_t, softcap_t, log_1mb, log_b,
    TEMP_MODE: tl.constexpr,
    S_HAS_BIAS: tl.constexpr, S_HAS_SCALE: tl.constexpr, S_HAS_SOFTCAP: tl.constexpr,
    S_HEAD_DTYPE: tl.constexpr, S_DOT_DTYPE: tl.constexpr, S_IEEE: tl.constexpr,
    S_EVEN_K: tl.constexpr,
    T_HAS_BIAS: tl.constexpr, T_HAS_SCALE: tl.constexpr, T_HAS_SOFTCAP: tl.constexpr,
    T_HEAD_DTYPE: tl.constexpr, T_DOT_DTYPE: tl.constexpr, T_IEEE: tl.constexpr,
    T_EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """The JSD's second pass: ``Σ p_s·(lp_s - log m)`` and ``Σ p_t·(lp_t - log m)`` of one row
    block over one split -> out ``[2, num_splits, M]``; norm ``[4, M]``: each head's max and
    log Σ exp(z - max) (student, student, teacher, teacher)."""
    pid_s, offs_m, row_ok, rows, first, last = split_program(
        M, V, num_splits, BLOCK_M, BLOCK_N, GROUP_M
    )
    inv_t = row_inv_temperature(t_ptr, rows, inv_temp, TEMP_MODE)
    m_s = tl.load(norm_ptr + rows)
    ls_s = tl.load(norm_ptr + M + rows)
    m_t = tl.load(norm_ptr + 2 * M + rows)
    ls_t = tl.load(norm_ptr + 3 * M + rows)
    kl_s = tl.zeros((BLOCK_M,), tl.float32)
    kl_t = tl.zeros((BLOCK_M,), tl.float32)
    for nb in range(first, last):
        offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = offs_n < V
        z_s, _ = logits_tile(
            hs_ptr, ws_ptr, bs_ptr, rows, offs_n % V, inv_t, Ks, stride_hs, stride_ws,
            scale_s, softcap_s, S_HAS_BIAS, S_HAS_SCALE, S_HAS_SOFTCAP, TEMP_MODE,
            S_HEAD_DTYPE, S_DOT_DTYPE, S_IEEE, S_EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip
        z_t, _ = logits_tile(
            ht_ptr, wt_ptr, bt_ptr, rows, offs_n % V, inv_t, Kt, stride_ht, stride_wt,
            scale_t, softcap_t, T_HAS_BIAS, T_HAS_SCALE, T_HAS_SOFTCAP, TEMP_MODE,
            T_HEAD_DTYPE, T_DOT_DTYPE, T_IEEE, T_EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip
        lp_s = (z_s - m_s[:, None]) - ls_s[:, None]
        lp_t = (z_t - m_t[:, None]) - ls_t[:, None]
        log_m = _log_mixture(lp_s, lp_t, log_1mb, log_b)
        kl_s += tl.sum(tl.where(col_ok[None, :], tl.exp(lp_s) * (lp_s - log_m), 0.0), axis=1)
        kl_t += tl.sum(tl.where(col_ok[None, :], tl.exp(lp_t) * (lp_t - log_m), 0.0), axis=1)
    out = out_ptr + pid_s * M + offs_m
    tl.store(out, kl_s, mask=row_ok)
    tl.store(out + num_splits * M, kl_t, mask=row_ok)


@triton.heuristics(_EVEN_K)
@triton.jit
def _div_dz_kernel(
    hs_ptr, ws_ptr, bs_ptr, y_ptr, t_ptr, ht_ptr, wt_ptr, bt_ptr, row_ptr, dz_ptr,
    M, V, Ks, Kt, stride_hs, stride_ws, stride_ht, stride_wt, v_start, width,
    inv_temp, scale_s, softcap_s, scale_t, softcap_t, log_1mb, log_b, one_m_beta,
    MODE: tl.constexpr, HAS_D: tl.constexpr, HAS_G: tl.constexpr, HAS_E: tl.constexpr,
    TEMP_MODE: tl.constexpr,
    S_HAS_BIAS: tl.constexpr, S_HAS_SCALE: tl.constexpr, S_HAS_SOFTCAP: tl.constexpr,
    S_HEAD_DTYPE: tl.constexpr, S_DOT_DTYPE: tl.constexpr, S_IEEE: tl.constexpr,
    S_EVEN_K: tl.constexpr,
    T_HAS_BIAS: tl.constexpr, T_HAS_SCALE: tl.constexpr, T_HAS_SOFTCAP: tl.constexpr,
    T_HEAD_DTYPE: tl.constexpr, T_DOT_DTYPE: tl.constexpr, T_IEEE: tl.constexpr,
    T_EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """d loss / d raw student logits of rows [0, M) and columns [v_start, v_start + width)
    -> dz ``[M, width]`` (the head dtype).

    row: ``[9, M]`` fp32 per-row values: the student's max, log-sum, the teacher's max,
    log-sum, aux (KL(p_s‖p_t) at MODE 1, KL(p_s‖m) at MODE 2), entropy, and the upstream
    gradients d (divergence), g (log-prob), e (entropy); each read only when its flag is on.
    """
    offs_m, offs_c, row_ok, col_ok, rows = chunk_program(M, width, BLOCK_M, BLOCK_N, GROUP_M)
    offs_n = v_start + offs_c  # offs_c: the column inside the chunk
    inv_t = row_inv_temperature(t_ptr, rows, inv_temp, TEMP_MODE)
    z_s, th = logits_tile(
        hs_ptr, ws_ptr, bs_ptr, rows, offs_n % V, inv_t, Ks, stride_hs, stride_ws,
        scale_s, softcap_s, S_HAS_BIAS, S_HAS_SCALE, S_HAS_SOFTCAP, TEMP_MODE,
        S_HEAD_DTYPE, S_DOT_DTYPE, S_IEEE, S_EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    lp_s = (z_s - tl.load(row_ptr + rows)[:, None]) - tl.load(row_ptr + M + rows)[:, None]
    p_s = tl.exp(lp_s)
    factor = row_factor(inv_t, scale_s, S_HAS_SCALE)  # dz/dx's per-row part: s / T
    x = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)  # d·u, where dD/dz_s = p_s ⊙ u (- p_t)
    gh = tl.zeros((BLOCK_M,), tl.float32)  # g + e·H
    if HAS_D:
        d_f = tl.load(row_ptr + 6 * M + rows) * factor
        z_t, _ = logits_tile(
            ht_ptr, wt_ptr, bt_ptr, rows, offs_n % V, inv_t, Kt, stride_ht, stride_wt,
            scale_t, softcap_t, T_HAS_BIAS, T_HAS_SCALE, T_HAS_SOFTCAP, TEMP_MODE,
            T_HEAD_DTYPE, T_DOT_DTYPE, T_IEEE, T_EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip
        m_t = tl.load(row_ptr + 2 * M + rows)
        lp_t = (z_t - m_t[:, None]) - tl.load(row_ptr + 3 * M + rows)[:, None]
        aux = tl.load(row_ptr + 4 * M + rows)[:, None]
        if MODE == 0:
            x += d_f[:, None]
        if MODE == 1:
            x = (lp_s - lp_t - aux) * d_f[:, None]
        if MODE == 2:
            log_m = _log_mixture(lp_s, lp_t, log_1mb, log_b)
            x = (lp_s - log_m - aux) * (d_f * one_m_beta)[:, None]
    if HAS_G:
        g_f = tl.load(row_ptr + 7 * M + rows) * factor
        gh += g_f
    if HAS_E:
        e_f = tl.load(row_ptr + 8 * M + rows) * factor
        x -= e_f[:, None] * lp_s
        gh += e_f * tl.load(row_ptr + 5 * M + rows)
    x = (x - gh[:, None]) * p_s
    if HAS_D:
        if MODE == 0:  # d·(p_s - p_t)
            x -= d_f[:, None] * tl.exp(lp_t)
    if HAS_G:
        y = tl.load(y_ptr + rows)
        x = tl.where(offs_n[None, :] == y[:, None], x + g_f[:, None], x)
    if S_HAS_SOFTCAP:
        x = x * (1.0 - th * th)
    store_dz(dz_ptr, x, offs_m, offs_c, row_ok, col_ok, width)


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------


# Launched by the log-prob kernels' launcher, under its rule for configurations
# (``candidates`` in :mod:`logitless.backends.triton_launch`), with the two-GEMM table.
_OPERANDS = ("hs_ptr", "ws_ptr", "ht_ptr", "wt_ptr")
for _name, _kernel in (("div_stats", _div_stats_kernel), ("jsd", _jsd_kernel),
                       ("div_dz", _div_dz_kernel)):  # fmt: skip
    register(_name, _kernel, _OPERANDS, ("S_IEEE", "T_IEEE"), ["Ks", "Kt"], table="divergence")


class _Heads:
    """Both heads made kernel-ready (:class:`~logitless.backends.triton_launch.KernelHead` each):
    their tensors, scalars and constexprs as the kernels name them (``S_*`` student,
    ``T_*`` teacher; the temperature is the student's, shared)."""

    def __init__(self, rows: DivRows, opts: DivOptions) -> None:
        self.s = KernelHead(rows.student, opts.student)
        self.t = KernelHead(rows.teacher, opts.teacher)
        self.mode = opts.mode
        self.beta = opts.beta
        self.vocab = rows.student.weight.shape[0]
        heads = {"S_": self.s.meta, "T_": self.t.meta}
        self.meta = {p + k: v for p, m in heads.items() for k, v in m.items() if k != "TEMP_MODE"}
        self.meta["TEMP_MODE"] = self.s.meta["TEMP_MODE"]

    def tensors(self, r0: int, r1: int, labels: bool = True) -> tuple:
        """The student's (hidden, weight, bias[, labels], temperature) and the teacher's
        (hidden, weight, bias) of rows [r0, r1) (placeholders for absent ones)."""
        h, w, b, y, t = self.s.tensors(r0, r1)
        th, tw, tb, _, _ = self.t.tensors(r0, r1)
        return (h, w, b, *((y,) if labels else ()), t, th, tw, tb)

    def sizes(self) -> tuple:
        """V, K_s, K_t and the four row strides."""
        s, t = self.s, self.t
        return (
            self.vocab, s.weight.shape[1], t.weight.shape[1],
            s.hidden.stride(0), s.weight.stride(0), t.hidden.stride(0), t.weight.stride(0),
        )  # fmt: skip

    def scalars(self) -> tuple:
        """1/T, then each head's scale and softcap."""
        return (*self.s.scalars(), *self.t.scalars()[1:])

    def mixture(self) -> tuple[float, float]:
        """``(log(1-β), log β)`` of the JSD (0 otherwise: unused)."""
        if self.mode != "jsd":
            return 0.0, 0.0
        return math.log1p(-self.beta), math.log(self.beta)


def forward_rows(rows: DivRows, opts: DivOptions) -> DivStats:
    """Per-row divergence, log-prob, entropy and the statistics backward needs.

    rows: M valid rows with a dense teacher; returns fp32 :class:`DivStats` (the torch tiles'
    fields: entropy None without ``with_entropy``, aux None at beta 0). In the batch-invariant
    mode the rows are padded to whole blocks, as the torch tiles pad them.
    """
    num_rows, dev = rows.student.hidden.shape[0], rows.student.hidden.device
    pad = opts.student.schedule.padding(num_rows)
    if pad:
        stats = forward_rows(rows.padded(pad), opts)
        return DivStats(*(None if x is None else x[:num_rows] for x in stats))
    names = DivStats._fields
    out = {k: torch.empty(num_rows, device=dev) for k in names}
    heads = _Heads(rows, opts)
    for r0, r1 in row_passes(num_rows, opts.student):
        for k, v in _stats_pass(heads, r0, r1, opts.student.with_entropy).items():
            out[k][r0:r1] = v
    keep = {"entropy": opts.student.with_entropy, "aux": opts.mode != "forward", "tail": False}
    return DivStats(*(out[k] if keep.get(k, True) else None for k in names))


def _stats_pass(heads: _Heads, r0: int, r1: int, with_entropy: bool) -> dict:
    """The [r1 - r0] results of rows [r0, r1): the statistics kernel, the merge of its splits
    and (JSD) the second pass."""
    rows = r1 - r0
    splits = vocab_splits(rows, heads.vocab, heads.s.hidden.device)
    stats = torch.empty(7, splits, rows, device=heads.s.hidden.device)
    launch(
        "div_stats",
        rows * heads.vocab,
        lambda meta: triton.cdiv(rows, meta["BLOCK_M"]) * splits,
        *heads.tensors(r0, r1), stats, rows, *heads.sizes(), splits, *heads.scalars(),
        MODE=_MODES[heads.mode], WITH_ENTROPY=with_entropy, pinned=heads.s.pinned, **heads.meta,
    )  # fmt: skip
    m_s, s_s, q_s, zy, m_t, s_t, cross = _merge(stats, heads.mode)
    log_s, log_t = s_s.log(), s_t.log()
    res = {"logp": (zy - m_s) - log_s, "max": m_s, "log_sum": log_s}
    res |= {"teacher_max": m_t, "teacher_log_sum": log_t, "entropy": log_s - q_s / s_s}
    gap = log_s - log_t  # lse_s - lse_t less the maxima, which cancel against the cross sum's
    if heads.mode == "forward":
        res["divergence"] = cross / s_t + gap
    elif heads.mode == "reverse":
        res["divergence"] = res["aux"] = cross / s_s - gap
    else:
        kl_s, kl_t = _jsd_pass(heads, r0, r1, splits, torch.stack([m_s, log_s, m_t, log_t]))
        res["aux"] = kl_s
        res["divergence"] = heads.beta * kl_t + (1.0 - heads.beta) * kl_s
    return res


def _rescaled(m: torch.Tensor, sums: list[torch.Tensor]) -> tuple[torch.Tensor, list]:
    """One head's per-split max ``[splits, R]`` and sums rescaled to it -> the rows' max
    ``[R]`` and the sums over splits (an empty split, max -inf, drops out)."""
    top = m.amax(0)
    alpha = (m - top[None]).exp()
    return top, [(alpha * s).sum(0) for s in sums]


def _merge(stats: torch.Tensor, mode: str) -> list[torch.Tensor]:
    """stats ``[7, splits, R]`` -> ``[R]`` each over all splits: m_s, s_s, q_s, z_y, m_t,
    s_t, cross (the entropy sum also shifts with the student's max, the cross sum with both
    heads': each split's ``d = z - m`` moves by its head's ``m_split - m_all``)."""
    m_s, s_s, q_s, zy, m_t, s_t, cross = stats.unbind(0)
    top_s, top_t = m_s.amax(0), m_t.amax(0)
    shift = m_s - top_s[None]  # <= 0; -inf for an empty split
    q_all = torch.where(s_s > 0, shift.exp() * (q_s + shift * s_s), 0.0).sum(0)
    c_all = torch.zeros_like(top_s)
    if mode in ("forward", "reverse"):
        d_s, d_t = shift, m_t - top_t[None]  # each split's move (<= 0; -inf: empty)
        d_own, d_other, s_own = (d_t, d_s, s_t) if mode == "forward" else (d_s, d_t, s_s)
        moved = d_own.exp() * (cross + (d_own - d_other) * s_own)
        c_all = torch.where(s_own > 0, moved, 0.0).sum(0)  # an empty split drops out
    top_s, (s_all,) = _rescaled(m_s, [s_s])
    top_t, (t_all,) = _rescaled(m_t, [s_t])
    return [top_s, s_all, q_all, zy.sum(0), top_t, t_all, c_all]


def _jsd_pass(heads: _Heads, r0: int, r1: int, splits: int, norm: torch.Tensor):
    """``(KL(p_s‖m), KL(p_t‖m))`` ``[R]`` of rows [r0, r1); norm ``[4, R]`` (both heads' max
    and log-sum)."""
    rows = r1 - r0
    out = torch.empty(2, splits, rows, device=norm.device)
    launch(
        "jsd",
        rows * heads.vocab,
        lambda meta: triton.cdiv(rows, meta["BLOCK_M"]) * splits,
        *heads.tensors(r0, r1, labels=False), norm.contiguous(), out, rows, *heads.sizes(),
        splits, *heads.scalars(), *heads.mixture(), pinned=heads.s.pinned, **heads.meta,
    )  # fmt: skip
    kl_s, kl_t = out.sum(1)
    return kl_s, kl_t


def backward_rows(
    rows: DivRows, stats: DivStats, up: DivUpstream, opts: DivOptions, needs: Needs
) -> HeadGrads:
    """Gradients of the student's hidden ``[M, H]``, weight ``[V, H]`` and bias ``[V]`` (in
    their dtypes) under the upstream gradients ``up``; recomputes both heads' tiles chunk by
    chunk (the teacher's only when the divergence has a gradient)."""
    num_rows = rows.student.hidden.shape[0]
    pad = opts.student.schedule.padding(num_rows)
    if pad:
        return padded_backward(backward_rows, rows, stats, up, opts, needs, pad)
    heads = _Heads(rows, opts)
    use_e = up.entropy is not None and stats.entropy is not None
    flags = {"HAS_D": up.divergence is not None, "HAS_G": up.logp is not None, "HAS_E": use_e}
    per_row = _per_row(stats, up, use_e)
    beta = (*heads.mixture(), 1.0 - heads.beta)

    def write_dz(r0: int, r1: int, v0: int, dz: torch.Tensor) -> None:
        n, width = dz.shape
        launch(
            "div_dz",
            n * width,
            lambda meta: triton.cdiv(n, meta["BLOCK_M"]) * triton.cdiv(width, meta["BLOCK_N"]),
            *heads.tensors(r0, r1), per_row[:, r0:r1].contiguous(), dz, n, *heads.sizes(),
            v0, width, *heads.scalars(), *beta, MODE=_MODES[heads.mode], **flags,
            pinned=heads.s.pinned, **heads.meta,
        )  # fmt: skip

    return head_grads(rows.student, opts.student, needs, write_dz)


def _per_row(stats: DivStats, up: DivUpstream, use_e: bool) -> torch.Tensor:
    """``[9, M]`` fp32: max, log-sum, teacher max, teacher log-sum, aux, entropy, d, g, e (zero
    where absent: the kernel's flags leave those unread)."""
    zero = torch.zeros_like(stats.max)
    parts = [stats.max, stats.log_sum, stats.teacher_max, stats.teacher_log_sum, stats.aux]
    parts += [stats.entropy if use_e else None, *up]
    return torch.stack([zero if p is None else p.float() for p in parts])


__all__ = ["backward_rows", "forward_rows"]
