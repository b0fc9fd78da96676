"""Command-line entry point: ``logitless <command> ...``.

Commands are subparsers, each registered by an ``add_*`` function that sets its handler, so
new ones (``demo``, ...) slot in beside ``bench``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import fields
from pathlib import Path

from .version import package_version

DEFAULT_CSV = Path("bench-results/bench.csv")
# What a ``logitless bench`` without ``--full`` (or ``--methods``) runs, in words.
FIRST_LOOK = "logitless against naive and the bare-matmul floors, the peers left out"


def _number(kind: type, accepts, bound: str):
    """An argparse type: ``kind`` (int or float) with ``accepts(value)``, else an error saying
    it must be ``bound``."""
    expected = "an integer" if kind is int else "a number"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not accepts(value):
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value

    parse.__name__ = f"{kind.__name__} {bound}"
    return parse


_positive_int = _number(int, lambda v: v >= 1, ">= 1")
_non_negative_int = _number(int, lambda v: v >= 0, ">= 0")
_fraction = _number(float, lambda v: 0.0 < v <= 1.0, "in (0, 1]")
_positive_float = _number(float, lambda v: v > 0, "> 0")


def _device(text: str) -> str:
    """argparse type: ``cpu``, ``cuda`` or ``cuda:N``."""
    if not re.fullmatch(r"cpu|cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return text


def _default_threads() -> int:
    """All cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``logitless bench``."""
    from .bench.methods import TASK_SUMMARY, TASKS
    from .bench.workload import DTYPES

    tasks = "; ".join(f"{t}: {TASK_SUMMARY[t]}" for t in TASKS)
    methods = "; ".join(f"{t}: {', '.join(TASKS[t])}" for t in TASKS)
    p = subparsers.add_parser(
        "bench",
        help="time and memory of each method on a task (log-probs + entropy, the fused "
        "loss, the capturable mode, distillation, sampling replay), forward + backward",
        description=(
            f"Measure forward+backward of a task ({tasks}) for each method, each in a fresh "
            "subprocess: median time and peak extra memory, as ratios vs naive and vs a "
            "pure-matmul floor timed in the same run. Default shape: a Qwen2.5-0.5B-like "
            "head (H=896, V=151936), fp32. Without --full a first look; a run on a busy "
            "machine is flagged."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--task", choices=list(TASKS), default="logprobs", help="what to compute")
    p.add_argument(
        "--methods",
        nargs="+",
        metavar="METHOD",
        default=argparse.SUPPRESS,
        help="methods to run (space or comma separated); default: the task's methods but the "
        f"peers, with --full all of them but torch_lce on a CPU ({methods})",
    )
    p.add_argument(
        "--tokens", type=_positive_int, nargs="+", default=[1024], help="N; several = sweep"
    )
    p.add_argument("--hidden", type=_positive_int, default=896, help="H")
    p.add_argument("--vocab", type=_positive_int, default=151936, help="V")
    p.add_argument(
        "--valid-frac",
        type=_fraction,
        default=1.0,
        help="fraction of rows with a real label; the rest are ignore_index, spread randomly",
    )
    p.add_argument(
        "--dtype", choices=list(DTYPES), default="float32", help="dtype of hidden and weight"
    )
    p.add_argument("--device", type=_device, default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--repeats", type=_positive_int, default=3, help="timed repeats (+1 warmup)")
    p.add_argument(
        "--rounds",
        type=_positive_int,
        metavar="R",
        default=argparse.SUPPRESS,
        help="cut each method's repeats into up to R rounds; a round runs every method once, "
        "each in a fresh worker (warm-up, its share of the repeats, exit), in alternating "
        "order, so load on the machine hits all methods alike (default: 1; 3 on CPU with "
        "--full)",
    )
    p.add_argument(
        "--full",
        action="store_true",
        help="the full table: every method of the task, the installed peers (Liger-Kernel, Cut "
        "Cross-Entropy, TRL, ...) too, and on CPU the repeats in 3 rounds. Without it the run "
        f"is a first look: {FIRST_LOOK}, in one round",
    )
    p.add_argument(
        "--threads", type=_positive_int, default=_default_threads(), help="torch CPU threads"
    )
    p.add_argument("--seed", type=int, default=0, help="input RNG seed")
    p.add_argument(
        "--timeout", type=_positive_float, metavar="S", help="per-method subprocess time limit"
    )
    _add_bench_outputs(p)
    p.set_defaults(handler=_run_bench_command, command_parser=p)


def _add_bench_outputs(p: argparse.ArgumentParser) -> None:
    """``logitless bench``'s flags for what it writes: the CSV, the plot, the progress."""
    p.add_argument("--csv", type=Path, default=DEFAULT_CSV, help="CSV to append rows to")
    p.add_argument("--no-csv", action="store_true", help="do not write the CSV")
    p.add_argument(
        "--plot",
        type=Path,
        metavar="PNG",
        help="write a plot of time and memory here: bars for one --tokens, lines for several",
    )
    p.add_argument(
        "--quiet",
        action="store_true",
        help="progress: only one line per finished method (no repeats, elapsed or time left)",
    )


