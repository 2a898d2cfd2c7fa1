"""Per-episode workspaces (relayrl.workspaces): a time-safe checkout shared by copy-on-write workspaces, a
sandbox that contains hostile commands, rewards from tests a policy cannot edit or hook, tasks in SWE-bench's
format, and env.name=workspace's tools."""

import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relayrl.data.datasets import DataError, load_prompts
from relayrl.envs.workspace import WorkspaceEnv
from relayrl.records import Prompt
from relayrl.workers.isolation import _python_paths
from relayrl.workspaces import grading
from relayrl.workspaces.episode import Settings
from relayrl.workspaces.sandbox import Limits, Workspace, prepare
from relayrl.workspaces.tasks import KEY, Task, from_row
from tests.swe_tasks import EDIT_TESTS, FIX, FORGE, NOTHING, git, make_task, write_tasks
from tests.test_workers import _descendants  # (the trainer's process tree)

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")
ROOT = os.geteuid() == 0


@pytest.fixture
def task(tmp_path) -> Task:
    return from_row(make_task(tmp_path), str(tmp_path / "tasks.jsonl"), "tasks.jsonl: line 1")


def _procs_with(marker: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:
            pass
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def test_a_checkout_shows_no_future_and_each_workspace_writes_only_its_own_layer(task):
    lower = prepare(task.repo, task.base_commit)
    future = git(Path(task.repo), "rev-parse", "v2")

    async def go():
        async with await Workspace.start(lower) as a, await Workspace.start(lower) as b:
            log = await a.run(f"git log --all --oneline; git tag; git cat-file -t {future}")
            assert a.mode == "overlay" if ROOT else True
            await a.run(FIX)
            return log, (await a.run("cat calc.py")).output, (await b.run("cat calc.py")).output

    log, mine, theirs = asyncio.run(go())
    assert log.output.splitlines()[0].endswith(" base") and "fix" not in log.output and "v2" not in log.output
    assert "a + b" in mine and "a - b" in theirs and "a - b" in (lower / "calc.py").read_text()


def test_a_run_started_from_tmp_starts_its_workspaces(task, monkeypatch):
    monkeypatch.chdir("/tmp")  # (hidden as a working folder, the sandbox's own /tmp was left read-only)
    lower = prepare(task.repo, task.base_commit)

    async def go():
        async with await Workspace.start(lower) as ws:
            return await ws.run("cat calc.py && touch new && ls /tmp")

    r = asyncio.run(go())
    assert r.exit_code == 0 and "a - b" in r.output


def test_a_command_that_closes_its_output_before_it_exits_keeps_its_exit_status(task):
    """The output's end is not the command's: coreutils close theirs in their exit handlers (`ls`, the last of a
    command, was killed between the two on a loaded machine and its status read as -9)."""
    lower = prepare(task.repo, task.base_commit)

    async def go():
        async with await Workspace.start(lower) as ws:
            return (await ws.run("echo done; exec >&- 2>&-; sleep 0.3; exit 3", timeout=10),
                    await ws.run("exec >&- 2>&-; sleep 30", timeout=1))

    ended, hung = asyncio.run(go())
    assert (ended.exit_code, ended.output, ended.timed_out) == (3, "done\n", False)
    assert hung.timed_out and hung.exit_code is None


def test_a_workspace_contains_what_a_command_tries(task, tmp_path):
    lower = prepare(task.repo, task.base_commit)
    outside, marker = tmp_path / "outside", f"1000.{random.randrange(10**9)}"

    async def go():
        async with await Workspace.start(lower, Limits(output_chars=1000, disk_mb=32, memory_mb=256)) as ws:
            out = {}
            for name, cmd, timeout in [
                    ("net", "python -c 'import socket; socket.create_connection((\"1.1.1.1\", 80), timeout=2)'", 10),
                    ("home", f"cd {os.path.expanduser('~')} && ls -A; echo ---; cd {os.getcwd()} && ls -A", 10),
                    ("host", f"touch /usr/x; echo x > {outside}; echo $?", 10),
                    ("long", "yes | head -c 100000", 10),
                    ("hang", f"sleep {marker} & sleep 30", 1),
                    ("bomb", "bomb() { bomb | bomb & }; bomb", 3),
                    ("self", "kill -9 $$", 10),
                    ("disk", "head -c 64000000 /dev/zero > big; echo $?; rm -f big", 10),
                    ("memory", "python -c 'x = bytearray(512 << 20)'", 10),
                    ("after", "echo still here", 10)]:
                out[name] = await ws.run(cmd, timeout=timeout)
            return out

    out = asyncio.run(go())
    assert "Network is unreachable" in out["net"].output
    kept = [*_python_paths(), str(Path(grading.__file__).parent.parent)]  # Python and relayrl: shown beneath
    shown = [os.path.join(d, n) for d, names in zip((os.path.expanduser("~"), os.getcwd()),
                                                     out["home"].output.split("---")) for n in names.split()]
    assert all(any(k == s or k.startswith(s + "/") for k in kept) for s in shown), shown  # nothing else of them
    assert "Read-only file system" in out["host"].output and not outside.exists()
    assert "characters cut" in out["long"].output and len(out["long"].output) < 2200
    assert out["hang"].timed_out and out["hang"].exit_code is None and not _procs_with(marker)
    assert out["bomb"].timed_out or out["bomb"].exit_code is not None
    assert out["self"].exit_code == -9 and out["after"].output == "still here\n"
    assert "No space left on device" in out["disk"].output and "MemoryError" in out["memory"].output


def test_killing_the_trainer_leaves_no_workspace_behind(task, tmp_path):
    n = random.randrange(10**9)
    marker = f"1000.{n}"  # (the script's own command line holds it only in two parts)
    script = (f"import asyncio, sys\nfrom relayrl.workspaces.sandbox import Workspace\nfrom pathlib import Path\n"
              f"async def go():\n    ws = await Workspace.start(Path({str(prepare(task.repo, task.base_commit))!r}))\n"
              f"    await ws.run('setsid sleep 1000.' + '{n} > /dev/null 2>&1 < /dev/null & echo started', timeout=5)\n"
              f"    hung = asyncio.ensure_future(ws.run('sleep 1000.' + '{n}', timeout=500))\n"
              f"    await asyncio.sleep(0.5)\n    print('ready', flush=True)\n    await hung\nasyncio.run(go())\n")
    mounts = Path("/proc/self/mountinfo").read_text().count("overlay")
    trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                               cwd=Path(__file__).parent.parent)
    try:
        assert trainer.stdout.readline().strip() == "ready"
        sandboxes = _descendants(trainer.pid)  # bwrap, the keeper and the command running in it
        assert len(_procs_with(marker)) == 1  # (the setsid'd one left running was killed when its command ended)
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait()
        deadline = time.monotonic() + 10
        while [p for p in sandboxes if _alive(p)] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [p for p in sandboxes if _alive(p)] == [] and _procs_with(marker) == []
        assert Path("/proc/self/mountinfo").read_text().count("overlay") == mounts
    finally:
        trainer.kill()
        trainer.wait()


