"""``batch_invariant=True``: a token's results are the same bits whatever else is in the call.

Probe tokens are placed among other tokens (none to ~1000 of them, permuted, 0% to 90%
ignored, the call cut by the caller into chunks), with and without gradients, and their
outputs must have zero differing bits from the probes computed alone; the log-probs inside
``fused_policy_loss`` and ``linear_divergence`` must be the bits ``linear_logprobs`` gives,
so a PPO ratio on unchanged weights is exactly 1.0; each row's hidden gradient is the same
bits for the same upstream gradient and two runs give the same weight gradient bit for bit.
V = 20000 is wider than the CPU tile (16384 columns): every row crosses a vocabulary-block
boundary, so the online merge is covered. The Triton kernels run in the interpreter, whose
``tl.dot`` goes through numpy (a row's bits there depend on its place in a 16-row tile): for
them the tests check that the schedule (configuration, grid, splits) does not depend on the
rows; only a GPU can show the bits (tests/test_cuda.py runs these tests there).
"""

from __future__ import annotations

import pytest
import torch

import logitless
from logitless import PolicyLossConfig
from logitless.backends import base
from logitless.backends.base import Schedule

H, V = 32, 20000
P = 6  # probe tokens
DTYPES = [torch.float32, torch.bfloat16]
# (other tokens, share of them ignored): from a probe alone to ~1000 rows, mostly ignored
CONTEXTS = [(1, 0.0), (63, 0.9), (300, 0.0), (999, 0.5)]


def _head(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(V, H, generator=g) * 0.5).to(dtype)
    bias = (torch.randn(V, generator=g) * 0.1).to(dtype)
    return weight, bias


def _probes(dtype):
    g = torch.Generator().manual_seed(1)
    return torch.randn(P, H, generator=g).to(dtype), torch.randint(0, V, (P,), generator=g)


def _context(n_other: int, ignored: float, dtype, seed: int):
    """Probes placed among ``n_other`` other rows (a share ``ignored`` of them ignored) in a
    random order; returns hidden [N, H], labels [N] and the probes' positions [P]."""
    g = torch.Generator().manual_seed(100 + seed)
    hp, yp = _probes(dtype)
    ho = torch.randn(n_other, H, generator=g).to(dtype)
    yo = torch.randint(0, V, (n_other,), generator=g)
    yo[torch.rand(n_other, generator=g) < ignored] = -100
    hidden, labels = torch.cat([hp, ho]), torch.cat([yp, yo])
    order = torch.randperm(P + n_other, generator=g)
    where = torch.empty_like(order)
    where[order] = torch.arange(P + n_other)
    return hidden[order], labels[order], where[:P]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    as_int = torch.int32 if a.element_size() == 4 else torch.int16
    differ = a.reshape(-1).view(as_int) != b.reshape(-1).view(as_int)
    assert int(differ.sum()) == 0, f"{int(differ.sum())} of {a.numel()} values differ in bits"


def _logprobs(hidden, labels, weight, bias, **kw):
    kw = {"with_entropy": True, "backend": "torch", "batch_invariant": True, **kw}
    return logitless.linear_logprobs(hidden, weight, labels, bias=bias, **kw)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_schedule_is_the_same_for_every_row_count(dtype):
    """The one place that cuts the work gives the same schedule for 1 to 5000 rows (and any
    chunk_size), for the log-prob op and the fused loss alike."""
    cpu = torch.device("cpu")
    for vocab in (1000, V, 151936):
        ref = Schedule.choose(1, vocab, cpu, None, invariant=True)
        assert ref.padded and ref.vocab_block <= vocab
        for n in (2, 7, 128, 129, 1000, 5000):
            for chunk in (None, 1, 64, 4096):
                assert Schedule.choose(n, vocab, cpu, chunk, invariant=True) == ref
                assert Schedule.choose(n, vocab, cpu, chunk, invariant=True, fused=True) == ref
        assert {ref.padding(n) + n for n in (1, ref.rows)} == {ref.rows}


