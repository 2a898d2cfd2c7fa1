"""The environment API: what an agent's episode talks to, over OpenAI-style messages.

    class Env:
        tools = []                                    # plain functions the chat template shows
        async def reset(self, prompt) -> messages     # the conversation the policy starts from
        async def step(self, text) -> StepResult      # the policy's turn in, observations out

One instance per episode (state lives on ``self``; ``args`` from the config go to the
constructor). ``step`` gets the assistant turn as text and returns the messages that follow it
(tool results, a user turn), that step's reward and whether the episode is over. A final step
with ``reward=None`` is scored by the run's verifier (``reward.fn``) on that turn's text, so a
task whose answer a verifier checks needs no reward code of its own.

``ToolEnv`` is the tool-using agent: it parses the template's tool calls, runs them at once, each
under its own deadline, and returns each result or error (bad JSON, unknown tool, a raised
exception, a timeout) as a tool message; a turn without a tool call is the final answer. A tool
that returns a PIL image (a screenshot) returns it as an image part, which a vision-language policy
sees in its next turn; ``step`` may return image parts too (``docs/guides/vision.md``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import importlib.util
import inspect
import pathlib
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from relayrl.envs.tools import ToolCall, is_image, parse_tool_calls, tool_result_message, tool_schemas
from relayrl.records import Prompt


@dataclass
class StepResult:
    """What follows one assistant turn."""

    messages: list[dict] = field(default_factory=list)  # observations: tool results, a user turn
    reward: float | None = 0.0  # this step's reward; None on the last step: scored by reward.fn
    done: bool = False
    info: dict = field(default_factory=dict)  # counts summed into the episode's metrics
    raised: list[str] = field(default_factory=list)  # what tools raised this step (the run's failure report)


class Env:
    """Base class (any object with async ``reset``/``step`` and a ``tools`` list will do)."""

    tools: list[Callable] = []

    async def reset(self, prompt: Prompt) -> list[dict]:
        return list(prompt.messages)

    async def step(self, text: str) -> StepResult:
        return StepResult(reward=None, done=True)  # one turn, scored by the verifier


# Sync tools run here, not on asyncio's default executor (a handful of threads): a slow tool
# must not queue the other episodes' calls behind it. A timed-out sync call's thread runs on to
# its end (threads cannot be killed); tools that must be stopped are async or use a worker pool.
_TOOL_THREADS = concurrent.futures.ThreadPoolExecutor(64, thread_name_prefix="relayrl-tool")


class ToolEnv(Env):
    """Calls tools until the policy answers without one.

    ``tools``: plain functions with type hints and a docstring (their schemas come from
    ``get_json_schema``), sync or async. ``timeout_s``: each call's deadline; an async tool is
    cancelled there. ``max_calls``: calls run per turn (more are answered with an error)."""

    def __init__(self, tools: list[Callable] | None = None, timeout_s: float = 10.0, max_calls: int = 8):
        if tools is not None:
            self.tools = list(tools)
        self.timeout_s, self.max_calls = timeout_s, max_calls
        self._by_name = {s["function"]["name"]: fn for s, fn in zip(tool_schemas(self.tools), self.tools)}

    async def step(self, text: str) -> StepResult:
        calls = parse_tool_calls(text)
        if not calls:
            return StepResult(reward=None, done=True)
        results = await asyncio.gather(*(self._run(c) for c in calls[: self.max_calls]))
        results += [(f"error: more than {self.max_calls} tool calls in one turn", "error")] * (len(calls) - self.max_calls)
        info = {"tool_calls": len(calls), "tool_errors": sum(k in ("error", "raised") for _, k in results),
                "tool_timeouts": sum(k == "timeout" for _, k in results),
                "tool_raised": sum(k == "raised" for _, k in results)}
        raised = [f"tool {c.name}: {out.removeprefix('error: ')}" for c, (out, k) in zip(calls, results) if k == "raised"]
        return StepResult([tool_result_message(c, out) for c, (out, _) in zip(calls, results)], info=info, raised=raised)

    async def _run(self, call: ToolCall) -> tuple[str, str]:
        """(what the model reads, "ok" | "error" | "raised" | "timeout"): "error" is the model's
        mistake (a malformed call, an unknown tool, arguments the function does not take), "raised"
        an exception inside the tool (the model reads it too; a step where every call raised stops
        the run: ``relayrl.failures``)."""
        if call.error:
            return f"error: {call.error}", "error"
        fn = self._by_name.get(call.name)
        if fn is None:
            return f"error: unknown tool {call.name!r}; available: {', '.join(self._by_name)}", "error"
        try:
            inspect.signature(fn).bind(**call.arguments)
        except TypeError as e:
            return f"error: {call.name}: {e}", "error"
        except ValueError:  # no signature to check
            pass
        try:
            if inspect.iscoroutinefunction(fn):
                out = await asyncio.wait_for(fn(**call.arguments), self.timeout_s)
            else:
                loop = asyncio.get_running_loop()
                out = await asyncio.wait_for(loop.run_in_executor(_TOOL_THREADS, lambda: fn(**call.arguments)),
                                             self.timeout_s)
        except asyncio.TimeoutError:
            return f"error: {call.name} timed out after {self.timeout_s:g} s", "timeout"
        except Exception as e:  # noqa: BLE001 - the model reads what went wrong
            return f"error: {type(e).__name__}: {e}", "raised"
        return (out if is_image(out) else str(out)), "ok"  # (an image: the model sees it, if it sees)


def sleepy(fn: Callable, delay_s: float) -> Callable:
    """``fn`` taking ``delay_s`` longer per call (a tool with a service's latency; benchmarks)."""
    import functools

    @functools.wraps(fn)
    def slow(*args, **kwargs):
        time.sleep(delay_s)
        return fn(*args, **kwargs)

    return slow


BUILTIN = {
    "single_turn": "relayrl.envs.base:Env",
    "calculator": "relayrl.envs.builtin:CalculatorEnv",
    "python": "relayrl.envs.builtin:PythonEnv",
    "workspace": "relayrl.envs.workspace:WorkspaceEnv",  # a coding agent in a sandboxed repository (relayrl.workspaces)
    "nim": "relayrl.envs.games:Nim",  # a two-player game (relayrl.envs.multi): self-play
    "proposer_solver": "relayrl.envs.games:ProposerSolver",  # a curriculum on the demo task (relayrl.envs.multi)
    "gui": "relayrl.envs.gui:GuiEnv",  # a GUI agent acting on screenshots (a vision-language policy)
}


def import_object(spec: str, field: str = "env.name"):
    """The object named by ``module:attr`` (importable from the working directory) or
    ``path/file.py:attr``; a ``ValueError`` naming ``field`` otherwise."""
    mod_name, sep, attr = spec.rpartition(":")
    if not sep or not mod_name or not attr:
        raise ValueError(f"{field}={spec!r}: expected 'module:name' or 'path/file.py:name'")
    try:
        if mod_name.endswith(".py"):
            path = pathlib.Path(mod_name)
            if not path.is_file():
                raise ValueError(f"{field}={spec!r}: no such file {mod_name}")
            found = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(found)
            found.loader.exec_module(module)
        else:
            if "" not in sys.path and "." not in sys.path:  # the project folder, as for reward.fn
                sys.path.insert(0, "")
            module = importlib.import_module(mod_name)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - reported with the field
        raise ValueError(f"{field}={spec!r}: cannot import {mod_name}: {type(e).__name__}: {e}") from e
    obj = getattr(module, attr, None)
    if obj is None:
        raise ValueError(f"{field}={spec!r}: {mod_name} has no {attr!r}")
    return obj


def load_env_class(spec: str) -> type:
    """An environment class by built-in name, ``module:Class`` or ``path/file.py:Class``."""
    if spec not in BUILTIN and ":" not in spec:
        raise ValueError(f"env.name={spec!r}: not a built-in environment ({', '.join(BUILTIN)}) "
                         f"nor 'module:Class' / 'file.py:Class'")
    cls = import_object(BUILTIN.get(spec, spec))
    if not (hasattr(cls, "reset") and hasattr(cls, "step")):
        raise ValueError(f"env.name={spec!r}: {cls!r} has no reset/step methods (see relayrl.envs.base.Env)")
    return cls


# env.name=<prefix>:<name>: environments of other libraries (``relayrl.envs.adapters``), made with the
# name as their first argument
ADAPTERS = {
    "textarena": "relayrl.envs.adapters.textarena:TextArenaEnv",
    "skyrl": "relayrl.envs.adapters.skyrl:SkyRLEnv",
}


def make_env_factory(spec: str, args: dict):
    """A function making one environment per episode; fails now (naming the field) when the class
    cannot be imported or does not take ``env.args``. (``agent:...`` is no environment: an agent
    program's episodes are sessions of the endpoint, ``relayrl.serve.agent.AgentProgram``.)"""
    kind, _, name = spec.partition(":")
    if kind == "agent":
        raise ValueError(f"env.name={spec!r} names an agent program, not an environment: "
                         "relayrl.serve.agent.AgentProgram.load runs it")
    if kind in ADAPTERS and name:
        cls = import_object(ADAPTERS[kind])
        cls.check(name)  # its package is there and knows the name: fails now, naming the extra to install
        try:
            inspect.signature(cls).bind(name, **args)
        except TypeError as e:
            raise ValueError(f"env.args do not fit {cls.__name__}: {e}") from e
        return lambda: cls(name, **args)
    cls = load_env_class(spec)
    try:
        inspect.signature(cls).bind(**args)
    except TypeError as e:
        raise ValueError(f"env.args do not fit {cls.__name__}: {e}") from e
    except ValueError:  # no signature to check (a builtin); the first episode will tell
        pass
    return lambda: cls(**args)