def _selected_methods(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """Validate ``--methods`` against the task's registry (argparse error if unknown); without
    it the task's default methods (with ``--full``, the peers among them too)."""
    from .bench.methods import TASKS

    known = list(TASKS[args.task])
    if not getattr(args, "methods", None):
        full = getattr(args, "full", False)
        return [
            name
            for name, method in TASKS[args.task].items()
            if method.by_default(args.device) and (full or method.role != "peer")
        ]
    names = [n for item in args.methods for n in item.split(",") if n]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        parser.error(
            f"unknown method(s) {', '.join(unknown) or '(none given)'} for task {args.task!r};"
            f" choose from {', '.join(known)}"
        )
    return list(dict.fromkeys(names))


def _run_bench_command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Handler of ``logitless bench``: run, print the table, append the CSV, plot.

    stdout gets the run's first lines at once (what runs; progress goes to stderr), then the
    table; stderr the progress and where the CSV and the plot went.
    """
    from .bench.harness import (
        append_csv,
        format_table,
        machine_string,
        now_timestamp,
        run_bench,
        workloads_for,
    )
    from .bench.load import LoadMonitor
    from .bench.workload import Workload

    methods = _selected_methods(parser, args)
    _check_bench_outputs(parser, args)
    base = Workload(
        task=args.task,
        tokens=args.tokens[0],
        hidden=args.hidden,
        vocab=args.vocab,
        valid_frac=args.valid_frac,
        dtype=args.dtype,
        device=args.device,
        threads=args.threads,
        repeats=args.repeats,
        seed=args.seed,
    )
    timestamp = now_timestamp()
    rounds = getattr(args, "rounds", 3 if args.full and args.device == "cpu" else 1)
    _announce_bench(args, methods, rounds)
    load = LoadMonitor()
    rows = run_bench(
        methods,
        workloads_for(base, args.tokens),
        log=sys.stderr,
        timeout_s=args.timeout,
        progress=not args.quiet,
        rounds=rounds,
    )
    busy = load.report().note()
    print(format_table(rows, warning=busy))  # the table's last line carries the warning
    if args.task == "invariance":  # what the mode buys: the trainer pattern's ratios
        from .bench.invariance import ratio_report

        print(ratio_report(base))
    if not args.full and not getattr(args, "methods", None):
        print(
            f"a first look: {FIRST_LOOK}, {rounds} round{'s' if rounds > 1 else ''}. The full "
            "table: logitless bench --full (every method, the installed peers too; on CPU 3 "
            "rounds, so load on the machine hits every method alike)"
        )
    if busy:
        for r in rows:  # the CSV's note column keeps it
            r.reason = "; ".join(n for n in (r.reason, busy) if n)
    if not args.no_csv:
        append_csv(args.csv, rows, timestamp)
        print(f"appended {len(rows)} rows to {args.csv}", file=sys.stderr)
    if args.plot is not None:
        from .bench.plot import plot_rows

        plot_rows(rows, args.plot, machine_string(), warning=busy)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 1 if any(r.status == "failed" for r in rows) else 0


def _announce_bench(args: argparse.Namespace, methods: Sequence[str], rounds: int) -> None:
    """The run's first lines, on stdout and flushed, so that a stdout redirected to a file says
    at once what runs and that its progress goes to stderr until the table comes."""
    print(
        f"logitless bench: task={args.task} H={args.hidden} V={args.vocab} {args.dtype} "
        f"{args.device} threads={args.threads} repeats={args.repeats} rounds={rounds} "
        f"tokens={','.join(map(str, args.tokens))} valid_frac={args.valid_frac:g}\n"
        f"methods: {', '.join(methods)}; progress goes to stderr, the table comes here when "
        "they are done",
        flush=True,
    )


def _check_bench_outputs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Before any run: the device exists, the CSV's header matches, matplotlib for ``--plot``
    (``parser.error`` otherwise)."""
    from .bench.harness import check_csv_header

    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            parser.error(f"--device {args.device}: CUDA is not available in this torch build")
    if not args.no_csv:
        try:
            check_csv_header(args.csv)
        except ValueError as exc:
            parser.error(str(exc))
    if args.plot is not None:
        from .output import PlotUnavailable, pyplot

        try:
            pyplot()
        except PlotUnavailable as exc:
            parser.error(str(exc))


DEFAULT_DEMO_PLOT = "demo-results/grpo_demo_{mode}.png"


def add_demo_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``logitless demo``."""
    from .demo import DemoConfig

    d = DemoConfig()
    p = subparsers.add_parser(
        "demo",
        help="a small GRPO run on CPU: reward, loss, KL, entropy and peak memory per step",
        description=(
            "GRPO on a tiny random-init Llama (transformers, built from a config: nothing is "
            "downloaded) with a 16k vocabulary, learning to echo the last digit of its prompt. "
            "Prints a progress bar (warm-up, then reward, loss, KL and entropy per step), a "
            "summary per run (reward first -> last, peak memory per step, run time) and saves a "
            "plot. --naive runs the same loop with model(...).logits -> log_softmax, to see the "
            "memory difference; --compare runs both over several seeds (one RL run drifts from "
            "another by float rounding, so one seed proves nothing) and checks one update of "
            "both paths against each other in float64."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--steps", type=_positive_int, default=d.steps, help="GRPO steps")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--naive", action="store_true", help="full-logits head path instead of logitless"
    )
    mode.add_argument(
        "--compare",
        action="store_true",
        help="run logitless and naive for each seed, compare the final rewards over seeds, "
        "check one update in float64, plot both",
    )
    mode.add_argument(
        "--check-step",
        action="store_true",
        help="only check one GRPO update: logitless vs naive on the same policy and batch, in "
        "float64 and fp32 (seconds; no training run)",
    )
    p.add_argument("--seed", type=int, default=d.seed, help="model, prompt and sampling seed")
    p.add_argument(
        "--seeds",
        type=_positive_int,
        metavar="N",
        default=argparse.SUPPRESS,
        help="runs per mode, seeds --seed, --seed + 1, ... (default: 3 with --compare, else 1)",
    )
    p.add_argument("--device", type=_device, default=d.device, help="cpu, cuda or cuda:N")
    p.add_argument("--vocab", type=_positive_int, default=d.vocab, help="vocabulary size V")
    p.add_argument("--prompts", type=_positive_int, default=d.prompts, help="prompts per step")
    p.add_argument("--group", type=_positive_int, default=d.group, help="samples per prompt")
    p.add_argument("--lr", type=_positive_float, default=d.lr, help="AdamW learning rate")
    p.add_argument(
        "--warmup",
        type=_non_negative_int,
        default=d.warmup,
        help="supervised format steps before GRPO (0: none; the reward then starts near 0)",
    )
    p.add_argument(
        "--threads", type=_positive_int, default=_default_threads(), help="torch CPU threads"
    )
    p.add_argument(
        "--plot",
        type=Path,
        metavar="PNG",
        default=DEFAULT_DEMO_PLOT,
        help="reward and peak memory per step ({mode}: logitless, naive or compare)",
    )
    p.add_argument("--no-plot", action="store_true", help="do not write the plot")
    p.add_argument("--csv", type=Path, metavar="CSV", help="also write per-step metrics here")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--summarize",
        type=Path,
        nargs="+",
        metavar="CSV",
        help="no training: the seeds summary of runs saved with --csv (e.g. seeds run in "
        "several processes)",
    )
    p.set_defaults(handler=_run_demo_command, command_parser=p)


def _run_demo_command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Handler of ``logitless demo``: run one mode (or both) per seed, summarize, plot."""
    import time

    from .demo import check_step, read_csv, run_demo, seeds_summary, show_samples

    if args.summarize:
        try:
            runs = read_csv(args.summarize)
        except (OSError, KeyError, ValueError) as exc:
            parser.error(f"--summarize: {exc}")
        for line in seeds_summary(runs):
            print(line)
        return 0
    t0 = time.perf_counter()
    configs = _demo_configs(parser, args)
    if args.check_step:
        for seed_config in configs:
            print(check_step(seed_config).summary(), flush=True)
        print(f"done in {time.perf_counter() - t0:.0f} s")
        return 0
    results = []
    for config in configs:
        result = run_demo(config, progress=not args.quiet)
        results.append(result)
        print(result.summary(), flush=True)
        if config.seed == args.seed:  # what the trained policy answers, first seed only
            for line in show_samples(result, n=3):
                print(f"    {line}")
    _report_demo(args, results)
    elapsed = time.perf_counter() - t0
    print(f"demo run time: {elapsed // 60:.0f} min {elapsed % 60:.0f} s ({len(results)} runs)")
    return 0


def _demo_configs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list:
    """The demo's runs (one per seed and mode) from the checked arguments, announced on one
    line; a bad argument ends the command through ``parser.error``."""
    import torch

    from .demo import DemoConfig

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: CUDA is not available in this torch build")
    if args.group < 2:
        parser.error(f"--group must be >= 2 (group-relative advantages), got {args.group}")
    try:
        import transformers  # noqa: F401
    except ImportError:
        parser.error(
            "logitless demo needs transformers: pip install -e '.[hf]' in a logitless checkout"
        )
    torch.set_num_threads(args.threads)
    modes = [False, True] if args.compare else [args.naive]
    n_seeds = getattr(args, "seeds", 3 if args.compare else 1)
    seeds = list(range(args.seed, args.seed + n_seeds))
    # the flags that set a DemoConfig field are named as the field; seed and mode vary per run
    flags = {f.name: getattr(args, f.name) for f in fields(DemoConfig) if hasattr(args, f.name)}
    try:
        configs = [
            DemoConfig(**{**flags, "seed": seed, "naive": naive})
            for seed in seeds
            for naive in modes
        ]
    except ValueError as exc:
        parser.error(str(exc))
    c = configs[0]
    what = (
        "one update checked in float64"
        if args.check_step
        else f"{c.steps} steps, seed{'s' if n_seeds > 1 else ''} {', '.join(map(str, seeds))}"
    )
    print(
        f"logitless demo: GRPO on a random-init Llama (V={c.vocab}, H={c.hidden}, {c.layers} "
        f"layers), echo the last of {c.digits} digits; {c.prompts} prompts x {c.group} samples "
        f"per step, {what}, {c.device}, {args.threads} threads",
        flush=True,
    )
    return configs


def _report_demo(args: argparse.Namespace, results: list) -> None:
    """After the runs: the memory note, the comparison and the seeds' summary, the CSV and
    the plot."""
    import statistics

    from .demo import check_step, plot_demo, seeds_summary, write_csv
    from .output import PLOT_HINT

    c = results[0].config
    print(results[0].memory_note)
    if args.compare:
        fused_mb, naive_mb = (
            statistics.median(r.peak_mb(typical=True) for r in results if r.config.naive == naive)
            for naive in (False, True)
        )
        print(
            f"naive / logitless peak step memory: {naive_mb:.0f} / {fused_mb:.0f} MB = "
            f"{naive_mb / fused_mb:.1f}x (median step, median over seeds)"
        )
    if args.compare or len({r.config.seed for r in results}) > 1:
        for line in seeds_summary(results):
            print(line)
    if args.compare:
        print(check_step(c).summary(), flush=True)
    if args.csv is not None:
        write_csv(results, args.csv)
        print(f"wrote {args.csv}")
    if not args.no_plot:
        label = "compare" if args.compare else c.mode
        path = Path(str(args.plot).replace("{mode}", label))
        if plot_demo(results, path):
            print(f"wrote {path}")
        else:
            print(f"no plot: matplotlib is not installed ({PLOT_HINT})")


COMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    add_bench_parser,
    add_demo_parser,
)


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one subparser per command."""
    parser = argparse.ArgumentParser(prog="logitless", description="logitless command-line tools")
    parser.add_argument("--version", action="version", version=f"logitless {package_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen command; returns the exit code.

    Bad input exits with code 2 (argparse); a run where some method failed returns 1.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.handler(args.command_parser, args))


if __name__ == "__main__":
    sys.exit(main())