def test_default_schedule_width_does_not_follow_the_row_count():
    """The default mode: the tile width from the vocabulary and device alone, and the fused
    loss on the log-prob op's width (its rows bounded by memory)."""
    cpu = torch.device("cpu")
    for vocab in (1000, V, 151936):
        widths = {Schedule.choose(n, vocab, cpu, None).vocab_block for n in (1, 37, 512, 9000)}
        fused = {
            Schedule.choose(n, vocab, cpu, None, fused=True).vocab_block for n in (1, 37, 9000)
        }
        assert len(widths) == 1 and fused == widths


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_logprobs_probe_bits_do_not_depend_on_the_batch(dtype):
    weight, bias = _head(dtype)
    hp, yp = _probes(dtype)
    alone = [_logprobs(hp[i : i + 1], yp[i : i + 1], weight, bias) for i in range(P)]
    ref_lp = torch.cat([a.logprobs for a in alone])
    ref_ent = torch.cat([a.entropy for a in alone])
    for seed, (n, ignored) in enumerate(CONTEXTS):
        hidden, labels, at = _context(n, ignored, dtype, seed)
        out = _logprobs(hidden, labels, weight, bias)
        _same_bits(out.logprobs[at], ref_lp)
        _same_bits(out.entropy[at], ref_ent)
    # the caller's chunking: the same rows in pieces of 1, 7, 100 and the rest
    hidden, labels, at = _context(400 - P, 0.3, dtype, 7)
    cuts = [1, 7, 100, 292]
    pieces = [
        _logprobs(h, y, weight, bias)
        for h, y in zip(hidden.split(cuts), labels.split(cuts), strict=True)
    ]
    _same_bits(torch.cat([p.logprobs for p in pieces])[at], ref_lp)
    _same_bits(torch.cat([p.entropy for p in pieces])[at], ref_ent)
    # a [B, T] layout and a chunk_size change nothing
    out = _logprobs(hidden.view(8, 50, H), labels.view(8, 50), weight, bias, chunk_size=3)
    _same_bits(out.logprobs.view(-1)[at], ref_lp)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gradients_dh_bits_per_row_and_dw_run_to_run(dtype):
    """With gradients: the same forward bits as without; each probe's dh the same bits for the
    same upstream gradient in any batch; dW (a sum over rows) the same bits run to run."""
    weight, bias = _head(dtype)
    hp, yp = _probes(dtype)
    up_lp, up_ent = torch.linspace(-1, 1, P), torch.linspace(0.5, -0.3, P)
    ref_lp = _logprobs(hp, yp, weight, bias).logprobs

    def run(hidden, labels, at, seed):
        h = hidden.clone().requires_grad_(True)
        w = weight.clone().requires_grad_(True)
        b = bias.clone().requires_grad_(True)
        out = _logprobs(h, labels, w, b)
        g = torch.Generator().manual_seed(seed)
        gl, ge = torch.randn(labels.shape, generator=g), torch.randn(labels.shape, generator=g)
        gl[at], ge[at] = up_lp, up_ent
        torch.autograd.backward([out.logprobs, out.entropy], [gl, ge])
        return out.logprobs[at].detach(), h.grad[at], w.grad, b.grad

    ref = run(hp, yp, torch.arange(P), 0)
    _same_bits(ref[0], ref_lp)
    for seed, (n, ignored) in enumerate(CONTEXTS[:3]):
        hidden, labels, at = _context(n, ignored, dtype, seed)
        first = run(hidden, labels, at, seed)
        _same_bits(first[0], ref_lp)
        _same_bits(first[1], ref[1])
        again = run(hidden, labels, at, seed)
        for a, b in zip(first[2:], again[2:], strict=True):
            _same_bits(a, b)


def _rl_batch(dtype, seqs=8, T=24):
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(seqs, T, H, generator=g).to(dtype)
    labels = torch.randint(0, V, (seqs, T), generator=g)
    prompt = torch.randint(3, 18, (seqs,), generator=g)
    labels[torch.arange(T)[None, :] < prompt[:, None]] = -100
    return hidden, labels, torch.randn(seqs, generator=g)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("entropy_coef", [0.0, 0.01])
