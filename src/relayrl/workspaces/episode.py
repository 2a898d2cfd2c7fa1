"""An episode's workspace, from its start to the tests' verdict: what ``env.name=workspace`` and agent programs
(``prompt.workspace``) share.

    ws = EpisodeWorkspace(task, Settings())
    await ws.open()                        # waits for one of the run's max_workspaces slots
    r = await ws.run("ls", timeout=10)     # r.exit_code, r.output
    reward = await ws.verdict()            # the diff, graded in a fresh workspace; ws.record keeps it all
    await ws.close()                       # (verdict closes it too; close is safe to call twice)
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from relayrl.workspaces import grading
from relayrl.workspaces.sandbox import PATH, Limits, Result, Workspace, WorkspaceError, prepare
from relayrl.workspaces.tasks import Task


@dataclass(frozen=True)
class Settings:
    """The ``workspace`` section of the config, as the episodes use it."""

    max_workspaces: int = 16
    limits: Limits = field(default_factory=Limits)
    command_timeout_s: float = 30.0
    reward: str = "resolved"

    @classmethod
    def of(cls, cfg) -> Settings:
        """From the config's ``workspace`` section."""
        return cls(cfg.max_workspaces, Limits(memory_mb=cfg.memory_mb, disk_mb=cfg.disk_mb,
                                              output_chars=cfg.output_chars), cfg.command_timeout_s, cfg.reward)


class _Slots:
    """The run's bound on live workspaces: one semaphore per event loop (a loop's episodes share it)."""

    def __init__(self):
        self.by_loop: dict[int, tuple[int, asyncio.Semaphore]] = {}

    def get(self, n: int) -> asyncio.Semaphore:
        loop = id(asyncio.get_running_loop())
        if loop not in self.by_loop or self.by_loop[loop][0] != n:
            self.by_loop[loop] = (n, asyncio.Semaphore(n))
        return self.by_loop[loop][1]


_SLOTS = _Slots()


class EpisodeWorkspace:
    """``path``: where commands see the repository; ``run(command, timeout)``: bash there, in the sandbox."""

    path = PATH

    def __init__(self, task: Task, settings: Settings = Settings()):
        self.task, self.settings = task, settings
        self.ws: Workspace | None = None
        self.record: dict | None = None  # the graded outcome (grading.Outcome.summary)
        self._slot: asyncio.Semaphore | None = None

    async def open(self) -> EpisodeWorkspace:
        self.lower = await asyncio.to_thread(prepare, self.task.repo, self.task.base_commit)
        self._slot = _SLOTS.get(self.settings.max_workspaces)
        await self._slot.acquire()
        try:
            self.ws = await Workspace.start(self.lower, self.settings.limits)
        except BaseException:
            self._release()
            raise
        return self

    async def run(self, command: str | list[str], timeout: float | None = None, stdin: str | None = None) -> Result:
        if self.ws is None:
            raise WorkspaceError("the episode's workspace is closed (its tests have run)")
        return await self.ws.run(command, timeout=timeout or self.settings.command_timeout_s, stdin=stdin)

    async def verdict(self) -> float:
        """The tests' reward for the workspace as it stands; the workspace is closed."""
        diff = await self.ws.run("git add -A && git diff --cached --binary HEAD", timeout=60, keep=1 << 22)
        if diff.exit_code != 0 or diff.timed_out:
            raise WorkspaceError(f"git diff failed in the workspace: {diff.output[-300:]}")
        await self.close()
        outcome = await grading.grade(self.task, diff.output, self.lower, self.settings.limits, self.settings.reward)
        self.record = outcome.summary()
        return outcome.reward

    async def close(self) -> None:
        if self.ws is not None:
            ws, self.ws = self.ws, None
            try:
                await ws.close()
            finally:
                self._release()

    def _release(self) -> None:
        if self._slot is not None:
            self._slot.release()
            self._slot = None
