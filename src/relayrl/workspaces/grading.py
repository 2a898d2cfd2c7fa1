"""Rewards from a task's tests, which a policy can neither edit nor hook.

    outcome = await grade(task, diff, lower)     # Outcome(reward, resolved, statuses, dropped, ...)

The policy's diff (``git diff`` of everything it changed) is split by file and every change to a file
the tests own or read is **dropped** (``protected``): the test patch's files, ``conftest.py``, ``test_*.py``,
``*_test.py``, anything under a ``tests``/``test``/``testing`` folder, pytest's and tox's configuration
(``pytest.ini``, ``tox.ini``, ``setup.cfg``, ``pyproject.toml``), what Python imports before any test runs
(``sitecustomize.py``, ``usercustomize.py``, ``*.pth``) or instead of pytest (``pytest.py``, ``_pytest/``),
and binary files. The rest goes to a **fresh** workspace, where the test patch is applied and the tests run
(``python -m pytest -rA`` on the test files named by the test patch and the test ids, or the task's
``test_cmd``). Each test's status comes from pytest's summary lines; as in SWE-bench, a FAIL_TO_PASS test
counts when PASSED (or XFAIL), a PASS_TO_PASS test when PASSED (or SKIPPED, XFAIL); a test missing from the
summary has failed. A run that exits non-zero while reporting no failure is a forged report: 0.

A task's tests run once per distinct patch in a process: the verdict on a patch that was tested already (a
group's episodes that made the same change, or none) is the one it got, without running the tests again. As
SWE-bench, this takes a task's tests to be deterministic; a run of them that timed out is never reused.

Rewards (``WorkspaceEnv(reward=...)``): ``resolved`` (default): 1 when every FAIL_TO_PASS and every
PASS_TO_PASS test passes, else 0; ``fraction``: the share of those tests that pass (0 for a forged run).

What this cannot stop: code of the policy that the tests import runs inside pytest and could rewrite its
reports from there (as in every harness that imports the code under test, SWE-bench's included).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath

from relayrl.workspaces.sandbox import Limits, Workspace

_DIFF_HEAD = re.compile(r"^diff --git a/(.*?) b/(.*)$", re.MULTILINE)
_STATUS = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S+)", re.MULTILINE)
_TEST_DIRS = {"tests", "test", "testing"}
_TESTED: OrderedDict[str, Outcome] = OrderedDict()  # verdicts by task and patch (the module doc), newest last
_TESTED_MAX = 4096
_CONFIG = {"conftest.py", "pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml", "sitecustomize.py",
           "usercustomize.py", "pytest.py", "noxfile.py"}
REWARDS = ("resolved", "fraction")


@dataclass
class Outcome:
    """A graded episode: its reward, whether it resolved the task, each test's status, the diff that was
    tested, the files dropped from the policy's diff, and why it scored 0 when it was not the tests."""

    reward: float
    resolved: bool
    statuses: dict[str, str] = field(default_factory=dict)
    patch: str = ""
    dropped: list[str] = field(default_factory=list)
    note: str = ""

    def summary(self) -> dict:
        return {"reward": self.reward, "resolved": self.resolved, "statuses": self.statuses, "patch": self.patch,
                "dropped": self.dropped, "note": self.note}


def split_patch(diff: str) -> list[tuple[list[str], str]]:
    """The diff by file: ([paths it names], its text), in order."""
    heads = list(_DIFF_HEAD.finditer(diff))
    return [([m.group(1), m.group(2)], diff[m.start(): heads[i + 1].start() if i + 1 < len(heads) else len(diff)])
            for i, m in enumerate(heads)]


def patch_paths(patch: str) -> set[str]:
    return {p for paths, _ in split_patch(patch) for p in paths}


def protected(path: str, test_files: set[str]) -> bool:
    """Whether the policy's changes to ``path`` are dropped (see the module doc)."""
    p = PurePosixPath(path)
    name = p.name
    return (path in test_files or name in _CONFIG or name.endswith(".pth") or "_pytest" in p.parts
            or name.startswith("test_") and name.endswith(".py") or name.endswith("_test.py")
            or any(part in _TEST_DIRS for part in p.parts[:-1]))