def test_fused_loss_ratio_is_exactly_one_on_micro_batches(dtype, entropy_coef):
    """The trainer pattern: old log-probs from a batch of 8 sequences (no grad), the fused loss
    on micro-batches of 1 and 2 sequences with gradients: every ratio is exactly 1.0."""
    weight, bias = _head(dtype)
    hidden, labels, adv = _rl_batch(dtype)
    with torch.no_grad():
        old = _logprobs(hidden, labels, weight, bias, with_entropy=False).logprobs
    config = PolicyLossConfig(entropy_coef=entropy_coef)
    for size in (1, 2):
        for s in range(0, 8, size):
            w = weight.clone().requires_grad_(True)
            _, metrics = logitless.fused_policy_loss(
                hidden[s : s + size], w, labels[s : s + size], old[s : s + size],
                adv[s : s + size], config=config, bias=bias, backend="torch",
                batch_invariant=True,
            )  # fmt: skip
            assert metrics["ratio_min"].item() == 1.0 == metrics["ratio_max"].item()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_entropy", [False, True])
def test_fused_rows_run_the_logprob_forward_bit_for_bit(dtype, with_entropy):
    """The gradient-in-forward kernel's log-probs are the log-prob op's bits, for row counts
    that do and do not fill the last row block (the ratio test above sees them through
    exp(), which hides differences below ~1e-7)."""
    from logitless.backends import torch_tiles
    from logitless.backends.base import KernelOptions, RowBatch
    from logitless.transform import LogitTransform

    weight, bias = _head(dtype)
    hidden, labels, _ = _context(300, 0.0, dtype, 3)
    for n in (1, 131):
        rows = RowBatch(hidden[:n], weight, bias, labels[:n], None)
        opts = KernelOptions(
            LogitTransform(None, None, 1.0), with_entropy, dtype,
            Schedule.choose(n, V, hidden.device, None, invariant=True, fused=True),
        )  # fmt: skip
        fwd = torch_tiles.forward_rows(rows, opts)
        seen: list[int] = []

        def grad_fn(r0, r1, logp, ent, seen=seen):
            seen.append(r1 - r0)
            return torch.ones_like(logp), None if ent is None else torch.ones_like(ent)

        logp, ent, _ = torch_tiles.fused_rows(rows, opts, grad_fn, (True, True, True))
        _same_bits(logp, fwd.logp)
        if with_entropy:
            _same_bits(ent, fwd.entropy)
        assert sum(seen) == n  # the filler rows never reach the loss


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_divergence_bits_and_its_logprobs_are_linear_logprobs(dtype):
    weight, bias = _head(dtype)
    t_weight, _ = _head(dtype, seed=3)
    g = torch.Generator().manual_seed(9)
    t_probe = torch.randn(P, H, generator=g).to(dtype)
    hp, yp = _probes(dtype)

    def div(hidden, t_hidden, labels, beta):
        return logitless.linear_divergence(
            hidden, weight, labels, t_hidden, t_weight, bias=bias, beta=beta,
            with_logprobs=True, with_entropy=True, backend="torch", batch_invariant=True,
        )  # fmt: skip

    lp = _logprobs(hp, yp, weight, bias)
    for beta in (0.0, 1.0, 0.5):
        ref = div(hp, t_probe, yp, beta)
        _same_bits(ref.logprobs, lp.logprobs)
        _same_bits(ref.entropy, lp.entropy)
        for seed, (n, ignored) in enumerate(CONTEXTS[1:3]):
            hidden, labels, at = _context(n, ignored, dtype, seed)
            t_hidden = torch.randn(hidden.shape, generator=g).to(dtype)
            t_hidden[at] = t_probe
            out = div(hidden, t_hidden, labels, beta)
            for got, want in zip(out, ref, strict=True):
                _same_bits(got[at], want)


def test_replay_probe_bits_do_not_depend_on_the_batch():
    """Sampling replay (top-k / top-p recomputed from the logits, the full-vocabulary rows
    beside the truncated ones) in the same mode."""
    weight, bias = _head(torch.float32)
    hp, yp = _probes(torch.float32)
    kw = {"top_k": 50, "top_p": 0.9, "with_kept_mass": True}
    ref = _logprobs(hp, yp, weight, bias, **kw)
    for seed, (n, ignored) in enumerate(CONTEXTS[:3]):
        hidden, labels, at = _context(n, ignored, torch.float32, seed)
        out = _logprobs(hidden, labels, weight, bias, **kw)
        for name in ("logprobs", "entropy", "log_kept_mass"):
            _same_bits(getattr(out, name)[at], getattr(ref, name))


