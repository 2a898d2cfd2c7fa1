"""The verifier's worker pool as a Ray actor (``run.backend=ray``).

The actor holds a ``RewardRunner`` (its isolated worker processes with their deadlines, memory
limits and optional bubblewrap live on the actor's node); ``RayRewardRunner`` is this side's
stand-in with the same ``score``/``stats``/``close``. The actor works in the run's working
directory, so ``reward.fn=my_module:fn`` resolves as it does locally.
"""

from __future__ import annotations

import os

from relayrl.rewards import RewardRunner, RewardStats


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
        self._actor = ray.remote(num_cpus=0, max_concurrency=16)(RewardActor).remote(
            {"spec": spec, **kwargs}, os.getcwd())
        error = ray.get(self._actor.ready.remote())
        if error is not None:
            kind, text = error
            self.close()
            raise (RuntimeError if kind == "RuntimeError" else ValueError)(text)

    def score(self, items: list) -> list[tuple[float, bool]]:
        out, failures, timeouts, errors, last = self._ray.get(self._actor.score.remote(items))
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
