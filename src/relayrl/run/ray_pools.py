"""The isolated worker pools as Ray actors (``run.backend=ray``): the verifier's and the
``python`` tool's.

Each actor runs on the driver's node (a node-affinity placement, never soft): it works in the run's working
directory, which is this machine's, and a pool Ray placed on another node would be lost with that node (a run of
2026-12-07 read an engine node's leaving as its verifier's failure). A pool actor that is lost all the same stops the
run naming it, as an engine's loss does: it is not the user's code failing.

Each actor holds the pool (its worker processes with their deadlines, memory limits and
bubblewrap live on the actor's node); ``RayRewardRunner`` and ``RayPythonTool`` are this side's
stand-ins with the local classes' interfaces. The actors work in the run's working directory, so
``reward.fn=my_module:fn`` resolves as it does locally, and the sandbox hides that directory.
"""

from __future__ import annotations

import os
from concurrent.futures import Future

from relayrl.engine.base import EngineError
from relayrl.envs.python_tool import PythonTool
from relayrl.rewards.verifiers import RewardRunner, RewardStats


def _here(ray) -> dict:
    """Actor options placing it on this process's node."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = ray.get_runtime_context().get_node_id()
    return {"num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node, soft=False)}


class RewardActor:
    def __init__(self, kwargs: dict, cwd: str):
        os.chdir(cwd)
        self.error = None
        try:
            self.runner = RewardRunner(**kwargs)
        except Exception as e:  # noqa: BLE001 - reported by ready(), raised in the driver as it would be locally
            self.runner, self.error = None, (type(e).__name__, str(e))

    def ready(self):
        return self.error

    def score(self, items: list) -> tuple[list, int, int, list[str], str | None]:
        """The scores; the failures, timeouts and error texts this call added; the last error."""
        s = self.runner.stats
        before = (s.failures, s.timeouts, len(s.errors))
        out = self.runner.score(items)
        return out, s.failures - before[0], s.timeouts - before[1], s.errors[before[2]:], s.last_error

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()


class RayRewardRunner:
    def __init__(self, spec: str, **kwargs):
        import ray

        self._ray = ray
        self.spec = spec
        self.stats = RewardStats()
        self._actor = ray.remote(max_concurrency=16, **_here(ray))(RewardActor).remote(
            {"spec": spec, **kwargs}, os.getcwd())
        error = ray.get(self._actor.ready.remote())
        if error is not None:
            kind, text = error
            self.close()
            raise (RuntimeError if kind == "RuntimeError" else ValueError)(text)

    def score(self, items: list) -> list[tuple[float, dict | None]]:
        try:
            out, failures, timeouts, errors, last = self._ray.get(self._actor.score.remote(items))
        except self._ray.exceptions.RayActorError as e:
            raise EngineError(f"the verifier pool's Ray actor ({self.spec}) was lost: {type(e).__name__}") from None
        self.stats.failures += failures
        self.stats.timeouts += timeouts
        if failures or timeouts:
            self.stats.last_error = last
        self.stats.errors += errors[:max(0, 20 - len(self.stats.errors))]
        return out

    def close(self) -> None:
        try:
            self._ray.get(self._actor.close.remote(), timeout=30)
        except Exception:  # noqa: BLE001 - gone already
            pass
        self._ray.kill(self._actor)


class ToolActor:
    def __init__(self, kwargs: dict, cwd: str):
        os.chdir(cwd)
        self.error = None
        try:
            self.tool = PythonTool(**kwargs)
        except Exception as e:  # noqa: BLE001 - raised in the driver by ready()
            self.tool, self.error = None, f"{type(e).__name__}: {e}"

    def ready(self) -> str | None:
        return self.error

    def pid(self) -> int:
        return os.getpid()

    def run(self, code: str, timeout_s: float | None) -> str:
        return self.tool(code, timeout_s)

    def close(self) -> None:
        if self.tool is not None:
            self.tool.close()


class RayPythonTool:
    """``PythonTool`` (same arguments, calls and text) with its worker pool in a Ray actor. A call
    that the actor's death cuts short reads as a sandbox failure, as a lost local pool's does."""

    def __init__(self, **kwargs):
        import ray

        self._ray = ray
        self._actor = ray.remote(max_concurrency=64, **_here(ray))(ToolActor).remote(kwargs, os.getcwd())
        error = ray.get(self._actor.ready.remote())
        if error is not None:
            self.close()
            raise RuntimeError(f"the python tool's Ray actor could not start its workers: {error}")

    def __call__(self, code: str, timeout_s: float | None = None) -> str:
        return self.submit(code, timeout_s).result()

    def submit(self, code: str, timeout_s: float | None = None) -> Future:
        if not isinstance(code, str):
            raise TypeError(f"code must be a str, not {type(code).__name__}")
        inner, outer = self._actor.run.remote(code, timeout_s).future(), Future()
        outer.set_running_or_notify_cancel()

        def resolve(fut: Future) -> None:
            try:
                outer.set_result(fut.result())
            except self._ray.exceptions.RayActorError as e:
                outer.set_result(f"[the sandbox failed: its Ray actor was lost ({type(e).__name__})]")
            except BaseException as e:  # noqa: BLE001 - the caller's to see
                outer.set_exception(e)

        inner.add_done_callback(resolve)
        return outer

    as_function = PythonTool.as_function

    def close(self) -> None:
        actor, self._actor = self._actor, None
        if actor is None or not self._ray.is_initialized():  # (closed, or Ray shut down first)
            return
        try:
            self._ray.get(actor.close.remote(), timeout=30)
            self._ray.kill(actor)
        except Exception:  # noqa: BLE001 - gone already
            pass
