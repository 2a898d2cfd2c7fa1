"""Real agent harnesses in workspaces: mini-swe-agent, unchanged (examples/mini_swe_agent.py), runs its
commands in an episode's workspace and is scored by the task's tests — a right fix 1, nothing 0, rewritten
tests 0 — and a relayrl run trains it through the endpoint."""

import asyncio
import importlib.util
import json
import shutil
from pathlib import Path

import openai
import pytest

from relayrl.records import Prompt
from relayrl.workspaces.episode import EpisodeWorkspace
from relayrl.workspaces.tasks import from_row
from tests.openai_server import Server
from tests.swe_tasks import EDIT_TESTS, FIX, make_task, write_tasks

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")
ROOT = Path(__file__).resolve().parent.parent


def _example():
    spec = importlib.util.spec_from_file_location("mini_swe_agent_example", ROOT / "examples" / "mini_swe_agent.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _scripted(*commands: str):
    """A model that answers each turn with the next command, in mini-swe-agent's text format, then submits."""
    turns = [*commands, "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"]
    asked = []

    def reply(text: str) -> str:
        asked.append(text)
        return f"THOUGHT: next.\n\n```mswea_bash_command\n{turns[min(len(asked), len(turns)) - 1]}\n```"

    return reply, asked


@pytest.mark.slow  # (~15 s: three episodes with litellm's import; the fast tier's budget is 20 s a test)
def test_mini_swe_agent_unchanged_in_a_workspace_is_scored_by_the_tests(tmp_path):
    example = _example()
    task = from_row(make_task(tmp_path), str(tmp_path / "tasks.jsonl"), "tasks.jsonl: line 1")
    prompt = Prompt(task.instance_id, [{"role": "user", "content": task.problem_statement}])

    async def episode(url: str) -> tuple[float, dict]:
        ws = await EpisodeWorkspace(task).open()
        mine = Prompt(prompt.id, prompt.messages)
        object.__setattr__(mine, "workspace", ws)
        client = openai.AsyncOpenAI(base_url=url, api_key="k")
        try:
            assert await example.run(client, mine) is None
            return await ws.verdict(), ws.record
        finally:
            await ws.close()

    results = {}
    for name, commands in (("fix", [FIX, "python -m pytest -q tests 2>&1 | tail -1"]), ("nothing", []),
                           ("edit_tests", [EDIT_TESTS])):
        reply, asked = _scripted(*commands)
        with Server(reply=reply) as url:
            results[name] = asyncio.run(episode(url))
        assert len(asked) == len(commands) + 1, name  # every turn asked the model; the last one submitted
        if commands:
            assert "<returncode>0</returncode>" in asked[1], asked[1][:500]  # its own observation template
    assert results["fix"][0] == 1.0 and "a + b" in results["fix"][1]["patch"]
    assert results["nothing"][0] == 0.0 and results["nothing"][1]["patch"] == ""
    assert results["edit_tests"][0] == 0.0 and results["edit_tests"][1]["dropped"] == ["tests/test_add.py"]


@pytest.mark.slow
def test_a_run_trains_mini_swe_agent_through_the_endpoint_in_workspaces(tmp_path, tiny_path):
    from relayrl.config import load_config
    from relayrl.run.loop import train

    import yaml
    from minisweagent.config import get_config_path

    row = make_task(tmp_path)
    path = write_tasks(tmp_path, [row, {**row, "instance_id": "calc-2"}])
    short = yaml.safe_load(get_config_path("mini_textbased.yaml").read_text())  # its own, with short prompts: the
    short["agent"].update(system_template="Answer with one mswea_bash_command block.", instance_template="{{task}}")
    (tmp_path / "short.yaml").write_text(yaml.safe_dump(short))  # tiny model's context is 512 tokens
    cfg = load_config(None, [f"model.path={tiny_path}", f"data.path={path}", "data.eval_path=null",
                             f"env.name=agent:{ROOT / 'examples' / 'mini_swe_agent.py'}:run", f"env.args={{step_limit: 2, config: {tmp_path / 'short.yaml'}}}",
                             "env.max_turns=2", "env.max_tokens=64", "rollout.max_new_tokens=16", "run.steps=2",
                             "rollout.prompts_per_step=2", "rollout.group_size=2", f"run.output_dir={tmp_path}",
                             "run.name=m", "run.save_every=0"])
    summary = train(cfg)
    assert summary["steps"] == 2
    rows = [json.loads(x) for x in (tmp_path / "m" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["failures/env"] == 0 for r in rows) and all(r["generated_tokens"] > 0 for r in rows)
    records = (tmp_path / "m" / "rollouts").glob("*.jsonl.gz")
    import gzip

    infos = [json.loads(x)["info"] for f in records for x in gzip.open(f, "rt")]
    mains = [i for i in infos if "turns" in i]  # (not the branches of a history the template rewrote)
    assert len(mains) >= 8 and all("statuses" in i["record"] for i in mains), [sorted(i) for i in infos if "record" not in i]  # each episode scored by its task's tests