def test_capturable_composes():
    """capturable=True (every row projected, ignored ones masked) and row_capacity give the
    probes the bits of the default-selection call."""
    weight, bias = _head(torch.float32)
    hp, yp = _probes(torch.float32)
    ref = _logprobs(hp, yp, weight, bias)
    hidden, labels, at = _context(200, 0.9, torch.float32, 4)
    for cap in (None, 64):
        out = _logprobs(hidden, labels, weight, bias, capturable=True, row_capacity=cap)
        _same_bits(out.logprobs[at], ref.logprobs)
        _same_bits(out.entropy[at], ref.entropy)


def test_modules_carry_the_option():
    weight, bias = _head(torch.float32)
    lin = torch.nn.Linear(H, V)
    with torch.no_grad():
        lin.weight.copy_(weight), lin.bias.copy_(bias)
    head = logitless.LogprobHead(lin, with_entropy=True, backend="torch", batch_invariant=True)
    assert head.options.batch_invariant and "batch_invariant=True" in repr(head)
    hp, yp = _probes(torch.float32)
    hidden, labels, at = _context(300, 0.5, torch.float32, 2)
    _same_bits(head(hidden, labels).logprobs[at].detach(), head(hp, yp).logprobs.detach())
    from logitless.modules import DivergenceHead, PolicyLossHead

    assert PolicyLossHead(
        lin, config=PolicyLossConfig(), batch_invariant=True
    ).options.batch_invariant
    assert DivergenceHead(lin, batch_invariant=True).options.batch_invariant


def test_bad_flag_names_the_argument():
    weight, bias = _head(torch.float32)
    hp, yp = _probes(torch.float32)
    with pytest.raises(ValueError, match="batch_invariant"):
        logitless.linear_logprobs(hp, weight, yp, batch_invariant="yes")


def test_a_matmul_whose_rows_move_is_detected_and_the_mode_refused(monkeypatch):
    """The first-use check: a matmul that gives a row other bits at another place in its block
    (simulated: a perturbation that grows with the row index) makes the probe fail, and the
    mode is then refused with a ValueError naming it."""
    cpu = torch.device("cpu")
    schedule = Schedule.invariant(V, cpu)
    assert base._rows_position_free(cpu, torch.float32, H, schedule)
    plain = torch.Tensor.__matmul__

    def by_position(a, b):
        out = plain(a, b)
        return out * (1 + 1e-6 * torch.arange(out.shape[0], dtype=out.dtype)[:, None])

    monkeypatch.setattr(torch.Tensor, "__matmul__", by_position)
    assert not base._rows_position_free(cpu, torch.float32, H, schedule)
    monkeypatch.setattr(base, "_POSITION_FREE", {})
    monkeypatch.setattr(base, "_rows_position_free", lambda *a: False)
    weight, bias = _head(torch.float32)
    hp, yp = _probes(torch.float32)
    with pytest.raises(ValueError, match="batch_invariant=True is not available on cpu"):
        _logprobs(hp, yp, weight, bias)


def test_bench_task_runs_at_a_tiny_shape():
    """``logitless bench --task invariance``: every method builds and runs a step, and the
    trainer-pattern report shows no ratio off 1.0 in the batch-invariant mode."""
    from logitless.apps.bench.invariance import ratio_report
    from logitless.apps.bench.methods import TASKS
    from logitless.apps.bench.workload import Workload, make_inputs

    work = Workload("invariance", 32, 16, 300, 0.75, "float32", "cpu", threads=1, repeats=1)
    inputs = make_inputs(work)
    for method in TASKS["invariance"].values():
        method.build(work, inputs)()
        inputs.clear_grads()
    lines = ratio_report(work).splitlines()
    ours = [line for line in lines if line.startswith("| batch_invariant")]
    assert len(ours) == 2 and all("| 0.00% |" in line for line in ours)
    assert len([line for line in lines if line.startswith("| naive")]) == 2


