"""Every snippet of the README and of docs/*.md runs as written (a quickstart that does not run
is a bug): ``python`` blocks are executed; ``py`` blocks that need a process group are excerpts of
scripts under examples/, which are run here (two gloo processes each) and compared line by line
with the excerpt."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
OPTIONAL = ("cut_cross_entropy", "liger_kernel", "trl", "transformers", "matplotlib", "torchtitan")


def _blocks(fence: str) -> list[tuple[str, int, str]]:
    out = []
    for page in PAGES:
        for i, code in enumerate(re.findall(rf"```{fence}\n(.*?)```", page.read_text(), re.S)):
            out.append((page.relative_to(ROOT).as_posix(), i, code))
    return out


PYTHON = _blocks("python")
EXCERPTS = _blocks("py")
CONFIGS = [b for b in _blocks("yaml") if b[2].startswith("# from examples/")]
LAUNCHES = [  # (page, command): the lines of ``bash`` blocks that launch an example
    (page, line)
    for page, _, code in _blocks("bash")
    for line in code.splitlines()
    if "accelerate launch" in line and not line.startswith("#")
]


def test_the_docs_have_examples():
    assert len(PYTHON) >= 10 and EXCERPTS


@pytest.mark.parametrize("page, index, code", PYTHON, ids=[f"{p}[{i}]" for p, i, _ in PYTHON])
def test_python_block_runs(page, index, code):
    try:
        exec(compile(code, f"{page}[python block {index}]", "exec"), {})  # noqa: S102
    except ModuleNotFoundError as e:
        if e.name and e.name.split(".")[0] in OPTIONAL:
            pytest.skip(f"{e.name} is not installed")
        raise


def _recipe(script: Path) -> str:
    """The lines between ``# [recipe]`` and ``# [/recipe]`` of ``script``, dedented."""
    text = script.read_text()
    body = text[text.index("# [recipe]\n") + len("# [recipe]\n") : text.index("# [/recipe]")]
    lines = body.rstrip().split("\n")
    indent = min(len(ln) - len(ln.lstrip()) for ln in lines if ln.strip())
    return "\n".join(ln[indent:] for ln in lines).strip()


@pytest.mark.parametrize("page, index, code", EXCERPTS, ids=[f"{p}[{i}]" for p, i, _ in EXCERPTS])
def test_excerpt_matches_its_script(page, index, code):
    first, _, rest = code.partition("\n")
    match = re.match(r"# from (examples/\S+\.py)", first)
    assert match, f"{page}: a `py` block must start with '# from examples/<script>.py'"
    assert rest.strip() == _recipe(ROOT / match.group(1)), f"{page}: excerpt != script"


@pytest.mark.parametrize("script", ["tensor_parallel", "data_parallel", "fsdp2"])
def test_distributed_example_runs(script):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / f"{script}.py")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "one process" in out.stdout


@pytest.mark.parametrize("page, index, code", CONFIGS, ids=[f"{p}[{i}]" for p, i, _ in CONFIGS])
def test_config_block_is_its_file(page, index, code):
    """A ``yaml`` block headed ``# from examples/<file>`` shows that file whole."""
    first, _, rest = code.partition("\n")
    assert rest == (ROOT / first.removeprefix("# from ")).read_text(), f"{page}: block != file"


def test_the_launch_commands_name_their_files_and_the_script_shows_them():
    """docs/trl.md's DeepSpeed launches (one on a CPU box, one on GPUs): each names a config
    and a script that exist, and the script's docstring gives the same commands."""
    commands = [line for page, line in LAUNCHES if page == "docs/trl.md"]
    assert len(commands) == 2 and sum("_cpu.yaml" in c for c in commands) == 1, commands
    for command in commands:
        config = re.search(r"--config_file (\S+)", command).group(1)
        script = command.split()[-1]
        assert (ROOT / config).is_file() and (ROOT / script).is_file(), command
        assert command in (ROOT / script).read_text(), f"{script} does not show {command!r}"


def test_cpu_deepspeed_launch_runs_as_written(tmp_path):
    """docs/trl.md's CPU command, as the page writes it, from the checkout's root: 2 processes
    under ZeRO-3 on DeepSpeed's CPU accelerator train 2 steps. Only the port is added (another
    test may hold accelerate's default) and DeepSpeed's op cache is the tests' own
    (tests/_deepspeed.py)."""
    for module in ("deepspeed", "trl", "accelerate"):
        pytest.importorskip(module)
    from _deepspeed import CACHE

    (command,) = [c for page, c in LAUNCHES if page == "docs/trl.md" and "_cpu.yaml" in c]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = command.replace("accelerate launch", f"accelerate launch --main_process_port {port}")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), TORCH_EXTENSIONS_DIR=str(CACHE))
    out = subprocess.run(
        ["bash", "-c", command], cwd=ROOT, capture_output=True, text=True, timeout=900, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"ZeRO-3, 2 processes: losses \[\S+, \S+\]", out.stdout), out.stdout[-2000:]


def test_vlm_example_trains_every_part():
    """examples/trl_vlm.py (docs/trl.md's vision-language example): LogitlessGRPOTrainer on a
    tiny LLaVA with image prompts trains its vision tower and projector too (the images reach
    the backbone in the loss), not only the language model and the head."""
    for module in ("trl", "PIL"):
        pytest.importorskip(module)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "trl_vlm.py")],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    trained = "trained: language_model, lm_head, multi_modal_projector, vision_tower"
    assert re.search(r"losses \S+, \S+; " + trained + "\n", out.stdout), out.stdout[-2000:]


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lowercase, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _links() -> list[tuple[str, str]]:
    out = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if not re.match(r"[a-z]+://", target):
                out.append((page.relative_to(ROOT).as_posix(), target))
    return out


@pytest.mark.parametrize("page, target", _links(), ids=[f"{p}->{t}" for p, t in _links()])
def test_relative_link_resolves(page, target):
    path, _, anchor = target.partition("#")
    file = (ROOT / page).parent / path if path else ROOT / page
    assert file.exists(), f"{page}: {target} points to a missing file"
    if anchor and file.suffix == ".md":
        headings = re.findall(
            r"^#+ (.+)$", re.sub(r"```.*?```", "", file.read_text(), flags=re.S), re.M
        )
        assert anchor in {_slug(h) for h in headings}, f"{page}: no heading for #{anchor}"


def test_ci_runs_the_readme_commands():
    """CI runs the README's test command as written (with every extra the suite needs), so a
    new machine that follows the README installs what CI installs."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("**Developing logitless**", 1)[1].split("```bash\n", 1)[1].split("```")[0]
    commands = [ln for ln in block.splitlines() if ln and not ln.startswith("#")]
    bench, tests = commands
    assert bench.endswith("&& logitless bench")
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests in ci
    # Each installs what it needs on a new machine, torch included: the release the tests run
    # against, named as such where the README says when to drop it.
    assert all("pip install torch==2.13.0 " in c for c in commands), commands
    assert "the torch release the tests are run against" in " ".join(readme.split())
    for extra in ("test", "hf", "triton", "trl", "peers", "peft", "megatron", "deepspeed"):
        assert extra in tests.split('".[', 1)[1].split("]", 1)[0].split(",")
