"""How every Triton kernel family of logitless is launched: the configuration tables and the
rule that picks a launch's configuration, the launcher, and the host side of a head (its
tensors made kernel-ready, the row passes, the head gradients). The tile code the kernels call
is :mod:`.triton_tiles`.

A kernel family is a module of this folder that holds its ``@triton.jit`` kernels and their
host code and makes each kernel launchable with :func:`register` (its GEMM operands, IEEE
flags, hidden widths and configuration table): :mod:`.triton_kernels` (log-probs and entropy)
and :mod:`.triton_divergence` (the divergence to a teacher head). Every launch goes through
:func:`launch`, whose configurations come from :func:`candidates`; the ahead-of-time compile
check (:mod:`logitless.apps.aot`) reads the launches with :func:`recording` and the
configurations from :func:`candidates`, for every family the same way (:data:`FAMILIES`).

Interpreter. With ``TRITON_INTERPRET=1`` (read by Triton when the kernels are defined, at
import) the kernels run on CPU tensors. Its ``tl.dot`` is wrong on bf16 tiles, so 16-bit tiles
are upcast to fp32 there (the products of 16-bit numbers are exact in fp32: only the summation
order can differ from the GPU); it runs one fixed small configuration instead of autotuning.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from ..contract.backend import interpreting
from .base import HeadGrads, KernelOptions, Needs, RowBatch, add_product

#: The kernel families (modules of :mod:`logitless.backends`), each registering its kernels on
#: import; the compile check imports every one.
FAMILIES = ("logitless.backends.triton_kernels", "logitless.backends.triton_divergence")

# Whether the kernels run in Triton's interpreter: read once, at import, because that is when
# Triton reads the variable too (each ``@triton.jit`` of the tile code and the families becomes
# an interpreted function under it); the launcher must follow what the kernels were built as,
# whatever the variable says later.
INTERPRET = interpreting()

# Backward workspace: [rows, vc] in the compute dtype, at most this many bytes, but never fewer
# than _MIN_VOCAB_CHUNK columns (each chunk re-reads and re-writes the fp32 hidden gradient,
# so narrow chunks cost bandwidth; with many rows the workspace grows with them instead).
_WORKSPACE_BYTES = 128 << 20
_MIN_VOCAB_CHUNK = 2048
_CHUNK_ALIGN = 256

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


# --------------------------------------------------------------------------------------------
# Configurations: which tile configuration a launch can run
# --------------------------------------------------------------------------------------------
#
# One rule, :func:`candidates`, says which configurations a launch can run; the launcher and the
# ahead-of-time compile check (:mod:`logitless.apps.aot`) both call it:
#   - the interpreter: ``INTERPRETER`` (few, wide programs: Python runs each one);
#   - calls with fewer than ``TUNE_MIN_ELEMS`` logits: the table's "small", one configuration
#     (autotuning costs a few seconds per new kernel specialization; it pays off only where the
#     kernels take milliseconds);
#   - larger calls: the kernel's table (``TABLES``), the dot kind's list, pruned to the
#     configurations whose pipelined operand tiles fit the device's shared memory at the real
#     operand size (a 4-byte operand, fp32 weights even under a 16-bit head, takes twice a 2-byte
#     one's bytes); the autotuner times what is left once per key (every constexpr the launcher
#     passes: dtypes, transform flags, outputs, plus the hidden widths).
#   - the batch-invariant mode (``pinned``): the table's "invariant" entry for the dot kind, one
#     configuration whatever the call (an autotuner's pick can differ from process to process,
#     and the small / tuned choice follows the call's size).


def _config(bm, bn, bk, warps, stages, group_m=8):
    return triton.Config(
        {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m},
        num_warps=warps,
        num_stages=stages,
    )


# One table per kind of kernel: "small", the fixed configuration of small calls, and per dot
# kind the autotuned lists: "tc" (tensor cores: 16-bit operands, TF32, 16-bit products under an
# fp32 head) and "fma" (IEEE fp32). Every entry compiles for sm_80, sm_90 and sm_100 within the
# target's shared memory and registers, and none spills on the headline problem (bf16, H = 3584,
# V = 152064, every transform flag): ``python -m logitless.apps.aot --report`` prints them
# and tests/test_triton_compile.py checks it. The widest tiles of an H100 sweep (128x256x64 and
# 256x128x64, 8 warps: 10-15% faster than 128x128 without softcap) spill 400-2600 bytes with the
# transform in the epilogue, and 16 warps cap the registers at 128 and spill too: they are out.
_HEAD_TABLE = {
    "small": _config(64, 64, 32, 4, 2),
    # batch invariance: one configuration per dot kind, from the lists below
    "invariant": {"tc": _config(128, 128, 32, 8, 3), "fma": _config(128, 128, 16, 8, 2)},
    "tc": [
        _config(128, 128, 64, 8, 3),
        _config(128, 128, 64, 8, 4),
        _config(64, 256, 64, 8, 3),
        _config(128, 128, 32, 8, 3),  # fits 4-byte operands (fp32 weights) on every target
    ],
    "fma": [
        _config(128, 128, 16, 8, 2),
        _config(64, 64, 32, 4, 3),
    ],
}
# The divergence's kernels hold two GEMMs (student and teacher) per program: twice the
# accumulators of the head's kernels at one tile size (the operand tiles' shared memory is
# reused: the two GEMM loops run one after the other).
_DIVERGENCE_TABLE = {
    "small": _config(64, 64, 32, 8, 3),  # s2 spills 24 B on sm_100 (div_stats, scalar T)
    "invariant": {"tc": _config(64, 128, 32, 8, 4), "fma": _config(64, 64, 32, 8, 2)},
    "tc": [
        _config(64, 128, 64, 8, 3),
        _config(64, 128, 32, 8, 4),
        _config(64, 64, 64, 8, 3),
    ],
    "fma": [
        _config(64, 64, 32, 8, 2),
        _config(64, 128, 16, 8, 2),
    ],
}
TABLES = {"head": _HEAD_TABLE, "divergence": _DIVERGENCE_TABLE}
INTERPRETER = _config(16, 128, 32, 1, 1, group_m=4)
# Shared memory beyond the operand tiles: barriers (16 B on sm_100), reduction scratch.
_SHARED_SLACK = 1024
TUNE_MIN_ELEMS = 1 << 26
_CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M")


def _dot_kind(kernel: _Kernel, args: dict) -> str:
    return "fma" if any(args[f] for f in kernel.ieee) else "tc"


def _operand_bytes(kernel: _Kernel, args: dict) -> int:
    """Bytes of the widest GEMM operand as loaded (tiles sit in shared memory before any cast)."""
    return max(args[name].element_size() for name in kernel.operands)


def shared_bytes(config: triton.Config, operand_bytes: int) -> int:
    """Shared memory the pipelined operand tiles of ``config`` ask for: ``num_stages`` buffers of
    one ``[BLOCK_M, BLOCK_K]`` and one ``[BLOCK_K, BLOCK_N]`` tile (a kernel with two GEMMs runs
    them one after the other in the same buffers)."""
    k = config.kwargs
    tiles = config.num_stages * (k["BLOCK_M"] + k["BLOCK_N"]) * k["BLOCK_K"] * operand_bytes
    return tiles + _SHARED_SLACK


def tuned_configs(name: str, args: dict, shared_limit: int) -> list[triton.Config]:
    """The autotuned configurations a launch of kernel ``name`` with arguments ``args`` (by name,
    constexprs included) can run on a device with ``shared_limit`` bytes of shared memory per
    block; never empty (the table's small configuration fits every device)."""
    kernel = KERNELS[name]
    size = _operand_bytes(kernel, args)
    table = TABLES[kernel.table]
    keep = [c for c in table[_dot_kind(kernel, args)] if shared_bytes(c, size) <= shared_limit]
    return keep or [table["small"]]


def candidates(
    name: str, elems: int, args: dict, shared_limit: int, pinned: bool = False
) -> list[triton.Config]:
    """Every configuration a launch of kernel ``name`` over ``elems`` logits can run (module
    comment above); ``args`` by name, ``shared_limit``: the device's bytes per block;
    ``pinned``: the batch-invariant mode."""
    if INTERPRET:
        return [INTERPRETER]
    if pinned:
        return [pinned_config(name, args)]
    if elems < TUNE_MIN_ELEMS:
        return [TABLES[KERNELS[name].table]["small"]]
    return tuned_configs(name, args, shared_limit)


def pinned_config(name: str, args: dict) -> triton.Config:
    """The batch-invariant mode's one configuration of kernel ``name`` (by its dot kind)."""
    kernel = KERNELS[name]
    return TABLES[kernel.table]["invariant"][_dot_kind(kernel, args)]


@functools.cache
def _shared_limit(device_index: int) -> int:
    props = triton.runtime.driver.active.utils.get_device_properties(device_index)
    return props["max_shared_mem"]


class _Kernel:
    """A kernel as the launcher runs it: ``plain`` (one configuration given at launch),
    ``tuned`` (autotuned over its table), the names of its GEMM operands (hidden, weight per
    head) and of its IEEE flags."""

    def __init__(self, name, fn, operands, ieee, dims, table="head", shared=()) -> None:
        self.plain, self.operands, self.ieee, self.table = fn, operands, ieee, table
        self.tuned = fn
        if not INTERPRET:
            inner = getattr(fn, "fn", fn)  # under @triton.heuristics
            heur = set(getattr(fn, "values", {}))
            params = [p.name for p in inner.params if p.is_constexpr]
            skip = heur | set(_CONFIG_KEYS) | set(shared)
            key = [*dims, *(p for p in params if p not in skip)]
            prune = functools.partial(_prune, name)
            self.tuned = triton.autotune(
                configs=[c for kind in ("tc", "fma") for c in TABLES[table][kind]],
                key=key,
                prune_configs_by={"early_config_prune": prune},
            )(fn)


def _prune(name, configs, named_args, **kwargs):
    args = {**named_args, **kwargs}
    device = args[KERNELS[name].operands[0]].device
    return tuned_configs(name, args, _shared_limit(device.index))


KERNELS: dict[str, _Kernel] = {}


def register(
    name: str, fn, operands: tuple[str, ...], ieee: tuple[str, ...], dims, table="head", shared=()
):
    """Make kernel ``fn`` launchable by :func:`launch` under ``name``: its GEMM operands'
    argument names (hidden, weight per head), its IEEE flags, its hidden widths (autotune key)
    and its configuration table. ``shared``: constexprs left out of the autotune key, so that
    launches differing only in them run the configuration tuned for either (the same tiles:
    the same bits of what both compute)."""
    KERNELS[name] = _Kernel(name, fn, tuple(operands), tuple(ieee), list(dims), table, shared)


# The ahead-of-time check's hook: a list while :func:`recording` runs (launches are recorded,
# not run).
_RECORDED: list | None = None


@contextlib.contextmanager
def recording():
    """Within the block, kernel launches are not run but recorded as ``(name, elems, args,
    kwargs)`` into the yielded list (:mod:`logitless.apps.aot` reads the launchers' own
    arguments this way; any tensors, meta tensors too)."""
    global _RECORDED
    previous, _RECORDED = _RECORDED, []
    try:
        yield _RECORDED
    finally:
        _RECORDED = previous


def launch(name: str, elems: int, grid_of, *args, pinned: bool = False, **kwargs) -> None:
    """Launch kernel ``name`` over ``elems`` logits on the tensors' device, in one of the
    configurations :func:`candidates` allows (autotuned among them when there are several);
    ``pinned``: the batch-invariant mode's one configuration."""
    kernel = KERNELS[name]
    if _RECORDED is not None:
        _RECORDED.append((name, elems, args, kwargs))
        return
    if INTERPRET:
        meta = INTERPRETER.kwargs
        kernel.plain[(grid_of(meta),)](*args, **kwargs, **meta)
        return
    with torch.cuda.device(args[0].device):
        if pinned or elems < TUNE_MIN_ELEMS:
            one = pinned_config(name, kwargs) if pinned else TABLES[kernel.table]["small"]
            launch = {"num_warps": one.num_warps, "num_stages": one.num_stages}
            kernel.plain[(grid_of(one.kwargs),)](*args, **kwargs, **one.kwargs, **launch)
        else:
            kernel.tuned[lambda meta: (grid_of(meta),)](*args, **kwargs)


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------


class KernelHead:
    """One head of a call made kernel-ready: what every launch of the call shares (its
    tensors, scalars and constexprs, as the kernels name them)."""

    def __init__(self, rows: RowBatch, opts: KernelOptions) -> None:
        hidden, weight, bias, labels, temp = rows
        self.pinned = opts.schedule.padded  # the batch-invariant mode: one configuration
        self.hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
        self.weight = weight if weight.stride(-1) == 1 else weight.contiguous()
        self.bias = None if bias is None else bias.contiguous()
        self.labels = labels.contiguous()
        self.temp = None if temp is None else temp.float().contiguous()
        hd = opts.head_dtype
        if hd not in _TL_DTYPES:
            raise ValueError(f"backend='triton' runs fp32, bf16 or fp16 heads, got {hd}")
        # fp32 follows torch's matmul precision ("highest": IEEE, else TF32); the interpreter
        # always multiplies in IEEE fp32. 16-bit inputs under an fp32 head: their products are
        # exact in fp32, so the tensor cores multiply them as they are, accumulating in fp32.
        exact16 = hd == torch.float32 and _exact_16bit(self.hidden.dtype, self.weight.dtype)
        dot = _TL_DTYPES[self.hidden.dtype if exact16 else hd]
        ieee = INTERPRET or (
            hd == torch.float32
            and not exact16
            and torch.get_float32_matmul_precision() == "highest"
        )
        transform = opts.transform
        scalar_t = transform.temperature if transform.temperature is not None else 1.0
        self.inv_temp = 1.0 / scalar_t
        self.scale = 1.0 if transform.scale is None else float(transform.scale)
        self.softcap = 1.0 if transform.softcap is None else float(transform.softcap)
        self.meta = {
            "HAS_BIAS": bias is not None,
            "HAS_SCALE": transform.scale is not None,
            "HAS_SOFTCAP": transform.softcap is not None,
            "TEMP_MODE": 2 if temp is not None else (1 if scalar_t != 1.0 else 0),
            "HEAD_DTYPE": _TL_DTYPES[hd],
            # The interpreter's dot is wrong on 16-bit tiles: upcast them there (exact).
            "DOT_DTYPE": tl.float32 if INTERPRET else dot,
            "IEEE": ieee,
        }

    def sizes(self) -> tuple[int, int, int, int]:
        """V, K (the hidden width) and the hidden's and weight's row strides."""
        vocab, dim = self.weight.shape
        return vocab, dim, self.hidden.stride(0), self.weight.stride(0)

    def scalars(self) -> tuple[float, float, float]:
        """1/T (the scalar temperature's), the logit scale and the softcap."""
        return self.inv_temp, self.scale, self.softcap

    def tensors(self, r0: int, r1: int):
        """(hidden, weight, bias, labels, temperature) of rows [r0, r1), with placeholders for
        the absent optional tensors (never read: their constexpr flag is off)."""
        h = self.hidden[r0:r1]
        return (
            h,
            self.weight,
            self.bias if self.bias is not None else h,
            self.labels[r0:r1],
            self.temp[r0:r1] if self.temp is not None else h,
        )


def _exact_16bit(hidden: torch.dtype, weight: torch.dtype) -> bool:
    """Whether products of ``hidden`` and ``weight`` values are exact in 16-bit tensor-core
    dots under an fp32 head: both in one 16-bit dtype (their products fit fp32's mantissa)."""
    return hidden == weight and hidden in (torch.bfloat16, torch.float16)


def vocab_splits(rows: int, vocab: int, device: torch.device) -> int:
    """Vocabulary splits of the forward kernel: at least two waves of programs on the GPU, and
    a program count close to a multiple of the multiprocessors (a last, partly idle wave
    costs up to one program's time)."""
    if device.type != "cuda":
        return 3  # the interpreter: several splits, so the tests cover the merge
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    row_blocks = -(-rows // 128)
    most = max(1, min(64, -(-vocab // 256)))
    least = min(most, max(1, -(-2 * sms // row_blocks)))

    def efficiency(splits: int) -> float:
        programs = row_blocks * splits
        return programs / (-(-programs // sms) * sms) - 1e-3 * splits

    return max(range(least, most + 1), key=efficiency)


def row_passes(num_rows: int, opts: KernelOptions) -> list[tuple[int, int]]:
    """Rows per launch: the caller's ``chunk_size`` (None: every row); in the batch-invariant
    mode the schedule's fixed block (the rows padded to a multiple of it), so the splits, the
    backward's vocabulary chunk and cuBLAS's ``M`` never follow the call."""
    step = opts.schedule.rows if opts.schedule.padded else opts.chunk_size or max(num_rows, 1)
    return [(r, min(r + step, num_rows)) for r in range(0, num_rows, step)]


def _vocab_chunk(rows: int, vocab: int, itemsize: int) -> int:
    """Columns per backward chunk: the workspace budget, at least _MIN_VOCAB_CHUNK, aligned."""
    cols = _WORKSPACE_BYTES // max(1, rows * itemsize)
    cols = max(_MIN_VOCAB_CHUNK, cols // _CHUNK_ALIGN * _CHUNK_ALIGN)
    return min(vocab, cols)


#: ``(r0, r1, v0, dz)``: write d loss / d raw logits of rows ``[r0, r1)`` and columns
#: ``[v0, v0 + width)`` into the workspace ``dz`` ``[r1 - r0, width]`` (one kernel launch).
DzWriter = Callable[[int, int, int, torch.Tensor], None]


def head_grads(rows: RowBatch, opts: KernelOptions, needs: Needs, write_dz: DzWriter) -> HeadGrads:
    """Gradients for hidden [M, H], weight [V, H] and bias [V] (in those tensors' dtypes) of
    the logit gradient that ``write_dz`` writes chunk by chunk into a bounded workspace (in
    the head dtype): cuBLAS multiplies each chunk out into dW, dh (fp32) and db. Shared by
    every op whose backward is "recompute the tile, form dz" (the log-prob op, the divergence).
    """
    hidden, weight, bias = rows.hidden, rows.weight, rows.bias
    num_rows, dim = hidden.shape
    vocab = weight.shape[0]
    dev = hidden.device
    hd = opts.head_dtype
    need_h, need_w, need_b = needs[0], needs[1], needs[2] and bias is not None
    passes = row_passes(num_rows, opts)
    one_pass = len(passes) <= 1
    # dW: written once per vocab chunk when one pass covers every row and each chunk's product
    # comes out in dW's dtype or in fp32 (rounded once as it is stored), else summed in fp32
    # (add_product); with a caller's buffer (opts.weight_grad_into), added into it.
    dw = db = dh = None
    into = opts.weight_grad_buffer if need_w else None
    w_dtype, h_dtype = opts.grad_dtype(weight.dtype), opts.grad_dtype(hidden.dtype)
    direct = one_pass and into is None and hd in (w_dtype, opts.compute_dtype)
    if into is not None:
        dw = into
    elif need_w:
        dw = (
            torch.empty_like(weight, dtype=w_dtype)
            if direct
            else weight.new_zeros((vocab, dim), dtype=opts.compute_dtype)
        )
    if need_b:
        db = torch.zeros(vocab, device=dev)
    if need_h and not one_pass:
        dh = torch.empty_like(hidden, dtype=h_dtype)
    if num_rows == 0:
        dh = torch.zeros_like(hidden, dtype=h_dtype) if need_h else None
        dw = None if dw is None or into is not None else dw.zero_().to(w_dtype)
        return dh, dw, None if db is None else db.to(opts.grad_dtype(bias.dtype))

    h_all = hidden.to(hd)
    dh_acc = None
    for r0, r1 in passes:
        rows = r1 - r0
        vc = _vocab_chunk(rows, vocab, torch.finfo(hd).bits // 8)
        workspace = torch.empty(rows * vc, device=dev, dtype=hd)
        h_rows = h_all[r0:r1]
        # The hidden gradient of these rows sums over vocab chunks: in fp32.
        dh_acc = torch.zeros(rows, dim, device=dev) if need_h else None
        for v0 in range(0, vocab, vc):
            width = min(vc, vocab - v0)
            dz = workspace[: rows * width].view(rows, width)
            write_dz(r0, r1, v0, dz)
            if db is not None:
                db[v0 : v0 + width] += dz.sum(0, dtype=torch.float32)
            if dw is not None:
                if not direct:
                    add_product(dw[v0 : v0 + width], dz.t(), h_rows)
                elif dw.dtype == hd:
                    torch.mm(dz.t(), h_rows, out=dw[v0 : v0 + width])
                else:
                    dw[v0 : v0 + width] = dz.t() @ h_rows
            if dh_acc is not None:
                add_product(dh_acc, dz, weight[v0 : v0 + width].to(hd))
        del workspace, dz  # before dh is allocated: the peak is dW + fp32 dh + workspace
        if dh_acc is not None:
            if opts.vocab_parallel is not None:
                opts.vocab_parallel.reduce_hidden(dh_acc)
            if one_pass:
                dh = dh_acc.to(h_dtype)  # allocated after the workspace is freed
            else:
                dh[r0:r1] = dh_acc
        del dh_acc
    if into is not None:
        dw = None
    elif dw is not None and dw.dtype != w_dtype:
        dw = dw.to(w_dtype)
    return dh, dw, None if db is None else db.to(opts.grad_dtype(bias.dtype))


__all__ = ["FAMILIES", "candidates", "head_grads", "launch", "recording", "register"]