def filter_patch(diff: str, test_files: set[str]) -> tuple[str, list[str]]:
    """(the diff without the protected and binary files' changes, the paths dropped)."""
    kept, dropped = [], []
    for paths, text in split_patch(diff):
        if any(protected(p, test_files) for p in paths) or "\nGIT binary patch\n" in text or "\nBinary files " in text:
            dropped.append(paths[1])
        else:
            kept.append(text)
    return "".join(kept), dropped


def parse_statuses(output: str) -> dict[str, str]:
    """Each test id's status from pytest's ``-rA`` summary (the last one named wins)."""
    return {m.group(2): m.group(1) for m in _STATUS.finditer(output)}


def score(statuses: dict[str, str], fail_to_pass: list[str], pass_to_pass: list[str], exit_code: int | None,
          reward: str = "resolved") -> tuple[float, bool, str]:
    """(reward, resolved, note) of a test run."""
    failures = any(s in ("FAILED", "ERROR") for s in statuses.values())
    if exit_code not in (0, None) and not failures and exit_code != 5:
        return 0.0, False, f"the tests exited {exit_code} but reported no failure (a forged report)"
    ok = [statuses.get(t) in ("PASSED", "XFAIL") for t in fail_to_pass]
    ok += [statuses.get(t) in ("PASSED", "SKIPPED", "XFAIL") for t in pass_to_pass]
    resolved = bool(ok) and all(ok)
    if reward == "fraction":
        return (sum(ok) / len(ok) if ok else 0.0), resolved, ""
    return float(resolved), resolved, ""


def test_command(task) -> list[str] | str:
    if task.test_cmd:
        return task.test_cmd
    files = sorted({t.split("::")[0] for t in [*task.fail_to_pass, *task.pass_to_pass]} | patch_paths(task.test_patch))
    files = [f for f in files if f.endswith(".py") and f != "/dev/null"]
    return ["python", "-m", "pytest", "-rA", "-p", "no:cacheprovider", "-o", "addopts=", *files]


async def grade(task, diff: str, lower: Path, limits: Limits = Limits(), reward: str = "resolved") -> Outcome:
    """The outcome of ``diff`` on ``task`` (a ``relayrl.workspaces.tasks.Task``): see the module doc.
    ``WorkspaceError`` when the fresh workspace fails (infrastructure: the episode fails, it is not scored)."""
    patch, dropped = filter_patch(diff, patch_paths(task.test_patch))
    key = hashlib.sha256(json.dumps([task.to_dict(), patch, reward], sort_keys=True).encode()).hexdigest()
    if key in _TESTED:
        _TESTED.move_to_end(key)
        return replace(_TESTED[key], dropped=dropped)
    outcome = await _test(task, patch, dropped, lower, limits, reward)
    if not outcome.note.startswith("the tests did not finish"):
        _TESTED[key] = outcome
        while len(_TESTED) > _TESTED_MAX:
            _TESTED.popitem(last=False)
    return outcome


async def _test(task, patch: str, dropped: list[str], lower: Path, limits: Limits, reward: str) -> Outcome:
    async with await Workspace.start(lower, limits) as ws:
        if patch.strip():
            applied = await ws.run(["git", "apply", "--whitespace=nowarn", "-"], timeout=60, stdin=patch)
            if applied.exit_code != 0:
                applied = await ws.run(["patch", "-p1", "--batch", "--forward", "--fuzz=5"], timeout=60, stdin=patch)
            if applied.exit_code != 0:
                return Outcome(0.0, False, {}, patch, dropped, "the patch did not apply: " + applied.output[-300:])
        if task.test_patch.strip():
            tp = await ws.run(["git", "apply", "--whitespace=nowarn", "-"], timeout=60, stdin=task.test_patch)
            if tp.exit_code != 0:  # (the checkout took it when the task was read: the policy's patch is in the way)
                return Outcome(0.0, False, {}, patch, dropped, "the test patch did not apply over the patch: "
                               + tp.output[-300:])
        run = await ws.run(test_command(task), timeout=task.test_timeout_s, keep=1 << 20)
    if run.timed_out:
        return Outcome(0.0, False, {}, patch, dropped, f"the tests did not finish within {task.test_timeout_s:g} s")
    statuses = parse_statuses(run.output)
    value, resolved, note = score(statuses, task.fail_to_pass, task.pass_to_pass, run.exit_code, reward)
    return Outcome(value, resolved, statuses, patch, dropped, note)
