"""The tile code every Triton kernel family of logitless calls (``@triton.jit`` functions,
inlined by Triton into each kernel that calls them).

- the programs' prologues: :func:`split_program` (a forward, statistics kernel: one row block
  and one vocabulary split) and :func:`chunk_program` (a backward, logit-gradient kernel: one
  block of a vocabulary chunk), both over :func:`grouped` program ids;
- the logits of one tile, :func:`logits_tile`: ``h·Wᵀ`` with the logit transform (bias, logit
  scale, softcap, temperature) in the epilogue, the Triton twin of
  :class:`logitless.transform.LogitTransform`; its per-row parts :func:`row_inv_temperature`
  and :func:`row_factor`;
- one step of an online log-sum-exp, :func:`online_step`;
- the stores: :func:`store_row_stats` (a split's per-row statistics) and :func:`store_dz` (a
  block of the logit gradient into the backward's workspace).

The families (:mod:`.triton_kernels`, :mod:`.triton_divergence`) import these by name; what
launches their kernels (configurations, the launcher, the host side of a head) is
:mod:`.triton_launch`. Nothing here reads the device or the environment.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def grouped(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Program id -> (row block, column block), GROUP_M row blocks at a time so that programs
    running together share their hidden and weight tiles in L2."""
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    local = pid % in_group
    return first_m + local % size_m, local // size_m


@triton.jit
def row_inv_temperature(t_ptr, rows, inv_temp, TEMP_MODE: tl.constexpr):
    """[BLOCK_M] 1/T: TEMP_MODE 0 -> 1, 1 -> the scalar ``inv_temp``, 2 -> per row from t_ptr."""
    if TEMP_MODE == 2:
        return 1.0 / tl.load(t_ptr + rows)
    else:
        return tl.zeros(rows.shape, tl.float32) + inv_temp


@triton.jit
def split_program(
    M, V, num_splits, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr
):
    """The program of a forward (statistics) kernel: one row block and one vocabulary split
    (a run of consecutive vocabulary blocks). Returns its split, its row ids ``offs_m``
    ``[BLOCK_M]``, which of them are rows (``< M``), the in-range ids the loads use (the tail
    wraps around: ``offs_m % M``) and its vocabulary blocks ``[first, last)`` (empty when the
    blocks do not divide evenly)."""
    pid_m, pid_s = grouped(tl.program_id(0), tl.cdiv(M, BLOCK_M), num_splits, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_blocks = tl.cdiv(V, BLOCK_N)
    per_split = tl.cdiv(n_blocks, num_splits)
    first = pid_s * per_split
    return pid_s, offs_m, offs_m < M, offs_m % M, first, tl.minimum(first + per_split, n_blocks)


@triton.jit
def chunk_program(M, width, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """The program of a backward (logit gradient) kernel: one ``[BLOCK_M, BLOCK_N]`` block of
    a ``[M, width]`` vocabulary chunk. Returns its row ids, its columns inside the chunk, which
    of each are in range, and the in-range row ids the loads use (``offs_m % M``)."""
    num_n = tl.cdiv(width, BLOCK_N)
    pid_m, pid_n = grouped(tl.program_id(0), tl.cdiv(M, BLOCK_M), num_n, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_c = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return offs_m, offs_c, offs_m < M, offs_c < width, offs_m % M


@triton.jit
def online_step(m, z):
    """One tile of an online log-sum-exp over ``[BLOCK_M, BLOCK_N]`` logits ``z`` whose rows'
    running max is ``m``: the new max, the shift ``m - m_new`` (<= 0; 0 on the first tile,
    whose ``m`` is -inf), ``d = z - m_new`` (<= 0: every sum is centred on the max),
    ``exp(d)`` and ``exp(m - m_new)``, the rescale of the sums so far (0 on the first tile)."""
    m_new = tl.maximum(m, tl.max(z, axis=1))
    shift = tl.where(m == float("-inf"), 0.0, m - m_new)
    d = z - m_new[:, None]
    return m_new, shift, d, tl.exp(d), tl.exp(m - m_new)


@triton.jit
def row_factor(inv_t, scale, HAS_SCALE: tl.constexpr):
    """``[BLOCK_M]`` the per-row part of the transform's derivative, ``s / T``."""
    if HAS_SCALE:
        return inv_t * scale
    else:
        return inv_t


@triton.jit
def store_dz(dz_ptr, dz, offs_m, offs_c, row_ok, col_ok, width):
    """Write a block of the logit gradient into the ``[M, width]`` workspace (its dtype)."""
    out = dz_ptr + offs_m.to(tl.int64)[:, None] * width + offs_c[None, :]
    tl.store(out, dz.to(dz_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def store_row_stats(stats_ptr, pid_s, M, offs_m, num_splits, row_ok, m, s, q, zy):
    """Write one split's per-row planes of ``stats`` ``[P, num_splits, M]``: the running max,
    Σ exp, Σ exp·d and the label's logit (planes 0 to 3); returns ``(out, plane)`` for the
    planes a family adds after them (``out + k * plane``)."""
    out = stats_ptr + pid_s * M + offs_m
    plane = num_splits * M
    tl.store(out, m, mask=row_ok)
    tl.store(out + plane, s, mask=row_ok)
    tl.store(out + 2 * plane, q, mask=row_ok)
    tl.store(out + 3 * plane, zy, mask=row_ok)
    return out, plane


@triton.jit
def logits_tile(
    h_ptr, w_ptr, b_ptr, rows, cols, inv_t, K, stride_h, stride_w, scale, softcap,
    HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    TEMP_MODE: tl.constexpr,
    HEAD_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Transformed logits ``z = softcap(s·(h·wᵀ + b)) / T`` of one [BLOCK_M, BLOCK_N] tile,
    fp32, and ``tanh(s·x / softcap)`` (for the backward's softcap derivative; ``z`` without
    softcap).

    ``rows`` / ``cols`` are in-range ids (the caller masks the tails), so loads need no mask
    along M or V; K is masked unless it is a multiple of BLOCK_K.
    """
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = h_ptr + rows.to(tl.int64)[:, None] * stride_h + offs_k[None, :]
    b_ptrs = w_ptr + cols.to(tl.int64)[None, :] * stride_w + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_ok = offs_k < K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        # Round to the head dtype first (as ``.to(head_dtype)`` would), then to the dot dtype
        # (only the interpreter upcasts 16-bit tiles; exact).
        a = a.to(HEAD_DTYPE).to(DOT_DTYPE)
        b = b.to(HEAD_DTYPE).to(DOT_DTYPE)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    x = acc
    if HAS_BIAS:
        x += tl.load(b_ptr + cols).to(HEAD_DTYPE).to(tl.float32)[None, :]
    if HAS_SCALE:
        x = x * scale
    th = x
    if HAS_SOFTCAP:
        # tanh(u) = 2·sigmoid(2u) - 1 (libdevice's tanh is missing in the interpreter)
        th = 2.0 * tl.sigmoid(x * (2.0 / softcap)) - 1.0
        x = softcap * th
    if TEMP_MODE != 0:
        x = x * inv_t[:, None]
    return x, th


__all__ = [
    "chunk_program",
    "grouped",
    "logits_tile",
    "online_step",
    "row_factor",
    "row_inv_temperature",
    "split_program",
    "store_dz",
    "store_row_stats",
]
