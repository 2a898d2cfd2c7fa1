"""What scores an episode once its turns are done, beside its verifier: a judge (``reward.judge``) and the
teachers of on-policy distillation (``teacher``). Both run as the verifier does: off the episodes' event
loop, the calls of episodes that ended together sent as one batch, under a deadline; a call that fails or
passes it fails its episode (kinds ``judge``/``judge_timeout``, ``teacher``/``teacher_timeout``: left out,
counted, ``run.max_failure_frac``), never a reward of 0 or a missing teacher term.

- The judge (pointwise: here, per episode; ranking: per group, once its episodes are done) gives a score in
  [0, 1]; a training episode's reward becomes ``reward.fn_weight × its own + reward.judge.weight × judge``.
  An evaluation episode keeps reward.fn's score (the held-out accuracy is the verifier's), or with
  ``reward.fn=none`` takes the judge's.
- A teacher gives the log-probs of the policy's own tokens (``Trajectory.teacher_logprobs``, 0 on the tokens
  of the environment between turns); training episodes only.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

from relayrl.failures import fail, failed
from relayrl.records import Group, Trajectory
from relayrl.rewards.judge import JudgeFailure


class Batches:
    """``await batches(key, item)``: the items submitted in one loop iteration under one ``key`` go to
    ``fn(key, items)`` (blocking, on ``executor``) together; each gets its result, or the call's exception."""

    def __init__(self, loop: asyncio.AbstractEventLoop, executor, fn: Callable[[object, list], list]):
        self.loop, self.executor, self.fn = loop, executor, fn
        self._pending: dict[int, tuple[object, list]] = {}

    async def __call__(self, key, item):
        fut = self.loop.create_future()
        if not self._pending:
            self.loop.call_soon(self._send)
        self._pending.setdefault(id(key), (key, []))[1].append((item, fut))
        return await fut

    def _send(self) -> None:
        pending, self._pending = self._pending, {}
        for key, entries in pending.values():
            job = self.loop.run_in_executor(self.executor, self.fn, key, [item for item, _ in entries])

            def resolve(job: asyncio.Future, entries=entries) -> None:
                error = job.exception() if not job.cancelled() else asyncio.CancelledError()
                for i, (_, fut) in enumerate(entries):
                    if not fut.done():
                        fut.set_exception(error) if error else fut.set_result(job.result()[i])

            job.add_done_callback(resolve)


