"""The failure policy for user code (verifiers, environments, tools, templates): a failure is never
a training signal.

An episode whose verifier raised or timed out, or whose environment raised or passed its deadline,
is *left out*: it is not scored 0 and trained on, it is counted (``Trajectory.failure``: kind, the
code that failed, the exception) and dropped before the advantages. Its group keeps its other
episodes and takes its baseline over them: every group estimator here (GRPO, Dr.GRPO, RLOO,
REINFORCE++-baseline, GiGPO) is defined for any group size — leaving out the whole group would throw
away its good samples for one bad call, while keeping the failed one as 0 would push a correct but
slow-to-verify answer down. A group left with one episode (``rollout.group_size`` ≥ 2) has nothing
to compare it with: GRPO, Dr.GRPO, RLOO and REINFORCE++-baseline give it advantage 0
(``algos.estimators.lone``), where their single-sample rule would give A = R; with
``rollout.group_size=1`` chosen, every group is one episode and keeps that rule. (GiGPO's step credit,
computed when the batch is built, does not know ``group_size``: such an episode keeps A^E = R.)

Kinds: ``reward`` and ``reward_timeout`` (``reward.fn``), ``env`` and ``env_timeout`` (``env.name``'s
reset/step/close, past ``env.step_timeout_s`` or ``env.episode_timeout_s``), ``judge`` and ``judge_timeout``
(``reward.judge``: a call that failed after its retries, a reply without a score), ``teacher`` and
``teacher_timeout`` (``teacher``: a scoring call that failed), ``engine`` (the inference engine failed on the
request: not user code, left out the same way).

Each step counts its failures by kind (``failures/<kind>``). When more than ``run.max_failure_frac``
of a step's episodes (or of an evaluation's) failed, the run stops: ``UserCodeError``, one line
naming the code, the exception, how many failed of how many and the setting that lets it go on,
exit status 1, before anything of that step is trained or saved (the last checkpoint stays as it
was). A chat template that cannot extend a conversation token-in-token-out (``TemplateMismatch``)
stops the run at its first occurrence: every multi-turn episode would fail the same way.
"""

from __future__ import annotations

import re
from collections import Counter

from relayrl.records import FinishReason, Trajectory

def one_line(text: str) -> str:
    """Multi-line messages (pydantic, YAML, library errors) folded into one line."""
    # split on newlines only: a \r or \x1c inside a quoted value is not a line of the message
    return "; ".join(line.strip() for line in re.split(r"\r?\n", str(text)) if line.strip())


KINDS = ("reward", "reward_timeout", "env", "env_timeout", "engine", "judge", "judge_timeout", "teacher",
         "teacher_timeout")


class UserCodeError(RuntimeError):
    """The run stops because of user code (a verifier, an environment, a template)."""


def fail(t: Trajectory, kind: str, source: str, error: str) -> None:
    """Mark ``t`` failed: left out of training, counted under ``kind``."""
    assert kind in KINDS, kind
    t.failure = {"kind": kind, "source": source, "error": error}


def failed(t: Trajectory) -> bool:
    return t.failure is not None or t.finish_reason == FinishReason.FAILED


def kind_of(t: Trajectory) -> str | None:
    if t.failure is not None:
        return t.failure["kind"]
    return "engine" if t.finish_reason == FinishReason.FAILED else None


def count(trajs: list[Trajectory]) -> Counter:
    """Failed episodes by kind."""
    return Counter(k for t in trajs if (k := kind_of(t)) is not None)


def check(trajs: list[Trajectory], max_frac: float, where: str) -> Counter:
    """Failures by kind among ``trajs``; ``UserCodeError`` when more than ``max_frac`` of them failed
    in user code (``where``: "step 3", "the evaluation before training")."""
    counts = count(trajs)
    user = sum(n for k, n in counts.items() if k != "engine")
    if trajs and user and user / len(trajs) > max_frac:
        raise UserCodeError(stop_message(trajs, user, where, max_frac))
    return counts


def check_tools(trajs: list[Trajectory], max_frac: float, where: str, min_calls: int = 8) -> None:
    """A tool that raised is an observation the model reads (it may have asked for 1/0), not a failed
    episode; but a step where *every* tool call raised (at least ``min_calls``) means the tool cannot
    work at all (a missing file, a permission), and training on it teaches the model that tools fail:
    ``UserCodeError`` (unless run.max_failure_frac=1)."""
    calls = sum(t.info.get("tool_calls", 0) for t in trajs)
    raised = sum(t.info.get("tool_raised", 0) for t in trajs)
    if max_frac < 1 and calls >= min_calls and raised == calls:
        example = next(t.info["tool_raised_example"] for t in trajs if t.info.get("tool_raised_example"))
        raise UserCodeError(f"{where}: every one of the {calls} tool calls raised inside the tool, e.g. {example} — "
                            "a tool that cannot work would teach the model that tools fail, so the run stops (set "
                            "run.max_failure_frac=1 to go on)")


def stop_message(trajs: list[Trajectory], user: int, where: str, max_frac: float) -> str:
    """One line: the code that failed most, its exception, how many failed of how many, the setting."""
    by_source = Counter((t.failure["source"], t.failure["kind"]) for t in trajs if t.failure)
    (source, kind), n = by_source.most_common(1)[0]
    example = next(t.failure["error"] for t in trajs if t.failure and t.failure["source"] == source)
    # a verifier that returned a non-number ("returned str 'correct': ...") did not raise
    returned = any(t.failure["error"].startswith("returned ") for t in trajs
                   if t.failure and t.failure["source"] == source)
    what = {"reward_timeout": "timed out", "env_timeout": "passed its deadline", "judge_timeout": "timed out",
            "teacher_timeout": "timed out", "judge": "failed", "teacher": "failed"}.get(
        kind, "failed" if returned else "raised")
    others = f" ({user - n} more failed elsewhere)" if user > n else ""
    return (f"{where}: {source} {what} in {n} of {len(trajs)} episodes{others}: {example} — more than "
            f"run.max_failure_frac={max_frac:g} of the episodes failed, so the run stops rather than train on what "
            f"is left (failed episodes are never scored 0; set run.max_failure_frac=1 to go on without them)")


def metrics(counts: Counter, totals: dict) -> dict:
    """This step's failures by kind, and the run's totals."""
    return {**{f"failures/{k}": counts.get(k, 0) for k in KINDS},
            **{f"failures/{k}_total": totals.get(k, 0) for k in KINDS}}