def _graded(task, command: str, reward: str = "resolved") -> grading.Outcome:
    lower = prepare(task.repo, task.base_commit)

    async def go():
        async with await Workspace.start(lower) as ws:
            await ws.run(command)
            diff = await ws.run("git add -A && git diff --cached --binary HEAD", keep=1 << 20)
        return await grading.grade(task, diff.output, lower, reward=reward)

    return asyncio.run(go())


def test_the_tests_decide(task):
    fixed, nothing = (_graded(task, c) for c in (FIX, NOTHING))
    assert (fixed.reward, fixed.resolved) == (1.0, True) and "a + b" in fixed.patch
    assert fixed.statuses == {"tests/test_add.py::test_add": "PASSED", "tests/test_zero.py::test_zero": "PASSED"}
    assert nothing.reward == 0.0 and nothing.statuses["tests/test_add.py::test_add"] == "FAILED"
    assert _graded(task, NOTHING, reward="fraction").reward == 0.5  # the PASS_TO_PASS test of two


def test_a_patch_already_tested_is_not_tested_again(task, monkeypatch):
    first = _graded(task, FIX)
    started, real = [], grading._test
    monkeypatch.setattr(grading, "_test", lambda *a: started.append(1) or real(*a))
    again = _graded(task, FIX + " && " + EDIT_TESTS)  # the same patch once the test file's change is dropped
    assert (again.reward, again.patch, again.statuses) == (first.reward, first.patch, first.statuses)
    assert again.dropped == ["tests/test_add.py"] and first.dropped == [] and started == []
    assert _graded(task, NOTHING).reward == 0.0 and started == [1]  # another patch: tested


def test_a_policy_that_edits_or_hooks_the_tests_scores_zero(task):
    edited, forged = (_graded(task, c) for c in (EDIT_TESTS, FORGE))
    assert edited.reward == 0.0 and edited.dropped == ["tests/test_add.py"]
    assert forged.reward == 0.0 and forged.dropped == ["conftest.py"]  # (without the filter: 1.0)


