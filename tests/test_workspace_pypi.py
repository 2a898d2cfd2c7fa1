"""Tasks nobody here wrote (examples/pypi_swe_tasks.py: parse's bug fixes, from its releases on PyPI), through
env.name=workspace and through mini-swe-agent unchanged (examples/mini_swe_agent.py): the project's own fix scores
1, no change 0, the tests rewritten to pass 0."""

import asyncio
import importlib.util
import json
import shutil
from pathlib import Path

import openai
import pytest

from relayrl.data.datasets import load_prompts
from relayrl.envs.workspace import WorkspaceEnv
from relayrl.records import Prompt
from relayrl.workspaces.episode import EpisodeWorkspace
from relayrl.workspaces.tasks import Task
from tests.openai_server import Server
from tests.test_workspace_agents import _example, _scripted

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")]
ROOT = Path(__file__).resolve().parent.parent
EDIT_TESTS = "printf 'def test_nothing():\\n    pass\\n' > tests/test_parse.py"  # the tests, rewritten to pass


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("pypi_swe_tasks", ROOT / "examples" / "pypi_swe_tasks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    path = module.build(tmp_path_factory.mktemp("pypi-tasks"))
    rows = {r["instance_id"]: r for r in map(json.loads, path.read_text().splitlines())}
    return {p.id: (p, rows[p.id]) for p in load_prompts(str(path))}


def _apply(patch: str) -> str:
    return f"git apply <<'RELAYRL_PATCH'\n{patch}RELAYRL_PATCH"


def _call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def test_the_projects_own_fix_resolves_its_tasks_and_nothing_else_does(tasks):
    assert set(tasks) == {"parse-1.20.1", "parse-1.20.2"}

    async def play(prompt, commands):
        env = WorkspaceEnv()
        await env.reset(prompt)
        try:
            for c in commands:
                assert not (await env.step(_call("bash", command=c))).done
            return (await env.step(_call("submit"))).reward, env.record
        finally:
            await env.close()

    for prompt, row in tasks.values():
        assert row["FAIL_TO_PASS"] and len(row["PASS_TO_PASS"]) > 40  # (the release's new tests; its others)
        fixed, nothing, edited = (asyncio.run(play(prompt, c)) for c in ([_apply(row["patch"])], [], [EDIT_TESTS]))
        assert fixed[0] == 1.0 and all(fixed[1]["statuses"][t] == "PASSED" for t in row["FAIL_TO_PASS"]), row["instance_id"]
        assert nothing[0] == 0.0 and nothing[1]["patch"] == ""
        assert edited[0] == 0.0 and edited[1]["dropped"] == ["tests/test_parse.py"]


def test_mini_swe_agent_unchanged_is_scored_by_the_projects_tests(tasks):
    example = _example()
    prompt, row = tasks["parse-1.20.2"]
    task = Task.of(prompt)

    async def episode(url: str) -> float:
        ws = await EpisodeWorkspace(task).open()
        mine = Prompt(prompt.id, prompt.messages)
        object.__setattr__(mine, "workspace", ws)
        try:
            assert await example.run(openai.AsyncOpenAI(base_url=url, api_key="k"), mine) is None
            return await ws.verdict()
        finally:
            await ws.close()

    rewards = {}
    for name, commands in (("fix", [_apply(row["patch"])]), ("nothing", []), ("edit_tests", [EDIT_TESTS])):
        reply, _ = _scripted(*commands)
        with Server(reply=reply) as url:
            rewards[name] = asyncio.run(episode(url))
    assert rewards == {"fix": 1.0, "nothing": 0.0, "edit_tests": 0.0}
