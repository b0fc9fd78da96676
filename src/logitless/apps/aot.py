"""Ahead-of-time compile check of every Triton kernel, for GPUs that are not here.

Triton compiles for a target without a device (``triton.compile(ASTSource(...),
target=GPUTarget("cuda", 90, 32))``: PTX, then a cubin through the ``ptxas`` Triton ships), and
``ptxas`` reports each kernel's registers, spills and the shared memory Triton laid out. This
module compiles, for sm_80 (A100), sm_90 (H100) and sm_100 (B200), every launch the launchers
make and every configuration they can select for it, and checks that each can launch there:

- the launches come from the launchers themselves: :func:`record` runs the host code
  (``forward_rows`` / ``backward_rows`` of the log-prob op and of the divergence) on ``meta``
  tensors inside :func:`~logitless.backends.triton_launch.recording`, so the kernels, their
  argument lists and constexprs are whatever the code passes today;
- the configurations come from the launcher's rule,
  :func:`~logitless.backends.triton_launch.candidates`, given the target's shared memory;
- the kernels are those of every family in
  :data:`~logitless.backends.triton_launch.FAMILIES`, registered by importing it;
- the argument types and alignment come from Triton's own specialization of each argument
  (pointers assumed 16-byte aligned, as the caching allocator gives them).

A launch fails when it does not compile, when it needs more shared memory than its target has
per block (163 KB on sm_80, 227 KB on sm_90 and sm_100) or more than 255 registers, and, for
the headline problem (bf16, H = 3584, V = 152064), when it spills. What it cannot tell: speed,
and numbers (the interpreter tests check those).

Run ``python -m logitless.apps.aot --report`` (the table) or ``--check`` (exit status 1 on
a failure). It must run without ``TRITON_INTERPRET`` (the kernels are built at import); the
test and ``benchmarks/triton_compile_report.py`` start it in a process of its own. Results are
cached per compiled source, target and options (``--cache``): an unchanged kernel is not
compiled again.

A tool built on the kernel layer, so an app: it imports :mod:`logitless.backends`, which never
imports it.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import io
import json
import multiprocessing
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from ..contract.backend import interpreting

# Targets: (compute capability, shared memory per block with opt-in, bytes).
TARGETS = {"sm_80": (80, 163 * 1024), "sm_90": (90, 227 * 1024), "sm_100": (100, 227 * 1024)}
MAX_REGISTERS = 255
# The headline problem: its launches must not spill.
HEADLINE = {"hidden": 3584, "vocab": 152064, "dtype": "bf16"}
_ROWS_TUNED = 4096  # rows of a call large enough to autotune (rows x V >= 2^26)
_ROWS_SMALL = 64  # rows of a call that runs the fixed small configuration
# An odd hidden width: the masked-K loads and unaligned row strides (not the headline: a spill
# there is reported, not failed).
_ODD_HIDDEN = 3583
_TEACHER_HIDDEN = 4096


@dataclass(frozen=True)
class Setup:
    """The dtypes of one head: hidden, weight, head (projection) dtype, fp32 matmul precision."""

    name: str
    hidden: torch.dtype
    weight: torch.dtype
    head: torch.dtype
    precision: str = "highest"


_BF16, _FP16, _FP32 = torch.bfloat16, torch.float16, torch.float32
SETUPS = [
    Setup("bf16", _BF16, _BF16, _BF16),
    Setup("fp16", _FP16, _FP16, _FP16),
    Setup("fp32", _FP32, _FP32, _FP32),
    Setup("tf32", _FP32, _FP32, _FP32, "high"),
    Setup("fp32>bf16", _FP32, _FP32, _BF16),
    Setup("bf16>fp32", _BF16, _BF16, _FP32),
]
# Transform variants: none; every flag on (bias, scale, softcap, per-row temperature: the most
# live values); a scalar temperature (the third TEMP_MODE).
VARIANTS = {"none": {}, "all": {"bias": True, "scale": 0.5, "softcap": 30.0, "temp": "rows"}}
VARIANTS["temp"] = {"temp": 0.7}


@dataclass(frozen=True)
class Job:
    """One compile: a kernel, its signature / constexprs / attributes, a launch configuration."""

    kernel: str
    setup: str
    variant: str
    path: str  # "small" (fixed configuration) or "tuned"
    config: str
    signature: tuple
    constexprs: tuple
    attrs: tuple
    num_warps: int
    num_stages: int

    @property
    def headline(self) -> bool:
        return self.setup == HEADLINE["dtype"] and not self.variant.startswith("odd")


# --------------------------------------------------------------------------------------------
# The launches, as the launchers make them
# --------------------------------------------------------------------------------------------


def _launcher():
    """:mod:`logitless.backends.triton_launch` with every kernel family's kernels registered
    (each family registers its kernels when it is imported)."""
    import importlib

    from ..backends import triton_launch

    for family in triton_launch.FAMILIES:
        importlib.import_module(family)
    return triton_launch


def _head(setup: Setup, rows: int, hidden: int, variant: dict, entropy: bool):
    """A RowBatch and KernelOptions of meta tensors."""
    from ..backends.base import KernelOptions, RowBatch, Schedule
    from ..transform import LogitTransform

    vocab = HEADLINE["vocab"]
    meta = {"device": "meta"}
    temp = variant.get("temp")
    batch = RowBatch(
        torch.empty(rows, hidden, dtype=setup.hidden, **meta),
        torch.empty(vocab, hidden, dtype=setup.weight, **meta),
        torch.empty(vocab, dtype=setup.weight, **meta) if variant.get("bias") else None,
        torch.empty(rows, dtype=torch.int64, **meta),
        torch.empty(rows, **meta) if temp == "rows" else None,
    )
    transform = LogitTransform(
        scale=variant.get("scale"),
        softcap=variant.get("softcap"),
        temperature=temp if isinstance(temp, float) else 1.0,
    )
    opts = KernelOptions(transform, entropy, setup.head, Schedule(rows, vocab), backend="triton")
    return batch, opts


def _record_head(setup: Setup, rows: int, variant: dict, entropy: bool, grads: str, hidden: int):
    from ..backends import triton_kernels as tk
    from ..backends.base import RowStats, Upstream
    from ..backends.triton_launch import recording

    batch, opts = _head(setup, rows, hidden, variant, entropy)
    with recording() as launches:
        tk.forward_rows(batch, opts)
        vec = torch.empty(rows, device="meta")
        stats = RowStats(vec, vec, vec if entropy else None)
        up = Upstream(vec if "g" in grads else None, vec if "e" in grads else None)
        tk.backward_rows(batch, stats, up, opts, (True, True, True))
    return launches


def _record_divergence(
    setup: Setup, rows: int, variant: dict, entropy: bool, mode: str, hidden: int
):
    from ..backends import triton_divergence as dk
    from ..backends.base import DivOptions, DivRows, DivStats, DivUpstream
    from ..backends.triton_launch import recording

    student, s_opts = _head(setup, rows, hidden, variant, entropy)
    teacher, t_opts = _head(setup, rows, _TEACHER_HIDDEN + hidden % 16, variant, False)
    teacher = teacher._replace(temperature=student.temperature)
    beta = {"forward": 0.0, "reverse": 1.0, "jsd": 0.5}[mode]
    div_rows = DivRows(student, teacher, None)
    opts = DivOptions(s_opts, t_opts, mode, beta)
    with recording() as launches:
        dk.forward_rows(div_rows, opts)
        vec = torch.empty(rows, device="meta")
        fields = dict.fromkeys(DivStats._fields, vec) | {"entropy": vec if entropy else None}
        stats = DivStats(**fields)
        up = DivUpstream(vec, vec, vec if entropy else None)
        dk.backward_rows(div_rows, stats, up, opts, (True, True, True))
    return launches


# The divergence's heads run the log-prob kernels' tile code: its resources depend on the dot
# kind and the operand size, which these three setups span (2-byte tensor cores, 4-byte tensor
# cores, IEEE fp32).
DIVERGENCE_SETUPS = ("bf16", "tf32", "fp32")


def scenarios():
    """``(setup, variant, small, recorded launches)`` of every scenario the check covers.

    Resources: for every setup, every transform flag and entropy on (the most live values), at
    a size that autotunes (every tuned configuration) and a small one. Code paths: the flags
    off, and for the headline dtype the remaining flag values (scalar temperature, entropy
    without its gradient, each upstream gradient alone), at the small size (one configuration
    each); for the headline dtype an odd hidden width too (masked K, unaligned strides). The
    divergence likewise in its three modes, for ``DIVERGENCE_SETUPS``.
    """
    out = []
    for setup in SETUPS:
        both, small = (_ROWS_SMALL, _ROWS_TUNED), (_ROWS_SMALL,)
        hidden = HEADLINE["hidden"]
        variants = [("all", True, "ge", both, hidden), ("none", False, "g", small, hidden)]
        if setup.name == HEADLINE["dtype"]:
            variants += [("temp", True, "e", small, hidden), ("none", True, "g", small, hidden)]
            variants += [("all", True, "ge", both, _ODD_HIDDEN)]
        torch.set_float32_matmul_precision(setup.precision)
        try:
            for name, entropy, grads, sizes, width in variants:
                v = VARIANTS[name]
                label = name if width == hidden else f"odd H, {name}"
                for rows in sizes:
                    rec = _record_head(setup, rows, v, entropy, grads, width)
                    out.append((setup, label, rec))
                    if setup.name not in DIVERGENCE_SETUPS:
                        continue
                    for mode in ("forward", "reverse", "jsd"):
                        rec = _record_divergence(setup, rows, v, entropy, mode, width)
                        out.append((setup, label, rec))
        finally:
            torch.set_float32_matmul_precision("highest")
    return out


def _bind(fn, args: tuple, kwargs: dict) -> dict:
    names = fn.arg_names
    return {**dict(zip(names, args, strict=False)), **kwargs}


def jobs(target: str, recorded=None) -> list[Job]:
    """Every (launch, configuration) of :func:`scenarios` (or of ``recorded``, its result) for
    ``target``, without repeats."""
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import native_specialize_impl

    tk = _launcher()

    limit = TARGETS[target][1]
    seen: dict[tuple, Job] = {}
    for setup, variant, launches in recorded if recorded is not None else scenarios():
        for name, elems, args, kwargs in launches:
            kernel = tk.KERNELS[name]
            heur = getattr(kernel.plain, "values", {})
            fn = getattr(kernel.plain, "fn", kernel.plain)
            bound = _bind(fn, args, kwargs)
            path = "small" if elems < tk.TUNE_MIN_ELEMS else "tuned"
            configs = tk.candidates(name, elems, bound, limit)
            if path == "tuned":  # and the batch-invariant mode's one configuration
                pinned = tk.candidates(name, elems, bound, limit, pinned=True)
                configs += [c for c in pinned if c not in configs]
            for cfg in configs:
                full = {**bound, **cfg.kwargs}
                full |= {k: f(full) for k, f in heur.items()}
                sig, const, attrs = [], [], []
                for i, p in enumerate(fn.params):
                    value = full[p.name]
                    if p.is_constexpr:
                        sig.append("constexpr")
                        const.append((i, _constexpr_repr(value)))
                        continue
                    ty, attr = native_specialize_impl(CUDABackend, value, False, True, True)
                    sig.append(ty)
                    if ty == "constexpr":
                        const.append((i, value))
                    elif attr == "D":
                        attrs.append(i)
                k = cfg.kwargs
                label = f"{k['BLOCK_M']}x{k['BLOCK_N']}x{k['BLOCK_K']}"
                label += f" w{cfg.num_warps} s{cfg.num_stages}"
                job = Job(name, setup.name, variant, path, label, tuple(sig), tuple(const),
                          tuple(attrs), cfg.num_warps, cfg.num_stages)  # fmt: skip
                ident = (job.kernel, job.signature, job.constexprs, job.attrs, label, job.setup)
                if ident not in seen or (job.headline and not seen[ident].headline):
                    seen[ident] = job
    return list(seen.values())


def _constexpr_repr(value):
    """Constexprs as plain data (tl dtypes by name) for hashing and pickling."""
    import triton.language as tl

    names = {tl.float32: "float32", tl.bfloat16: "bfloat16", tl.float16: "float16"}
    return f"tl.{names[value]}" if isinstance(value, tl.dtype) else value


def _constexpr_value(value):
    import triton.language as tl

    if isinstance(value, str) and value.startswith("tl."):
        return getattr(tl, value[3:])
    return value


# --------------------------------------------------------------------------------------------
# Compiling
# --------------------------------------------------------------------------------------------


def _source(job: Job):
    from triton.compiler import ASTSource

    plain = _launcher().KERNELS[job.kernel].plain
    fn = getattr(plain, "fn", plain)
    names = fn.arg_names
    return ASTSource(
        fn=fn,
        signature=dict(zip(names, job.signature, strict=True)),
        constexprs={(i,): _constexpr_value(v) for i, v in job.constexprs},
        attrs={(i,): [["tt.divisibility", 16]] for i in job.attrs},
    )


@functools.cache
def _kernel_source(kernel: str) -> str:
    """The source of kernel ``kernel`` and of every ``@triton.jit`` function it calls, directly
    or not, by its name or through a module (``tiles.logits_tile(...)``). Triton's own key
    also holds their line numbers: an edit above a kernel would recompile it."""
    import triton

    plain = _launcher().KERNELS[kernel].plain
    todo, seen, parts = [getattr(plain, "fn", plain)], set(), []
    while todo:
        fn = todo.pop()
        if fn in seen:
            continue
        seen.add(fn)
        parts.append(fn.src)
        for name in sorted(set(re.findall(r"\b([\w.]+)\s*\(", fn.src))):
            first, *attrs = name.split(".")
            dep = fn.fn.__globals__.get(first)
            for attr in attrs:
                dep = getattr(dep, attr, None)
            if isinstance(dep, triton.runtime.JITFunction):
                todo.append(dep)
    return "\n".join(parts)


def _cache_key(job: Job, target: str) -> str:
    """Kernel sources, signature, constexprs, alignment, options, target and Triton version."""
    import triton

    fields = [job.kernel, job.signature, job.constexprs, job.attrs, job.num_warps, job.num_stages]
    text = [_kernel_source(job.kernel), *fields, target, triton.__version__]
    return hashlib.sha256(json.dumps(text, default=str).encode()).hexdigest()[:32]


def _family(ptx: str) -> str:
    if "tcgen05.mma" in ptx:
        return "tcgen05"
    if "wgmma.mma_async" in ptx:
        return "wgmma"
    if re.search(r"\bmma\.sync", ptx):
        return "mma.sync"
    return "fma"


def compile_job(job: Job, target: str, cache: Path) -> dict:
    """Compile ``job`` for ``target`` (or read its cached result): registers, spill bytes
    (stores + loads), shared memory bytes, tensor-core instruction family, or the error."""
    import triton
    from triton.backends.compiler import GPUTarget

    key = _cache_key(job, target)
    path = cache / f"{key}.json"
    if path.exists():
        return json.loads(path.read_text())
    triton.knobs.nvidia.dump_ptxas_log = True
    triton.knobs.compilation.always_compile = True  # ptxas must run: its log is the source
    capability = TARGETS[target][0]
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(
                _source(job),
                target=GPUTarget("cuda", capability, 32),
                options={"num_warps": job.num_warps, "num_stages": job.num_stages},
            )
    except Exception as exc:  # a compile error is a result to report
        result = {"error": f"{type(exc).__name__}: {str(exc)[:2000]}"}
    else:
        text = log.getvalue()
        regs = re.search(r"Used (\d+) registers", text)
        spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
        result = {
            "registers": int(regs.group(1)) if regs else -1,
            "spill": sum(map(int, spill.groups())) if spill else -1,
            "shared": int(compiled.metadata.shared),
            "family": _family(compiled.asm["ptx"]),
        }
    path.write_text(json.dumps(result))
    return result


_POOL_JOBS: list = []


def _work(i: int) -> dict:
    job, target, cache = _POOL_JOBS[i]
    return compile_job(job, target, cache)


def run(targets=tuple(TARGETS), cache: Path | None = None, workers: int | None = None):
    """``[(job, target, result)]`` of every job on every target, compiled ``workers`` at a
    time (cached results are read, not compiled)."""
    cache = Path(cache or Path.home() / ".cache" / "logitless-aot")
    cache.mkdir(parents=True, exist_ok=True)
    import triton

    triton.knobs.cache.dir = str(cache / "triton")
    recorded = scenarios()
    work = [(job, t, cache) for t in targets for job in jobs(t, recorded)]
    _POOL_JOBS[:] = work
    done = {p.stem for p in cache.glob("*.json")}
    todo = [i for i, (job, t, _) in enumerate(work) if _cache_key(job, t) not in done]
    todo.sort(key=lambda i: not work[i][0].headline)  # the headline's first: it fails most
    if todo:
        ctx = multiprocessing.get_context("fork")
        with ctx.Pool(workers or min(len(todo), os.cpu_count() or 1)) as pool:
            pool.map(_work, todo, chunksize=1)
    return [(job, t, compile_job(job, t, cache)) for job, t, _ in work]


def failures(results) -> list[str]:
    """What cannot launch (compile error, shared memory or registers over the target's limit)
    and what spills on the headline problem."""
    bad = []
    for job, target, r in results:
        where = f"{job.kernel} [{job.setup}, {job.variant}, {job.path}] {job.config} on {target}"
        if "error" in r:
            bad.append(f"{where}: does not compile: {' '.join(r['error'].split())[:400]}")
            continue
        if r["shared"] > TARGETS[target][1]:
            bad.append(f"{where}: {r['shared']} B of shared memory, limit {TARGETS[target][1]}")
        if not 0 < r["registers"] <= MAX_REGISTERS:
            bad.append(f"{where}: {r['registers']} registers")
        if job.headline and r["spill"] != 0:
            bad.append(f"{where}: spills {r['spill']} B (headline problem)")
    return bad


def table(results, setups=None) -> str:
    """A markdown table, one row per kernel, dtype setup, path and configuration, one column
    per target: registers / spill bytes / shared KB / tensor-core family, each the worst over
    the transform variants."""
    targets = sorted({t for _, t, _ in results}, key=list(TARGETS).index)
    rows: dict[tuple, dict] = {}
    for job, target, r in results:
        if setups and job.setup not in setups:
            continue
        setup = job.setup + (", odd H" if job.variant.startswith("odd") else "")
        cell = rows.setdefault((job.kernel, setup, job.path, job.config), {})
        agg = cell.setdefault(target, {"registers": 0, "spill": 0, "shared": 0, "family": set()})
        if "error" in r:
            agg["family"].add("ERROR")
            continue
        for f in ("registers", "spill", "shared"):
            agg[f] = max(agg[f], r[f])
        agg["family"].add(r["family"])
    lines = [
        "| kernel | dtypes | path | config | " + " | ".join(targets) + " |",
        "|---|---|---|---|" + "---|" * len(targets),
    ]
    for (kernel, setup, path, config), cells in rows.items():
        out = []
        for t in targets:
            a = cells.get(t)
            if a is None:  # not selectable there (its shared memory)
                out.append("–")
                continue
            fam = "/".join(sorted(a["family"]))
            out.append(f"{a['registers']} / {a['spill']} / {a['shared'] / 1024:.0f} / {fam}")
        lines.append(f"| {kernel} | {setup} | {path} | {config} | " + " | ".join(out) + " |")
    return "\n".join(lines)


def _as_json(results) -> dict:
    """The results and each kernel's autotune key, as plain data."""
    tk = _launcher()

    rows = [
        {"kernel": j.kernel, "setup": j.setup, "variant": j.variant, "path": j.path,
         "config": j.config, "target": t, "headline": j.headline, **r}
        for j, t, r in results
    ]  # fmt: skip
    keys = {name: list(k.tuned.keys) for name, k in tk.KERNELS.items()}
    return {"results": rows, "keys": keys, "failures": failures(results)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", action="store_true", help="print the table")
    parser.add_argument("--check", action="store_true", help="exit 1 on a failure")
    parser.add_argument("--setup", action="append", help="report only these dtype setups")
    parser.add_argument("--cache", type=Path, default=None)
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--target", action="append", choices=list(TARGETS))
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    ns = parser.parse_args(argv)
    if interpreting():  # Triton would build interpreted functions, which do not compile
        print("run without TRITON_INTERPRET=1 (the kernels are built at import)", file=sys.stderr)
        return 2
    results = run(tuple(ns.target or TARGETS), ns.cache, ns.workers)
    if ns.report:
        print(table(results, ns.setup))
    if ns.json:
        ns.json.write_text(json.dumps(_as_json(results)))
    bad = failures(results)
    print(f"{len(results)} compiles, {len(bad)} failures", file=sys.stderr)
    for line in bad:
        print("FAIL", line, file=sys.stderr)
    return 1 if (ns.check and bad) else 0


if __name__ == "__main__":
    sys.exit(main())
