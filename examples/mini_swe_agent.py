"""mini-swe-agent, unchanged, as a relayrl agent program: its own ``DefaultAgent``, its own prompts
(``mini_textbased.yaml``, shipped with it) and its own litellm model, pointed at the episode's session of
relayrl's endpoint; every command it runs goes to the episode's workspace (``prompt.workspace``: the task's
repository in relayrl's sandbox). It returns None: the task's tests decide the reward.

    pip install -e '.[swe]'                      # mini-swe-agent (and litellm)
    relayrl train examples/mini_swe_agent.yaml

Rows are tasks in SWE-bench's format (``relayrl.workspaces.tasks``). The one piece of relayrl here is
``WorkspaceEnvironment``, an implementation of mini-swe-agent's Environment protocol (it accepts any:
``environment_class``), which runs each command with bash in the workspace and raises mini-swe-agent's own
``Submitted`` on its submit line, as its local environment does. The agent runs in a thread
(``asyncio.to_thread``: mini-swe-agent is synchronous); its commands are run on the episode's event loop.

Offline and quiet: litellm reads its bundled cost map (``LITELLM_LOCAL_MODEL_COST_MAP``), costs are not
tracked (the policy has no price), a failed request is not retried for minutes
(``MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT=1``: relayrl answers 400 at the episode's limits), and mini-swe-agent's
global config lives in a temporary folder, not the home folder. ``step_limit`` should not exceed
``env.max_turns``.
"""

from __future__ import annotations

import asyncio
import os
import platform
import tempfile

for _key, _value in (("MSWEA_SILENT_STARTUP", "1"), ("LITELLM_LOCAL_MODEL_COST_MAP", "True"),
                     ("MSWEA_COST_TRACKING", "ignore_errors"), ("MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT", "1"),
                     ("MSWEA_GLOBAL_CONFIG_DIR", os.path.join(tempfile.gettempdir(), "relayrl-mini-swe-agent"))):
    os.environ.setdefault(_key, _value)

import yaml  # noqa: E402
from minisweagent.agents.default import DefaultAgent  # noqa: E402
from minisweagent.config import get_config_path  # noqa: E402
from minisweagent.exceptions import Submitted  # noqa: E402
from minisweagent.models import get_model  # noqa: E402

SUBMIT = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


class WorkspaceEnvironment:
    """mini-swe-agent's Environment on relayrl's episode workspace."""

    def __init__(self, workspace, loop: asyncio.AbstractEventLoop, timeout: float = 30.0):
        self.workspace, self.loop, self.timeout = workspace, loop, timeout
        self.config = {"cwd": workspace.path, "timeout": timeout}

    def execute(self, action: dict, cwd: str = "", *, timeout: float | None = None) -> dict:
        done = asyncio.run_coroutine_threadsafe(
            self.workspace.run(action.get("command", ""), timeout=timeout or self.timeout), self.loop)
        r = done.result()
        output = {"output": r.output, "returncode": -1 if r.exit_code is None else r.exit_code,
                  "exception_info": f"the command timed out after {timeout or self.timeout:g} s" if r.timed_out else ""}
        lines = r.output.lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == SUBMIT and r.exit_code == 0:
            submission = "".join(lines[1:])
            raise Submitted({"role": "exit", "content": submission,
                             "extra": {"exit_status": "Submitted", "submission": submission}})
        return output

    def get_template_vars(self, **kwargs) -> dict:
        return {**platform.uname()._asdict(), **self.config, **kwargs}

    def serialize(self) -> dict:
        return {"info": {"config": {"environment": self.config, "environment_type": "relayrl workspace"}}}


async def run(client, prompt, config: str = "mini_textbased.yaml", step_limit: int = 8, timeout: float = 30.0,
              agent: dict | None = None, model: dict | None = None):
    """``config``: mini-swe-agent's config (a name it ships or a path); ``agent``, ``model``: settings of its agent
    and model sections to replace (examples/mini_swe_agent.yaml shortens their templates for the demo model's
    512-token context)."""
    if prompt.workspace is None:
        raise ValueError("examples/mini_swe_agent.py: its rows must be tasks in SWE-bench's format (a workspace each)")
    settings = yaml.safe_load(get_config_path(config).read_text())
    llm = get_model(config={**settings.get("model", {}), **(model or {}), "model_name": "openai/policy",
                            "model_class": "litellm_textbased", "cost_tracking": "ignore_errors",
                            "model_kwargs": {"api_base": str(client.base_url), "api_key": client.api_key}})
    env = WorkspaceEnvironment(prompt.workspace, asyncio.get_running_loop(), timeout)
    runner = DefaultAgent(llm, env, **{**settings.get("agent", {}), **(agent or {}), "step_limit": step_limit,
                                       "cost_limit": 0})
    await asyncio.to_thread(runner.run, prompt.messages[-1]["content"])
    return None  # the task's tests decide
