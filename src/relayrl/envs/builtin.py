"""Built-in environments, chosen in the config by name (``env.name``)."""

from __future__ import annotations

from relayrl.envs.base import ToolEnv, sleepy


class CalculatorEnv(ToolEnv):
    """The agent demo's task: arithmetic with a ``calculator`` tool; the final answer (a turn
    without a tool call) is scored by ``reward.fn``. ``delay_s`` adds latency to each call (the
    tool-latency benchmark's setting: AsyncTool's 0.2 s)."""

    def __init__(self, delay_s: float = 0.0, timeout_s: float = 10.0, max_calls: int = 8):
        from relayrl.demo.agent_task import calculator

        super().__init__([sleepy(calculator, delay_s) if delay_s else calculator], timeout_s, max_calls)


class PythonEnv(ToolEnv):
    """A ``python`` tool that runs the model's code in the sandboxed worker pool
    (``relayrl.envs.python_tool``: bubblewrap, no network, limits); the final answer is scored
    by ``reward.fn``. The tool's own time limit (10 s) ends a call before ``timeout_s`` does."""

    def __init__(self, timeout_s: float = 20.0, max_calls: int = 4):
        from relayrl.envs.python_tool import python

        super().__init__([python], timeout_s, max_calls)
