"""Every Triton kernel compiled ahead of time for sm_80, sm_90 and sm_100, no GPU needed.

:mod:`logitless.apps.aot` records the launches the launchers make (on meta tensors), takes
the configurations their rule can select for each target, compiles each with Triton's
``ptxas`` and reads registers, spills, shared memory and the tensor-core instructions. It runs
in a process of its own, without ``TRITON_INTERPRET`` (the kernels are built at import), and
caches each result in the user's cache directory (``$XDG_CACHE_HOME/logitless/aot``, default
``~/.cache/logitless/aot``: kept across checkouts and CI clones on one machine), keyed on the
compiled source, its callees, target, options and the Triton version: an unchanged kernel is
not compiled again (cold: ~560 compiles, ~10 minutes on 2 busy cores; warm: 5 seconds).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

from logitless.apps import aot  # noqa: E402

# Compiles for minutes when cold: out of the first check (``-m "not slow"``).
pytestmark = pytest.mark.slow

SOFTCAP_FLAGS = {"HAS_BIAS", "HAS_SCALE", "HAS_SOFTCAP", "TEMP_MODE"}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """The check's JSON output: results of every compile, each kernel's autotune key and the
    failures."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    cache = os.path.join(root, "logitless", "aot")
    os.makedirs(cache, exist_ok=True)
    out = tmp_path_factory.mktemp("aot") / "results.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "logitless.apps.aot", "--cache", str(cache)]
    cmd += ["--json", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3000)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_the_cache_key_holds_the_tile_code_a_kernel_calls():
    """A kernel's cached result is keyed on its source and on every tile function it calls,
    directly or not (``logits_tile``, the programs' prologues and ``grouped`` under them): an
    edit there compiles again. A call through a module (``tiles.logits_tile(...)``, as the
    families called the tile code before) was left out of the key, so an edited tile function
    kept its stale results."""
    kernels = ["stats", "dz", "div_stats", "jsd", "div_dz"]
    code = (
        "from logitless.apps import aot\n"
        f"for k in {kernels}:\n"
        "    src = aot._kernel_source(k)\n"
        "    print(all(f'def {f}(' in src for f in ('logits_tile', 'grouped')))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.split() == ["True"] * len(kernels), proc.stdout


def _select(data, **match):
    rows = [r for r in data["results"] if all(r[k] == v for k, v in match.items())]
    assert rows, f"no compile matches {match}"
    return rows


def test_every_launch_compiles_fits_and_the_headline_does_not_spill(compiled):
    """Every kernel, setup and selectable configuration on every target: compiles, within the
    target's shared memory and 255 registers; no spill on the headline problem (bf16)."""
    assert compiled["failures"] == []
    kernels = {r["kernel"] for r in compiled["results"]}
    assert kernels == {"stats", "dz", "div_stats", "jsd", "div_dz"}
    assert {r["target"] for r in compiled["results"]} == set(aot.TARGETS)


@pytest.mark.parametrize("setup", ["tf32", "fp32>bf16"])
def test_large_fp32_operand_calls_fit_an_a100(compiled, setup):
    """An fp32 head under TF32, and fp32 weights under a bf16 head, with >= 2^26 logits: the
    autotuner's configurations are pruned by the real (4-byte) operand size. Before: the 2-byte
    tensor-core tiles were kept, 192-384 KB of shared memory on a 163 KB A100 (OutOfResources
    at launch)."""
    rows = _select(compiled, kernel="stats", setup=setup, path="tuned", target="sm_80")
    assert all(r["shared"] <= aot.TARGETS["sm_80"][1] for r in rows), rows
    assert {r["family"] for r in rows} == {"mma.sync"}


def test_16bit_products_under_an_fp32_head_use_tensor_cores(compiled):
    """bf16 inputs with ``head_dtype=float32``: the products are exact in fp32, so the dot runs
    on the tensor cores (was: IEEE fp32 on the FMA units)."""
    family = {"sm_80": "mma.sync", "sm_90": "wgmma", "sm_100": "tcgen05"}
    for target, expected in family.items():
        rows = _select(compiled, kernel="stats", setup="bf16>fp32", target=target)
        assert {r["family"] for r in rows} == {expected}, (target, rows)


def test_autotune_keys_hold_every_launch_constexpr(compiled):
    """A configuration tuned without softcap (or bias, scale, temperature) is not reused with
    it: the transform flags are part of every kernel's autotune key."""
    keys = compiled["keys"]
    for name in ("stats", "dz"):
        assert SOFTCAP_FLAGS | {"K", "HEAD_DTYPE", "IEEE"} <= set(keys[name]), keys[name]
    for name in ("div_stats", "jsd", "div_dz"):
        student = {f"S_{f}" for f in SOFTCAP_FLAGS - {"TEMP_MODE"}}
        teacher = {f"T_{f}" for f in SOFTCAP_FLAGS - {"TEMP_MODE"}}
        assert student | teacher | {"TEMP_MODE", "Ks", "Kt"} <= set(keys[name]), keys[name]


def test_the_divergence_is_autotuned(compiled):
    """The divergence's kernels run their own table: several configurations at a large size."""
    for name in ("div_stats", "jsd", "div_dz"):
        rows = _select(compiled, kernel=name, setup="bf16", path="tuned", target="sm_90")
        assert len({r["config"] for r in rows}) >= 2, rows


def _job(setup="bf16", kernel="stats"):
    return aot.Job(kernel, setup, "all", "tuned", "128x128x64 w8 s3", (), (), (), 8, 3)


def test_the_check_rejects_what_cannot_launch():
    """The check itself: a compile error, shared memory or registers over the target's limit,
    a spill on the headline problem each fail; a spill elsewhere does not."""
    ok = {"registers": 200, "spill": 0, "shared": 98304, "family": "wgmma"}
    cases = [
        (_job(), "sm_90", {"error": "CompilationError: at 12:4: bad"}),
        (_job(), "sm_80", {**ok, "shared": 163 * 1024 + 1}),
        (_job(), "sm_90", {**ok, "registers": 256}),
        (_job(), "sm_100", {**ok, "spill": 8}),
    ]
    bad = aot.failures(cases)
    assert len(bad) == 4 and "does not compile" in bad[0] and "shared memory" in bad[1]
    assert aot.failures([(_job(), "sm_90", ok), (_job("fp32"), "sm_90", {**ok, "spill": 8})]) == []


def test_the_autotuner_prunes_by_the_operand_size_on_the_device(monkeypatch):
    """The autotuner's prune (what runs on a GPU) keeps only the configurations whose operand
    tiles fit the device at the loaded operand size: fp32 weights under a bf16 head on an
    A100 keep fewer than bf16 weights do, and every kept one fits."""
    import torch

    from logitless.backends import triton_kernels  # noqa: F401 (registers its kernels)
    from logitless.backends import triton_launch as tk

    a100 = aot.TARGETS["sm_80"][1]
    monkeypatch.setattr(tk, "_shared_limit", lambda index: a100)
    kept = {}
    for dtype in (torch.bfloat16, torch.float32):
        h = torch.empty(4, 8, dtype=dtype)
        kept[dtype] = tk._prune("stats", [], {"h_ptr": h, "w_ptr": h}, IEEE=False)
        size = h.element_size()
        assert all(tk.shared_bytes(c, size) <= a100 for c in kept[dtype])
    assert 0 < len(kept[torch.float32]) < len(kept[torch.bfloat16])