def test_grading_rules_by_hand():
    diff = ("diff --git a/src/m.py b/src/m.py\n+x\ndiff --git a/tests/helpers.py b/tests/helpers.py\n+y\n"
            "diff --git a/setup.cfg b/setup.cfg\n+z\ndiff --git a/img.png b/img.png\nGIT binary patch\n")
    kept, dropped = grading.filter_patch(diff, set())
    assert kept == "diff --git a/src/m.py b/src/m.py\n+x\n" and dropped == ["tests/helpers.py", "setup.cfg", "img.png"]
    out = "PASSED t.py::a\nFAILED t.py::b - assert 0\nSKIPPED t.py::c\n"
    assert grading.parse_statuses(out) == {"t.py::a": "PASSED", "t.py::b": "FAILED", "t.py::c": "SKIPPED"}
    st = grading.parse_statuses(out)
    assert grading.score(st, ["t.py::a"], ["t.py::c"], 1)[:2] == (1.0, True)
    assert grading.score(st, ["t.py::b"], [], 1)[:2] == (0.0, False)
    assert grading.score(st, ["t.py::a", "t.py::missing"], [], 1, "fraction")[0] == 0.5
    assert grading.score({"t.py::a": "PASSED"}, ["t.py::a"], [], 2)[0] == 0.0  # exits non-zero, no failure shown


def test_rows_in_swe_bench_format_are_prompts_and_a_broken_row_is_named(tmp_path):
    row = make_task(tmp_path)
    path = write_tasks(tmp_path, [row])
    (p,) = load_prompts(str(path))
    assert p.id == "calc-1" and p.messages == [{"role": "user", "content": row["problem_statement"]}]
    assert Task.of(p).fail_to_pass == ["tests/test_add.py::test_add"] and Task.of(p).repo == str(tmp_path / "repos/calc")
    for change, says in [({"repo": "repos/none"}, "line 2: field 'repo'/'base_commit': repo"),
                         ({"base_commit": "f" * 40}, "has no commit"),
                         ({"test_patch": "diff --git a/calc.py b/calc.py\n--- a/calc.py\n+++ b/calc.py\n@@ -1 +1 @@\n-nope\n+x\n"},
                          "line 2: field 'test_patch' does not apply"),
                         ({"FAIL_TO_PASS": "[]"}, "line 2: field 'FAIL_TO_PASS' names no test")]:
        bad = write_tasks(tmp_path, [row, {**row, "instance_id": "bad", **change}])
        with pytest.raises(DataError, match=says):
            load_prompts(str(bad))


def _call(name: str, **arguments) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def test_the_workspace_environment_edits_runs_and_submits(task):
    env = WorkspaceEnv(Settings(max_workspaces=1))
    prompt = Prompt("calc-1", [{"role": "user", "content": task.problem_statement}], metadata={KEY: task.to_dict()})

    async def go():
        messages = await env.reset(prompt)
        out = [await env.step(_call("view", path="calc.py")),
               await env.step(_call("str_replace", path="calc.py", old_str="return", new_str="return")),
               await env.step(_call("str_replace", path="calc.py", old_str="a - c", new_str="a + b")),
               await env.step(_call("create", path="calc.py", content="")),
               await env.step(_call("str_replace", path="calc.py", old_str="a - b", new_str="a + b")),
               await env.step(_call("bash", command="python -m pytest -q tests 2>&1 | tail -1; exit 3")),
               await env.step(_call("submit"))]
        return messages, out

    messages, out = asyncio.run(go())
    assert "/tmp/workspace" in messages[-1]["content"]
    view, twice, absent, exists, edited, ran, submitted = out
    assert "     2\t    return a - b" in view.messages[0]["content"]
    assert "not unique" in twice.messages[0]["content"] and "lines 2, 6" in twice.messages[0]["content"]
    assert "was not found" in absent.messages[0]["content"] and "exists already" in exists.messages[0]["content"]
    assert "return a + b" in edited.messages[0]["content"]
    assert "1 passed" in ran.messages[0]["content"] and ran.messages[0]["content"].endswith("\n[exit code 3]")
    assert submitted.done and submitted.reward == 1.0 and submitted.info == {"resolved": 1, "patch_files_dropped": 0}
    assert "a + b" in env.record["patch"] and env.ws.ws is None  # (graded, closed)


def test_the_built_in_task_set_is_fixed_by_its_one_line_and_not_without_it():
    """builtin:swe-demo-eval (relayrl.demo.swe_task): the bug its statement names is fixed by one line, which its
    hidden tests see; unchanged, the tests fail."""
    from relayrl.demo import swe_task

    rows = swe_task.make_rows(32, seed=2, split="eval")
    assert len({r["repo"] for r in rows}) == 32 and not {r["repo"] for r in rows} & {
        r["repo"] for r in swe_task.make_rows(100, seed=1, split="train")}
    for row in rows[:2]:
        task = from_row(row, "builtin:swe-demo-eval", "row")
        fix = row["fix"]
        edit = f"python -c \"import pathlib; p = pathlib.Path('{fix['path']}'); p.write_text(p.read_text().replace(" \
               f"{fix['old']!r}, {fix['new']!r}, 1))\""
        assert _graded(task, edit).reward == 1.0 and _graded(task, NOTHING).reward == 0.0, row["problem_statement"]
