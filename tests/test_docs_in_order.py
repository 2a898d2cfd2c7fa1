"""The docs' commands run in the order a reader meets them, in two readings (``READINGS``, each in its own
folder: the README, getting started and the guides that use their runs; the agents' guides): as written (shell lines through bash, heredocs included; the files the pages name on
a block's first line, `# my.yaml`, saved when met). Every command run must exit 0: a later command meets
the folders the earlier ones left (runs/demo with its checkpoints before `relayrl train run.mode=async`).

One change, said here: a training run of more than 20 steps (the demo's 80), or of more than 2 on workspaces or
the multi-agent guide's fictitious self-play (`run.name=fsp`, 192 s as written), gets `run.steps=2 eval.size=8`
appended, so the whole reading takes minutes, and a later command's path to one of its checkpoints
(`runs/x/checkpoints/step_000040/...`) or a step of its records (`relayrl show runs/x --step 40`) names its step 2; shorter ones run as written (the README's 20-step
run, whose checkpoint step_000020 a later command names). A command met again is not run again (the reader has run
it). Lines that cannot run here are left out with their reason (``SKIP``)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from relayrl import cli
from relayrl.config import load_config
from relayrl.config.naming import run_name

ROOT = Path(__file__).resolve().parent.parent
GUIDES = ROOT / "docs" / "guides"
# two readings, each in a folder of its own (the slow tier's two processes take one each): the README's runs and
# the guides that read them; the agents' guides, which make their own
READINGS = {"readme-and-training": [ROOT / "README.md", ROOT / "docs" / "getting-started.md",
                                    *(GUIDES / f"{g}.md" for g in ("lora", "sft", "distillation", "judges", "tracking"))],
            "agents": [GUIDES / f"{g}.md" for g in ("environments", "agent-programs", "multi-agent", "workspaces",
                                                    "vision")]}
SHORT = ["run.steps=2", "eval.size=8"]
LONG = 20  # steps: a run longer than this is shortened
SKIP = {  # the start of a line -> why it does not run here
    "python -m pytest": "the test suite itself",
    "torchrun": "needs several GPUs",
    "relayrl train my.yaml model.path=Qwen/": "needs a GPU and the Hugging Face hub",
    "python examples/minimal_loop.py": "tests/test_minimal_loop.py runs it",
    "python benchmarks/": "a benchmark: minutes of measuring",
    "python examples/pypi_swe_tasks.py": "downloads releases from PyPI (tests/test_workspace_pypi.py runs it)",
    "relayrl train reward.judge.url=": "needs a judge's server (tests/test_judges.py runs one on loopback)",
    "relayrl train reward.judge.path=my-judge": "a judge of the reader's own",
    "python examples/judge_demo/": "makes a judge in ~10 minutes (its pieces: tests/test_judges.py, tests/test_sft.py)",
    "relayrl train reward.judge.path=runs/judge-demo": "the judge the line before makes",
    "tensorboard --logdir": "a server, left running for the reader",
}
# `pip install ... && relayrl train`: the tests run in the installed environment (.ci/run runs the README's own
# pip commands), so what follows the install runs
INSTALL = re.compile(r"^pip install [^&]*&& ")
PLACEHOLDER = re.compile(r"\.\.\.|\b[A-Z]{2,}\b")  # `relayrl train ... --resume`


def reading(page: Path) -> list[tuple[str, str]]:
    """What the page asks the reader to do, in order: ("file", "name\\ncontent") for a block that names its
    file on its first line, ("run", line) for a shell line of a bash block (a heredoc kept with its line,
    backslash continuations joined) and for a command in the prose (`relayrl train run.mode=async`)."""
    out = []
    text = page.read_text()
    # (in the prose, a command to run is a `relayrl train ...` or `python ...`; `relayrl eval --checkpoint` names
    # an option)
    for m in re.finditer(r"^```(\w+)\n(.*?)^```|`((?:relayrl train|python )[^`]*)`", text, re.DOTALL | re.MULTILINE):
        lang, body, inline = m.groups()
        if inline:
            if not PLACEHOLDER.search(inline):
                out.append(("run", inline))
        elif lang in ("python", "yaml"):
            name = re.match(r"#\s*(\S+\.(?:py|ya?ml))\b", body)
            if name:
                out.append(("file", f"{name.group(1)}\n{body}"))
        elif lang == "bash":
            lines = re.sub(r"\\\n\s*", " ", body).splitlines(keepends=True)
            while lines:
                line = lines.pop(0)
                heredoc = re.search(r"<<'(\w+)'", line)
                if heredoc:  # the line with its body, up to the terminator
                    end = next(i for i, x in enumerate(lines) if x.strip() == heredoc.group(1))
                    line, lines = line + "".join(lines[:end + 1]), lines[end + 1:]
                line = INSTALL.sub("", line.strip("\n"))
                if line.strip() and not line.lstrip().startswith("#") and not line.startswith("pip install"):
                    out.append(("run", line))
    return out


def _shortened(line: str, folder: Path, shortened: set[str]) -> str:
    """``line`` with SHORT appended where it trains for more than LONG steps (its run's folder added to
    ``shortened``), and the checkpoints it names of runs shortened before at their last step."""
    for run in shortened:
        line = re.sub(rf"\b({re.escape(run)}/checkpoints/)step_\d{{6}}", r"\1step_000002", line)
        if re.search(rf"\b{re.escape(run)}\b", line):  # (`relayrl show runs/demo --step 40`: its step 2)
            line = re.sub(r"--step \d+", "--step 2", line)
    words = shlex.split(line, comments=True)
    if words[:2] not in (["relayrl", "train"], ["relayrl", "sft"]) or "--help" in words:
        return line
    config, overrides = cli._split([w for w in words[2:] if not w.startswith("--")])
    cfg = load_config(str(folder / config) if config else None, overrides)  # (relayrl sft's default: 80 steps too)
    long = 2 if cfg.env.name == "workspace" or "run.name=fsp" in words else LONG  # (seconds an episode; 192 s)
    if cfg.run.steps <= long:
        return line
    short = SHORT if cfg.data.eval_path else SHORT[:1]  # (eval.size is refused where nothing is evaluated)
    named = "name" in cfg.run.model_fields_set
    base = "sft" if words[1] == "sft" and not named else cfg.run.name  # (the command's default name)
    shortened.add(f"{cfg.run.output_dir}/{run_name(base, config, overrides, named)}")
    return f"{line.split('#')[0].rstrip()} {' '.join(short)}"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(READINGS))
def test_the_docs_commands_run_in_the_order_a_reader_meets_them(tmp_path, name):
    folder = tmp_path / "relayrl"  # (a clone's name)
    folder.mkdir()
    (folder / "examples").symlink_to(ROOT / "examples")  # the pages' commands run in the repository's root
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done, skipped, shortened = [], [], set()
    for page in READINGS[name]:
        for kind, item in reading(page):
            if kind == "file":
                file, _, body = item.partition("\n")
                (folder / file).write_text(body)
                continue
            why = next((why for start, why in SKIP.items() if item.startswith(start)), None)
            key = item if "<<" in item else shlex.join(shlex.split(item, comments=True))  # (as the shell reads it)
            if why or key in done:
                skipped.append((item, why or "met before"))
                continue
            line = _shortened(item, folder, shortened)
            proc = subprocess.run(["bash", "-euo", "pipefail", "-c", line], cwd=folder, env=env, capture_output=True,
                                  text=True, timeout=900)
            assert proc.returncode == 0, f"{page.name}: {line!r} exited {proc.returncode}: {proc.stderr[-2000:]}"
            done.append(key)
    runs = {p.name for p in (folder / "runs").iterdir() if p.is_dir()}
    if name == "agents":
        assert {"openai_agent", "swe_demo", "mini_swe_agent", "fsp"} <= runs, runs
        assert len(done) >= 10, (done, skipped)
        return
    assert {"demo", "demo-run.mode-async", "my-run", "weather-demo", "demo-model.lora.r-8", "demo-model.lora.r-8-run.mode-async",
            "demo-model.lora.r-1-trainer.lr-2e-3"} <= runs, runs
    assert (folder / "runs" / "my-run" / "checkpoints" / "step_000020" / "eval.json").exists()
    assert (folder / "merged" / "model.safetensors").exists()
    assert len(done) >= 15, (done, skipped)
