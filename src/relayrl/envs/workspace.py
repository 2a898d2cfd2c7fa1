"""``env.name=workspace``: a coding agent in its own sandboxed checkout of the task's repository
(``relayrl.workspaces``), with the tools such agents expect, rewarded by the task's tests.

Tools: ``bash`` (one command in the repository folder, under a deadline; its exit status and output, cut
in the middle past ``output_chars`` with a note), ``view`` (a file's numbered lines, or a folder's
entries), ``create`` (a new file), ``str_replace`` (replace one exact occurrence: an error when the text
is not there or is there more than once — the SWE-agent / OpenHands editor's contract) and ``submit``.
The episode ends at ``submit``, at a turn without a tool call, or at its turn or token limit; then the
workspace's diff is graded in a fresh workspace (``relayrl.workspaces.grading``) and the reward is the
tests' verdict. The episode's record (``info["workspace"]``) keeps the diff that was tested, the files
dropped from it, each test's status and why it scored 0 when the tests did not decide.

Rows must be tasks in SWE-bench's format (``relayrl.workspaces.tasks``). At most ``max_workspaces``
workspaces of the run exist at once (each may hold ``disk_mb`` of memory in its tmpfs and run commands of
``memory_mb``); an episode waits for one. A workspace that fails (its sandbox, its mount) fails the
episode: it is left out and counted (``run.max_failure_frac``), never scored 0.
"""

from __future__ import annotations

import json
import sys

from relayrl.envs.base import StepResult, ToolEnv
from relayrl.envs.tools import parse_tool_calls
from relayrl.workspaces import grading
from relayrl.workspaces.episode import EpisodeWorkspace, Settings
from relayrl.workspaces.sandbox import PATH
from relayrl.workspaces.tasks import Task

_EDITOR = "relayrl/workspaces/editor.py"
INSTRUCTIONS = ("The repository is checked out at {path} (your working folder). Find the cause, change the code "
                "with the tools (bash, view, create, str_replace), run what helps you check it, and call submit "
                "when the issue is fixed.")


class WorkspaceEnv(ToolEnv):
    """Made by the run with the config's ``workspace`` section (``relayrl.workspaces.episode.Settings``)."""

    def __init__(self, settings: Settings = Settings(), max_calls: int = 4):
        if settings.reward not in grading.REWARDS:
            raise ValueError(f"workspace.reward={settings.reward!r}: one of {', '.join(grading.REWARDS)}")
        self.settings, self.command_timeout_s = settings, settings.command_timeout_s
        super().__init__([self.bash, self.view, self.create, self.str_replace, self.submit],
                         timeout_s=settings.command_timeout_s + 30, max_calls=max_calls)
        self.ws: EpisodeWorkspace | None = None

    @property
    def record(self) -> dict | None:
        return self.ws.record if self.ws else None

    async def reset(self, prompt) -> list[dict]:
        task = Task.of(prompt)
        if task is None:
            raise ValueError(f"prompt {prompt.id!r} is no workspace task: env.name=workspace needs rows in "
                             "SWE-bench's format (instance_id, repo, base_commit, problem_statement, ...)")
        self.ws = await EpisodeWorkspace(task, self.settings).open()
        messages = [dict(m) for m in prompt.messages]
        messages[-1]["content"] += "\n\n" + INSTRUCTIONS.format(path=PATH)
        return messages

    async def step(self, text: str) -> StepResult:
        calls = parse_tool_calls(text)
        if not calls or any(c.name == "submit" for c in calls):
            return StepResult(reward=await self.final_reward(), done=True, info=self._info())
        return await super().step(text)

    async def final_reward(self) -> float:
        """The tests' verdict on the workspace as it stands (also when the episode ran out of turns)."""
        return await self.ws.verdict()

    def _info(self) -> dict:
        r = self.record or {}
        return {"resolved": int(bool(r.get("resolved"))), "patch_files_dropped": len(r.get("dropped", []))}

    async def close(self) -> None:
        if self.ws is not None:
            await self.ws.close()

    # -- the tools (what the model sees: their names, arguments and docstrings)

    async def bash(self, command: str) -> str:
        """Run a shell command in the repository folder.

        Args:
            command: The command, run by bash.
        """
        r = await self.ws.run(command)
        status = f"[timed out after {self.command_timeout_s:g} s]" if r.timed_out else f"[exit code {r.exit_code}]"
        return f"{r.output}{'' if not r.output or r.output.endswith(chr(10)) else chr(10)}{status}"

    async def view(self, path: str, start_line: int = 1, end_line: int = -1) -> str:
        """Show a file's lines, numbered (or a folder's entries).

        Args:
            path: The file or folder, relative to the repository folder.
            start_line: The first line to show.
            end_line: The last line to show (-1: to the end).
        """
        return await self._edit("view", {"path": path, "start_line": start_line, "end_line": end_line})

    async def create(self, path: str, content: str) -> str:
        """Create a new file (an error if it exists).

        Args:
            path: The file, relative to the repository folder.
            content: What it holds.
        """
        return await self._edit("create", {"path": path, "content": content})

    async def str_replace(self, path: str, old_str: str, new_str: str) -> str:
        """Replace the one occurrence of old_str in a file by new_str (an error if it is not there, or is there
        more than once: then give more context).

        Args:
            path: The file, relative to the repository folder.
            old_str: The exact text to replace, whitespace included.
            new_str: The text to put in its place.
        """
        return await self._edit("str_replace", {"path": path, "old_str": old_str, "new_str": new_str})

    async def submit(self) -> str:
        """Submit the changes: the episode ends and the tests decide."""
        return "submitted"

    async def _edit(self, op: str, args: dict) -> str:
        from relayrl.workers.pool import _package_root

        editor = f"{_package_root()}/{_EDITOR}"
        r = await self.ws.run([sys.executable, "-I", "-S", editor, op], timeout=self.command_timeout_s,
                              stdin=json.dumps(args))
        if r.timed_out:
            return f"error: {op} timed out"
        return r.output.rstrip("\n") if r.exit_code == 0 else f"error: {r.output.strip()}"