@pytest.mark.parametrize("op", ["logprobs", "divergence"])
def test_triton_schedule_does_not_follow_the_rows(op, monkeypatch):
    """Triton (interpreter): in this mode every launch of a call, forward and backward, has the
    same kernel, size, grid (row blocks x vocabulary splits) and the pinned configuration,
    whatever the number of rows: the rows go in whole blocks, so only the number of passes
    changes. (The bits themselves need a GPU: the interpreter's dot runs through numpy.)"""
    from logitless.backends import triton_divergence, triton_kernels, triton_launch

    seen: list[tuple] = []
    real = triton_launch.launch

    def spy(name, elems, grid_of, *args, pinned=False, **kwargs):
        seen.append((name, elems, grid_of(triton_launch.INTERPRETER.kwargs), pinned))
        return real(name, elems, grid_of, *args, pinned=pinned, **kwargs)

    for family in (triton_kernels, triton_divergence):
        monkeypatch.setattr(family, "launch", spy)
    vocab, dim = 300, 16
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(vocab, dim, generator=g, requires_grad=True)
    t_weight = torch.randn(vocab, dim, generator=g)
    block = Schedule.invariant(vocab, torch.device("cpu")).rows
    launches = {}
    for n in (1, 5, block + 2):
        hidden = torch.randn(n, dim, generator=g, requires_grad=True)
        labels = torch.randint(0, vocab, (n,), generator=g)
        seen.clear()
        if op == "logprobs":
            out = logitless.linear_logprobs(
                hidden, weight, labels, with_entropy=True, backend="triton", batch_invariant=True
            )
            (out.logprobs.sum() + out.entropy.sum()).backward()
        else:
            out = logitless.linear_divergence(
                hidden, weight, labels, torch.randn(n, dim, generator=g), t_weight, beta=0.5,
                backend="triton", batch_invariant=True,
            )  # fmt: skip
            out.divergence.sum().backward()
        passes = -(-n // block)
        assert all(s[3] for s in seen) and len(seen) % passes == 0
        launches[n] = sorted(set(seen))
    assert launches[1] == launches[5] == launches[block + 2]


def test_triton_pinned_configuration_is_one_of_the_checked_ones():
    """The mode's one configuration per kernel table and dot kind comes from the autotuned
    lists (each compiled and checked for spills by the ahead-of-time check)."""
    from logitless.backends import triton_kernels  # noqa: F401 (registers its kernels)
    from logitless.backends import triton_launch as tl

    for name, ieee in (("stats", "IEEE"), ("dz", "IEEE")):
        for flag, kind in ((False, "tc"), (True, "fma")):
            pinned = tl.pinned_config(name, {ieee: flag})
            assert pinned in tl.TABLES[tl.KERNELS[name].table][kind]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "backend, dtype", [("torch", torch.float32), ("triton", torch.bfloat16)], ids=str
)
def test_cuda_probe_bits_and_ratio(backend, dtype):
    """On a GPU: the probes' bits in every context, and the fused loss's ratio exactly 1.0,
    through the torch tiles (fp32) and the Triton kernels (bf16)."""
    dev = torch.device("cuda")
    weight, bias = (t.to(dev) for t in _head(dtype))
    hp, yp = (t.to(dev) for t in _probes(dtype))
    ref = _logprobs(hp, yp, weight, bias, backend=backend)
    for seed, (n, ignored) in enumerate(CONTEXTS):
        hidden, labels, at = (t.to(dev) for t in _context(n, ignored, dtype, seed))
        out = _logprobs(hidden, labels, weight, bias, backend=backend)
        _same_bits(out.logprobs[at], ref.logprobs)
        _same_bits(out.entropy[at], ref.entropy)
    hidden, labels, adv = (t.to(dev) for t in _rl_batch(dtype))
    with torch.no_grad():
        old = _logprobs(hidden, labels, weight, bias, backend=backend).logprobs
    for s in range(8):
        w = weight.clone().requires_grad_(True)
        _, metrics = logitless.fused_policy_loss(
            hidden[s : s + 1], w, labels[s : s + 1], old[s : s + 1], adv[s : s + 1],
            config=PolicyLossConfig(), bias=bias, backend=backend, batch_invariant=True,
        )  # fmt: skip
        assert metrics["ratio_min"].item() == 1.0 == metrics["ratio_max"].item()
