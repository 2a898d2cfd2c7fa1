"""The ``workspace`` section: per-episode sandboxed repositories (``relayrl.workspaces``) for env.name=workspace
and for agent programs whose rows are tasks in SWE-bench's format."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from relayrl.config.sections import _Section


class WorkspaceCfg(_Section):
    """Workspaces: a task's repository at its commit per episode, in a bubblewrap sandbox (relayrl.workspaces)."""

    max_workspaces: int = Field(
        16, ge=1, description="Workspaces that exist at once (an episode waits for one). Each holds up to "
        "workspace.disk_mb of memory (its changes live in a tmpfs) and runs commands of up to workspace.memory_mb: "
        "their product with this bounds the memory workspaces take.")
    memory_mb: int = Field(1024, ge=64, description="Address space of each process a command starts (RLIMIT_AS).")
    disk_mb: int = Field(256, ge=16, description="The workspace's private /tmp (a tmpfs: memory), which holds every "
                         "change to the repository; a command that fills it gets 'No space left on device'.")
    command_timeout_s: float = Field(30.0, gt=0, description="Deadline of each command (the bash tool; an agent "
                                     "program's prompt.workspace.run without a timeout); past it every process the "
                                     "command started is killed.")
    output_chars: int = Field(10000, ge=100, description="Of a command's output the first and the last this many "
                              "bytes are kept; what lies between is cut, with a note saying how much.")
    reward: Literal["resolved", "fraction"] = Field(
        "resolved", description="resolved: 1 when every FAIL_TO_PASS and PASS_TO_PASS test passes, else 0; fraction: "
        "the share of them that pass (relayrl.workspaces.grading).")