class EpisodeScoring:
    """The judge and the teachers of a run (either may be None), on the runner's loop and executor."""

    def __init__(self, loop, executor, judge=None, teachers=None, fn_weight: float = 1.0, judge_weight: float = 1.0,
                 judge_in_eval: bool = False, teacher_timeout_s: float = 120.0):
        self.judge, self.teachers = judge, teachers
        self.fn_weight, self.judge_weight, self.judge_in_eval = fn_weight, judge_weight, judge_in_eval
        self.teacher_timeout_s = teacher_timeout_s
        self.seconds = {"judge": 0.0, "teacher": 0.0}  # spent in their calls since ``take_times`` (summed)
        self._lock = threading.Lock()
        self._judged = Batches(loop, executor, self._timed("judge", lambda _, items: judge.score_pointwise(items))) \
            if judge else None
        self._ranked = Batches(loop, executor, self._timed("judge", lambda _, items: judge.score_groups(items))) \
            if judge else None
        self._taught = Batches(loop, executor, self._timed("teacher", lambda teacher, items: teacher.score(items))) \
            if teachers else None

    def _timed(self, what: str, fn):
        def run(key, items):
            t0 = time.perf_counter()
            try:
                return fn(key, items)
            finally:
                with self._lock:
                    self.seconds[what] += time.perf_counter() - t0
        return run

    def take_times(self) -> dict:
        """``time/judge``, ``time/teacher``: seconds their calls took since the last call (summed over calls; they
        run off the loop, beside generation)."""
        with self._lock:
            out = {f"time/{k}": round(v, 4) for k, v in self.seconds.items()
                   if (k == "judge" and self.judge) or (k == "teacher" and self.teachers)}
            self.seconds = dict.fromkeys(self.seconds, 0.0)
        return out

    @property
    def ranking(self) -> bool:
        return self.judge is not None and self.judge.mode == "ranking"

    def _judging(self, train: bool) -> bool:
        return self.judge is not None and (train or self.judge_in_eval)

    async def episode(self, t: Trajectory, train: bool) -> None:
        """After a successful episode's body: its pointwise judgment, then its teacher's log-probs."""
        if failed(t):
            return
        if self._judging(train) and not self.ranking:
            await self._deadline(t, "judge", self.judge.name, self.judge.cfg.timeout_s, "reward.judge.timeout_s",
                                 self._judge_one(t, train))
        if train and self.teachers is not None and not failed(t):
            teacher = self.teachers.for_prompt(t.prompt)
            await self._deadline(t, "teacher", teacher.name, self.teacher_timeout_s, "teacher.timeout_s",
                                 self._teach(t, teacher))

    async def group(self, g: Group, train: bool) -> None:
        """A ranking judge's scores for a group whose episodes are done (those not failed)."""
        if not (self.ranking and self._judging(train)):
            return
        members = [t for t in g.trajectories if not failed(t)]
        if not members:
            return
        try:
            scores = await asyncio.wait_for(self._ranked(None, (g.prompt, [t.text for t in members])),
                                            self.judge.cfg.timeout_s * 2)
        except asyncio.TimeoutError:
            scores = JudgeFailure(f"no ranking within {self.judge.cfg.timeout_s * 2:g} s (twice "
                                  "reward.judge.timeout_s)", timeout=True)
        for t, s in zip(members, scores if isinstance(scores, list) else [scores] * len(members)):
            self._set(t, s, train)

    async def _judge_one(self, t: Trajectory, train: bool) -> None:
        self._set(t, await self._judged(None, (t.prompt, t.text)), train)

    def _set(self, t: Trajectory, score, train: bool) -> None:
        if isinstance(score, JudgeFailure):
            fail(t, "judge_timeout" if score.timeout else "judge", self.judge.name, str(score))
            return
        own = t.info.setdefault("reward_own", t.reward)  # (its own reward, once: a group re-ranked keeps it)
        t.info["judge"] = score
        if train:
            t.reward = self.fn_weight * own + self.judge_weight * score
        else:  # (held-out: reward.fn's score stays, unless there is none)
            t.reward = score

    async def _teach(self, t: Trajectory, teacher) -> None:
        """The teacher's log-probs of ``t``'s tokens, and of its branches' (an agent program's rewritten histories
        and other roles, ``rollout.groups.expand_branches``: trained as ``t`` is, so taught as it is)."""
        for d in [t, *t.info.get("branch_tokens", [])]:
            ids = (list(d.prompt_ids), list(d.response_ids)) if d is t else (list(d["prompt_ids"]),
                                                                               list(d["response_ids"]))
            lps = await self._taught(teacher, ids)
            mask = (t.mask if d is t else d["mask"]) or [1] * len(ids[1])
            taught = [lp if m else 0.0 for lp, m in zip(lps, mask)]
            if d is t:
                t.teacher_logprobs = taught
            else:
                d["teacher_logprobs"] = taught

    @staticmethod
    async def _deadline(t: Trajectory, kind: str, source: str, timeout_s: float, setting: str, coro) -> None:
        try:
            await asyncio.wait_for(coro, timeout_s)
        except asyncio.TimeoutError:
            fail(t, f"{kind}_timeout", source, f"no answer within {timeout_s:g} s ({setting})")
        except JudgeFailure as e:
            fail(t, kind, source, str(e)[:500])
        except (RuntimeError, ValueError, OSError) as e:
            fail(t, kind, source, f"{type(e).__name__}: {e}"[:500])

    def close(self) -> None:
        if self.judge is not None:
            self.judge.close()
        if self.teachers is not None:
            self.teachers.close()
