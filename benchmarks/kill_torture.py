"""Kill torture: SIGKILL the CLI at many moments, resume it, and check nothing was lost or repeated.

Each case starts ``python -m relayrl.cli train ...`` (a small fast run of the demo task in its
own run directory), kills it with SIGKILL, resumes it with ``--resume`` (some cases are killed
again during a resume), lets the last resume run to completion, and checks:

1. **once**: every prompt trained exactly once: no prompt id twice in ``trained_prompts.jsonl``,
   steps 1..N there once each, every step's list full (``prompts_per_step`` ids), and the final
   checkpoint's ``sampler.consumed`` == trained prompt ids + groups carried in its
   ``partial_buffer`` (carried prompts not among the trained ones) + prompts dynamic sampling
   filtered (``filtered_prompt_ids``, and the checkpoint's pending ones). Runs are far shorter than one
   epoch of the 20,000 demo prompts, so once per epoch means once.
2. **steps**: ``metrics.jsonl`` holds steps 1..N, each exactly once, in order.
3. **loads**: the final checkpoint (``checkpoints/step_N``) loads with
   ``transformers.AutoModelForCausalLM.from_pretrained``.
4. **no orphans**: every process of the case carries a unique environment marker
   (``RELAYRL_TORTURE_ID=<uuid>``, inherited by the engine process, reward workers, ...); after
   each kill (within a grace period: children poll for their parent once a second) and at the end,
   no process in ``/proc/*/environ`` may still carry it. Survivors are listed by pid and
   cmdline, then killed.

A case also fails if the final run does not exit 0 (e.g. ``--resume`` refusing to start), or if
an attempt planned to be killed exits non-zero instead, or hangs.

**Re-plans**: a planned kill that cannot land, because the attempt ran to completion (exit 0)
before its moment came (a faster machine gets further in the same time), is not a failure: the
run directory is put back as it was before the attempt (a copy is taken before every attempt
planned to be killed) and the attempt is run again with a kill drawn from an earlier range, up to
``MAX_REPLANS`` (3) times: a fault kill that missed at n draws from [lo, n - 1] (below lo once n
is lo: [n/2, n - 1]); a wall-clock kill that missed at t s from [min(lo, h/2), h], h = 0.9 ×
min(t, the attempt's time); a kill after step +k that missed draws k from [min(lo, k'), k'],
k' = min(k, the steps the attempt logged) - 1, at least 1 (k' = k = 1: with at most half the
delay). Each re-plan is drawn from its own ``random.Random`` seeded from
``--seed``, the case, the attempt and the re-plan's number, so the moments are deterministic and
the draws of the other kills do not change. Every re-plan is recorded (the "re-plans" column,
and each attempt's ``replans`` in the JSON: the kill that missed, how long the attempt ran, the
run directory at its end, the re-planned kill). A kill that still does not land (or cannot be
drawn earlier: fault ``phase:1`` missed) leaves the case untested past that point (its run ran to
completion, and is checked as such): reported in the notes and the summary line, but not a
failure of the resume. The processes of every try, re-planned ones included, must leave no
orphans.

Kill moments: most kills use ``RELAYRL_KILL_AT=phase:n`` (``relayrl.fault_injection``: the process kills
itself the n-th time it reaches generate = a completion received, train = a micro-batch,
checkpoint = inside a checkpoint write before the atomic rename, eval = between the sampled and
greedy halves of an evaluation) with n drawn from a range by ``--seed``; the others are an
external ``kill -9`` at a random wall-clock time after start (start-up, model loading, between
phases), or a random delay after the attempt logged its k-th step. The 26 cases cover
``run.mode`` sync, periodic and async, each with ``rollout.partial`` on and off, and include a
kill while the first checkpoint is written, kills before any checkpoint (``--resume`` must then
start cleanly from scratch), kills during evaluation (``eval.every=2``, a small held-out set),
cases killed two or three times, and two runs with a critic (``algo.advantage=gae``; checked
too: 5. **critic**, the final checkpoint holds the critic's weights and optimiser state and its
schedule counted every step once, as the policy's did), and four of ``relayrl sft`` (killed in a step, in its first
checkpoint write, at start-up then after a step, in an evaluation; checked by 5. **exact** in place of once: every
step's loss and the final weights those of a run never killed, the data cursor at steps × batch examples). The counters of ``RELAYRL_KILL_AT`` are per process, so a kill
of a resumed attempt counts from that attempt's start.

    python benchmarks/kill_torture.py                 # all 26 cases (~21 min on 2 shared cores)
    python benchmarks/kill_torture.py --cases 3       # the first 3 (what tests/test_kill_torture.py runs)
    python benchmarks/kill_torture.py --only 4 19 --keep   # chosen cases (1-based), keep their run dirs
    python benchmarks/kill_torture.py --seed 7        # other random kill moments
    python benchmarks/kill_torture.py --name kill_torture_adaptive -- data.selection=vade \
        data.selection_key=terms rollout.budget=adaptive rollout.dynamic_sampling=true   # every case with these
    python benchmarks/kill_torture.py --name kill_torture_agent -- model.path=builtin:agent-demo \
        data.path=builtin:agent-demo reward.fn=math env.name=agent:$PWD/examples/openai_agent.py:run \
        env.max_turns=3 env.max_tokens=128 rollout.max_new_tokens=48   # an OpenAI-SDK agent through the endpoint

Writes a Markdown table (one row per case) and JSON with every attempt's details to
``benchmarks/results/kill_torture.{md,json}``; prints ``N/M passed`` (followed by the number of
kills re-planned and of cases with a kill that never landed, if any); exits 0 only if all passed.
The library under test is this checkout's ``src/`` (``--src`` to test another copy).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import machine_info, write_results  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
MARKER = "RELAYRL_TORTURE_ID"
STEPS = 6
PROMPTS_PER_STEP = 4
BASE = [
    "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=64", f"run.steps={STEPS}",
    "run.save_every=2", "run.progress=false", "run.keep_checkpoints=3",
]
NO_EVAL = ["data.eval_path=null"]
# evaluations before training, after steps 2, 4, 6, and at the end: eval:1..10 all land
WITH_EVAL = ["data.eval_path=builtin:demo-eval", "eval.every=2", "eval.size=16", "eval.samples=1"]
CRITIC = ("algo.advantage=gae",)
MAX_REPLANS = 3  # times an attempt whose kill could not land (it ran to completion first) is re-run earlier


@dataclass
class Kill:
    """One planned kill. kind: 'fault' (RELAYRL_KILL_AT=phase:n, n in [lo, hi]), 'wall' (kill -9 at a
    time in [lo, hi] s after start), 'after' (kill -9 0-``delay_hi`` s after the attempt logged its
    k-th step, k in [lo, hi] counted from the step it resumed from)."""

    kind: str
    lo: float
    hi: float
    phase: str = ""
    why: str = ""  # what the case aims at, for the table
    delay_hi: float = 1.5  # 'after': the most seconds between the step's log line and the kill


def fault(phase: str, lo: int, hi: int | None = None, why: str = "") -> Kill:
    return Kill("fault", lo, hi if hi is not None else lo, phase, why)


def wall(lo: float, hi: float, why: str = "") -> Kill:
    return Kill("wall", lo, hi, why=why)


def after_step(lo: int, hi: int, why: str = "") -> Kill:
    return Kill("after", lo, hi, why=why)


@dataclass
class Case:
    mode: str
    partial: bool
    kills: list[Kill]
    eval: bool = False
    extra: tuple[str, ...] = ()  # more overrides (a critic: algo.advantage=gae)
    command: str = "train"  # or "sft" (mode and partial then unused)


# With the base config a run receives >= 16 completions and trains >= 1 micro-batch per step (6
# steps: every n below lands), and writes 3 checkpoints (steps 2, 4, 6). generate <= 16 and train
# <= 2 land before the first checkpoint; train >= 3 after step 1; generate >= 33 after step 1 in
# sync and periodic (async generates ahead: anywhere from step 1 on). The "where killed" column
# reports where each kill actually landed. The first three are the CI subset.
CASES = [
    Case("sync", False, [fault("checkpoint", 1, why="first checkpoint write")]),
    Case("periodic", True, [fault("train", 3, 6)]),
    Case("async", False, [fault("generate", 33, 90)]),
    Case("sync", True, [fault("generate", 1, 16, why="before any checkpoint")]),
    Case("periodic", False, [fault("checkpoint", 2, 3)]),
    Case("async", True, [fault("train", 3, 6)]),
    Case("sync", False, [fault("eval", 3, 8)], eval=True),
    Case("periodic", True, [fault("checkpoint", 1, why="first checkpoint write")]),
    Case("async", False, [wall(0.5, 8.0, why="start-up")]),
    Case("sync", True, [fault("train", 3, 6), fault("checkpoint", 1, why="resumed run's first checkpoint")]),
    Case("periodic", False, [fault("generate", 33, 90)]),
    Case("async", True, [fault("eval", 1, 8)], eval=True),
    Case("sync", False, [after_step(1, 4)]),
    Case("periodic", True, [fault("eval", 1, 8)], eval=True),
    Case("async", False, [fault("checkpoint", 1, why="first checkpoint write")]),
    Case("sync", True, [wall(0.5, 8.0, why="start-up"), fault("generate", 1, 40)]),
    Case("periodic", False, [after_step(1, 4), fault("train", 1, 4)]),
    Case("async", True, [fault("generate", 33, 90), after_step(1, 3)]),
    Case("sync", False, [fault("train", 1, 2, why="before any checkpoint"),
                         fault("train", 1, 2, why="before any checkpoint, again")]),
    Case("async", False, [fault("checkpoint", 2), fault("eval", 1, 4), wall(0.5, 8.0, why="start-up")], eval=True),
    # with a critic (PPO's GAE): its weights, optimiser and schedule are part of every checkpoint
    Case("async", True, [fault("train", 3, 6, why="critic: in a training micro-batch")], extra=CRITIC),
    Case("sync", False, [fault("checkpoint", 2, why="critic: in its second checkpoint write")], extra=CRITIC),
    # relayrl sft (checked: 5. **exact**, the losses of every step and the final weights those of one run never
    # killed, and the data cursor at steps × sft.batch_size examples)
    Case("sft", False, [fault("train", 3, 5, why="sft: a step")], command="sft"),
    Case("sft", False, [fault("checkpoint", 1, why="sft: first checkpoint write")], command="sft"),
    Case("sft", False, [wall(0.5, 6.0, why="sft: start-up"), after_step(1, 3)], command="sft"),
    Case("sft", False, [fault("eval", 1, 6, why="sft: an evaluation")], eval=True, command="sft"),
]
SFT_BASE = ["sft.batch_size=8", f"run.steps={STEPS}", "run.save_every=2", "run.progress=false",
            "run.keep_checkpoints=3", "rollout.max_new_tokens=64", "trainer.lr=1e-3"]


# ---------------------------------------------------------------- processes


def marked_processes(marker: str) -> list[tuple[int, str]]:
    """(pid, cmdline) of every process whose environment holds ``MARKER=marker``."""
    needle = f"{MARKER}={marker}".encode()
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            env = (d / "environ").read_bytes()
            if needle not in env.split(b"\0"):
                continue
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        found.append((int(d.name), cmd or "?"))
    return found


def wait_no_survivors(marker: str, grace: float) -> tuple[list[tuple[int, str]], float]:
    """Wait up to ``grace`` s for the marked processes to exit; returns (survivors, seconds waited).
    Survivors are then killed (they are this harness's descendants) so the next attempt starts clean."""
    t0 = time.monotonic()
    while True:
        alive = marked_processes(marker)
        if not alive or time.monotonic() - t0 > grace:
            break
        time.sleep(0.2)
    waited = time.monotonic() - t0
    for pid, _ in alive:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return alive, waited


# ---------------------------------------------------------------- run directory state


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            out.append({"_bad_line": line[:200]})
    return out


def complete_checkpoints(run_dir: Path) -> list[int]:
    """Steps of the complete checkpoints (``step_*`` folders with a state.json)."""
    d = run_dir / "checkpoints"
    if not d.exists():
        return []
    return sorted(int(p.name[5:]) for p in d.glob("step_*") if (p / "state.json").exists())


def last_logged_step(run_dir: Path) -> int:
    rows = read_jsonl(run_dir / "metrics.jsonl")
    return rows[-1].get("step", 0) if rows and isinstance(rows[-1].get("step"), int) else 0


def describe_state(run_dir: Path) -> str:
    ck = complete_checkpoints(run_dir)
    tmp = sorted(p.name for p in (run_dir / "checkpoints").glob(".tmp-*")) if (run_dir / "checkpoints").exists() else []
    n = len(read_jsonl(run_dir / "metrics.jsonl"))
    s = f"{n} step{'' if n == 1 else 's'} logged, " + (f"ckpt {ck[-1]}" if ck else "no ckpt")
    return s + (f", left {', '.join(tmp)}" if tmp else "")


# ---------------------------------------------------------------- one attempt


@dataclass
class Attempt:
    kill: str  # what was planned ("" for a run to completion)
    drawn: float = 0.0  # the moment drawn: n (fault), seconds (wall), k (after)
    delay: float = 0.0  # 'after': the seconds drawn between the step's log line and the kill
    rc: int | None = None
    killed: bool = False
    landed: str = ""  # where it landed: the run directory's state at the kill
    resumed_from: str = ""  # "scratch", a step, or "" (not a resume / not printed before the kill)
    expected_from: str = ""  # from the complete checkpoints on disk before the attempt
    seconds: float = 0.0
    procs_seen: int = 0  # most marked processes seen at once while it ran (the scan works)
    survivors: list = field(default_factory=list)
    orphans_gone_s: float = 0.0
    log_tail: str = ""
    replans: list = field(default_factory=list)  # earlier tries of this attempt whose kill could not land


def watch(proc: subprocess.Popen, a: Attempt, run_dir: Path, marker: str, t0: float, wall_start: float,
          deadline_kill: float | None, after_k: int | None, delay: float, start_step: int, timeout: float) -> None:
    """Poll the attempt until it exits; SIGKILL it ``deadline_kill`` s after start, or ``delay`` s
    after it logged step ``start_step + after_k``, or when it runs past ``timeout``; records the run
    directory's state at the kill in ``a.landed``, and the most marked processes seen at once."""
    kill_at = t0 + deadline_kill if deadline_kill is not None else None
    next_scan = t0 + 1.0
    while proc.poll() is None:
        now = time.monotonic()
        if now >= next_scan:
            a.procs_seen, next_scan = max(a.procs_seen, len(marked_processes(marker))), now + 1.0
        if after_k is not None and kill_at is None:
            m = run_dir / "metrics.jsonl"  # written by this attempt (mtime) and past the step it started from
            if m.exists() and m.stat().st_mtime >= wall_start and last_logged_step(run_dir) >= start_step + after_k:
                kill_at = now + delay
        if kill_at is not None and now >= kill_at:
            a.landed = describe_state(run_dir)
            break
        if now - t0 > timeout:
            a.landed = f"HUNG after {timeout:.0f}s: {describe_state(run_dir)}"
            break
        time.sleep(0.05)
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def run_attempt(cmd: list[str], env: dict, run_dir: Path, log: Path, kill: Kill | None, rng: random.Random,
                resume: bool, timeout: float, grace: float, marker: str) -> Attempt:
    env = dict(env)
    env.pop("RELAYRL_KILL_AT", None)
    label, deadline_kill, after_k, delay, drawn = "", None, None, 0.0, 0.0
    if kill is not None and kill.kind == "fault":
        n = drawn = rng.randint(int(kill.lo), int(kill.hi))
        env["RELAYRL_KILL_AT"] = f"{kill.phase}:{n}"
        label = f"{kill.phase} #{n}"
    elif kill is not None and kill.kind == "wall":
        deadline_kill = drawn = rng.uniform(kill.lo, kill.hi)
        label = f"kill -9 at {deadline_kill:.1f}s"
    elif kill is not None and kill.kind == "after":
        after_k, delay = rng.randint(int(kill.lo), int(kill.hi)), rng.uniform(0.0, kill.delay_hi)
        drawn = after_k
        label = f"kill -9 {delay:.1f}s after step +{after_k}"
    if kill is not None and kill.why:
        label += f" ({kill.why})"
    ck = complete_checkpoints(run_dir)
    a = Attempt(kill=label, drawn=drawn, delay=delay,
                expected_from=(str(ck[-1]) if ck else "scratch") if resume else "")
    start_step = ck[-1] if (resume and ck) else 0
    t0, wall_start = time.monotonic(), time.time()
    with log.open("w") as f:
        proc = subprocess.Popen(cmd + (["--resume"] if resume else []), env=env, stdout=f, stderr=subprocess.STDOUT,
                                cwd=run_dir.parent)
        try:
            watch(proc, a, run_dir, marker, t0, wall_start, deadline_kill, after_k, delay, start_step, timeout)
        finally:  # also when the harness itself is interrupted: leave nothing running
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    a.rc = proc.returncode
    a.seconds = time.monotonic() - t0
    a.killed = a.rc == -signal.SIGKILL and not a.landed.startswith("HUNG")
    if a.killed and not a.landed:
        a.landed = describe_state(run_dir)  # the process killed itself at its fault point
    text = log.read_text(errors="replace")
    flat = text.replace("\n", "")
    if resume:
        m = re.search(r"resumed from \S*?step_0*(\d+)", flat)
        a.resumed_from = m.group(1) if m else ("scratch" if "from scratch" in flat else
                                               "error" if a.rc not in (0, -signal.SIGKILL) else "")
    if a.rc not in (0, -signal.SIGKILL) or a.landed.startswith("HUNG"):
        a.log_tail = "\n".join(text.splitlines()[-15:])
    a.survivors, a.orphans_gone_s = wait_no_survivors(marker, grace)
    return a


def replan(kill: Kill, a: Attempt, logged: int) -> Kill | None:
    """``kill``, with a range ending before the moment ``a`` drew, which did not land because the
    attempt ran to completion first (a later moment would not land either); ``logged``: the steps
    the attempt logged past the one it started from. None where nothing earlier can be drawn."""
    if kill.kind == "fault":  # the phase was reached fewer than n times
        hi = int(a.drawn) - 1
        if hi < 1:
            return None
        return replace(kill, lo=kill.lo if kill.lo <= hi else max(1, (hi + 1) // 2), hi=hi)
    if kill.kind == "wall":  # the run was over before t
        hi = 0.9 * min(a.drawn, a.seconds)
        return replace(kill, lo=min(kill.lo, hi / 2), hi=hi)
    if logged < 1:  # 'after': no step was logged, yet the run completed
        return None
    k = max(1, min(int(a.drawn), logged) - 1)  # step +k was not reached, or the run ended within the delay
    return replace(kill, lo=min(kill.lo, k), hi=k, delay_hi=a.delay / 2 if k == int(a.drawn) else kill.delay_hi)


def describe_kill(kill: Kill) -> str:
    if kill.kind == "fault":
        return f"{kill.phase} #{int(kill.lo)}-{int(kill.hi)}"
    if kill.kind == "wall":
        return f"kill -9 at {kill.lo:.1f}-{kill.hi:.1f}s"
    return f"kill -9 0-{kill.delay_hi:.1f}s after step +{int(kill.lo)}-{int(kill.hi)}"


def replan_count(a: Attempt) -> int:
    """How many times attempt ``a`` was run again with an earlier kill (``a.replans``: every try whose
    kill missed; the last one, if ``a`` itself missed, with ``replanned`` None)."""
    return sum(r["replanned"] is not None for r in a.replans)


def copy_run_dir(run_dir: Path, to: Path) -> Path | None:
    """A copy of the run directory as it is (None: there is none yet), to put back with ``put_back``."""
    shutil.rmtree(to, ignore_errors=True)
    if not run_dir.exists():
        return None
    shutil.copytree(run_dir, to, symlinks=True)  # (mtimes kept: metrics.jsonl stays older than a new attempt)
    return to


def put_back(copy: Path | None, run_dir: Path) -> None:
    shutil.rmtree(run_dir, ignore_errors=True)
    if copy is not None:
        shutil.copytree(copy, run_dir, symlinks=True)


# ---------------------------------------------------------------- checks


def check_once(run_dir: Path, steps: int) -> tuple[bool, str]:
    trained = read_jsonl(run_dir / "trained_prompts.jsonl")
    got = [t.get("step") for t in trained]
    if got != list(range(1, steps + 1)):
        return False, f"trained_prompts.jsonl steps {compact(got)} != 1..{steps}"
    short = [t["step"] for t in trained if len(t.get("prompt_ids", [])) != PROMPTS_PER_STEP]
    if short:
        return False, f"steps {short} do not hold {PROMPTS_PER_STEP} prompt ids"
    ids = [i for t in trained for i in t["prompt_ids"]]
    dup = sorted({i for i in ids if ids.count(i) > 1}, key=str)
    if dup:
        return False, f"prompt ids trained twice: {dup[:5]}"
    state_path = run_dir / "checkpoints" / f"step_{steps:06d}" / "state.json"
    if not state_path.exists():
        return False, f"no final checkpoint step_{steps:06d}"
    state = json.loads(state_path.read_text())
    carried = [g["prompt"]["id"] for g in state.get("partial_buffer", [])]
    if len(set(carried)) != len(carried) or set(carried) & set(ids):
        return False, f"carried groups repeat prompts: {sorted(set(carried) & set(ids), key=str)[:5]}"
    # prompts dynamic sampling left out (zero-variance groups): recorded per step, and in the checkpoint
    # those filtered after the last step's record
    filtered = [i for t in trained for i in t.get("filtered_prompt_ids", [])]
    filtered += state.get("staleness", {}).get("filtered_pending", [])
    if set(filtered) & set(ids) or len(set(filtered)) != len(filtered):
        return False, f"filtered prompts trained or filtered twice: {sorted(set(filtered) & set(ids), key=str)[:5]}"
    consumed = state["sampler"]["consumed"]
    if consumed != len(ids) + len(carried) + len(filtered):
        return False, (f"sampler.consumed {consumed} != {len(ids)} trained + {len(carried)} carried + "
                       f"{len(filtered)} filtered")
    return True, ""


def check_critic(run_dir: Path, steps: int) -> tuple[bool, str]:
    """(Cases with a critic.) The critic resumed with the policy: the final checkpoint holds its weights and
    optimiser state, and its schedule counted every step once (a critic started afresh by a resume would
    count only the steps after it), as the policy's did."""
    import torch

    path = run_dir / "checkpoints" / f"step_{steps:06d}" / "trainer.pt"
    if not path.exists():
        return False, f"no final checkpoint step_{steps:06d}"
    state = torch.load(path, weights_only=False)
    critic = state.get("critic")
    if not critic or not critic.get("weights") or not critic.get("optimizer", {}).get("state"):
        return False, "the final checkpoint holds no critic weights or optimiser state"
    ours, policy = critic["scheduler"]["last_epoch"], state["scheduler"]["last_epoch"]
    if ours != steps or policy != steps:
        return False, f"schedules counted {ours} (critic) and {policy} (policy) steps, not {steps}"
    return True, ""


def check_steps(run_dir: Path, steps: int) -> tuple[bool, str]:
    got = [m.get("step") for m in read_jsonl(run_dir / "metrics.jsonl")]
    if got != list(range(1, steps + 1)):
        return False, f"metrics.jsonl steps {compact(got)} != 1..{steps}"
    return True, ""


def check_loads(run_dir: Path, steps: int) -> tuple[bool, str]:
    ckpt = run_dir / "checkpoints" / f"step_{steps:06d}"
    if not ckpt.exists():
        return False, f"no final checkpoint step_{steps:06d}"
    try:
        import transformers
        from transformers import AutoModelForCausalLM

        bars = transformers.utils.logging.is_progress_bar_enabled()
        transformers.utils.logging.disable_progress_bar()
        try:
            AutoModelForCausalLM.from_pretrained(ckpt)
        finally:
            if bars:
                transformers.utils.logging.enable_progress_bar()
    except Exception as e:  # noqa: BLE001 - reported
        return False, f"from_pretrained({ckpt.name}) failed: {type(e).__name__}: {e}"[:300]
    return True, ""


def compact(xs: list) -> str:
    return "[" + ",".join(str(x) for x in xs[:20]) + (",…" if len(xs) > 20 else "") + "]"


# ---------------------------------------------------------------- one case


def case_label(case: Case) -> str:
    return (f"{case.mode}{'+partial' if case.partial else ''}{' +eval' if case.eval else ''}"
            + "".join(f" +{x}" for x in case.extra))


def case_command(case: Case, workdir: Path, name: str, extra) -> list[str]:
    if case.command == "sft":
        return [sys.executable, "-m", "relayrl.cli", "sft", f"run.output_dir={workdir}", f"run.name={name}", *SFT_BASE,
                *(WITH_EVAL if case.eval else NO_EVAL), *case.extra, *extra]
    return [sys.executable, "-m", "relayrl.cli", "train", f"run.output_dir={workdir}", f"run.name={name}",
            f"run.mode={case.mode}", f"rollout.partial={str(case.partial).lower()}", *BASE,
            *(WITH_EVAL if case.eval else NO_EVAL), *case.extra, *extra]


def sft_reference(workdir: Path, env: dict, extra) -> Path:
    """The run directory of an SFT run never killed (made once per workdir): what a killed one must equal."""
    ref = workdir / "sft-reference"
    if not (ref / "checkpoints" / f"step_{STEPS:06d}").is_dir():
        subprocess.run(case_command(Case("sft", False, [], command="sft"), workdir, ref.name, extra), env=env,
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600)
    return ref


def check_exact(run_dir: Path, steps: int, ref: Path) -> tuple[bool, str]:
    """(relayrl sft.) Every step's loss and the final weights those of the run never killed; the data cursor at
    steps × sft.batch_size examples (none taken twice, none skipped)."""
    import torch
    from safetensors.torch import load_file

    got = [m.get("loss") for m in read_jsonl(run_dir / "metrics.jsonl")]
    want = [m.get("loss") for m in read_jsonl(ref / "metrics.jsonl")]
    if len(got) != len(want) or any(abs(a - b) > 1e-5 * max(1.0, abs(b)) for a, b in zip(got, want)):
        return False, f"losses {got} != the uninterrupted run's {want}"
    final = f"checkpoints/step_{steps:06d}"
    state = json.loads((run_dir / final / "state.json").read_text())
    if state["sampler"]["consumed"] != steps * 8:
        return False, f"sampler.consumed {state['sampler']['consumed']} != {steps} × 8"
    a, b = load_file(run_dir / final / "model.safetensors"), load_file(ref / final / "model.safetensors")
    off = [k for k in a if not torch.allclose(a[k], b[k], atol=1e-6)]
    return (not off, f"weights differ from the uninterrupted run's: {off[:3]}" if off else "")


def attempt_with_replans(i: int, kill: Kill | None, n_kills: int, cmd: list[str], env: dict, run_dir: Path,
                         logs: Path, rng: random.Random, random_for, workdir: Path, tries: list, notes: list,
                         timeout: float, grace: float, marker: str) -> Attempt:
    """Attempt ``i`` of a case, killed as ``kill`` plans (None: run to completion). A kill that could not
    land — the run completed first, or the kill came once the final checkpoint was written while later
    kills are planned (they would have nothing to land in) — is a harness miss, not a failure: the run
    directory is put back as it was and the attempt runs again with an earlier kill, drawn from
    ``random_for(t)``, at most ``MAX_REPLANS`` times. Every try goes to ``tries``; the last is returned,
    its misses in ``replans``."""
    before = copy_run_dir(run_dir, workdir) if kill is not None else None
    planned, draw, replans = kill, rng, []
    for t in range(MAX_REPLANS + 1):
        a = run_attempt(cmd, env, run_dir, logs / (f"attempt{i}.log" if t == 0 else f"attempt{i}-replan{t}.log"),
                        planned, draw, resume=i > 0, timeout=timeout, grace=grace, marker=marker)
        tries.append((i, a))
        late = (a.killed and i + 1 < n_kills
                and (run_dir / "checkpoints" / f"step_{STEPS:06d}" / "state.json").exists())
        if kill is None or a.landed.startswith("HUNG") or (a.killed and not late) or (not a.killed and a.rc != 0):
            break
        start = int(a.expected_from) if a.expected_from.isdigit() else 0
        nxt = replan(planned, a, last_logged_step(run_dir) - start) if t < MAX_REPLANS else None
        replans.append({"kill": a.kill, "rc": a.rc, "seconds": round(a.seconds, 1),
                        "run_dir_at_end": describe_state(run_dir), "replanned": describe_kill(nxt) if nxt else None,
                        "survivors": a.survivors})
        if nxt is None:
            break
        why = "landed after the final checkpoint, leaving nothing for the later kills" if late else \
            f"could not land (the run completed in {a.seconds:.0f}s)"
        notes.append(f"attempt {i}: kill '{a.kill}' {why}: re-planned as {describe_kill(nxt)}")
        put_back(before, run_dir)
        planned, draw = nxt, random_for(t + 1)
    if before is not None:
        shutil.rmtree(before, ignore_errors=True)
    a.replans = replans
    return a


def run_case(index: int, workdir: Path, seed: int = 0, src: Path | None = None, timeout: float = 300.0,
             grace: float = 20.0, keep: bool = False, extra: list[str] = ()) -> dict:
    """Run case ``index`` (0-based into CASES) in its own run directory under ``workdir``, with the
    overrides ``extra`` on top of its own; returns the result: ``passed``, ``checks`` (name -> bool),
    ``notes`` (why a check failed) and every attempt."""
    case = CASES[index]
    rng = random.Random(f"{seed}:{index}")  # the same case draws the same moments whatever --cases is
    name = f"case{index + 1:02d}"
    run_dir = workdir / name
    if run_dir.exists():
        shutil.rmtree(run_dir)
    marker = uuid.uuid4().hex
    src = src or REPO / "src"
    env = {**os.environ, MARKER: marker, "PYTHONUNBUFFERED": "1", "COLUMNS": "400",
           "PYTHONPATH": os.pathsep.join(p for p in (str(src), os.environ.get("PYTHONPATH", "")) if p)}
    cmd = case_command(case, workdir, name, extra)
    logs = workdir / f"{name}-logs"
    logs.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    attempts: list[Attempt] = []
    tries: list[tuple[int, Attempt]] = []  # (attempt, try): every run started, re-planned ones included
    notes = []
    plan = list(case.kills) + [None]  # the last attempt runs to completion
    for i, kill in enumerate(plan):
        a = attempt_with_replans(i, kill, len(case.kills), cmd, env, run_dir, logs, rng,
                                 random_for=lambda t, i=i: random.Random(f"{seed}:{index}:{i}:replan{t}"),
                                 workdir=workdir / f"{name}-before", tries=tries, notes=notes,
                                 timeout=timeout, grace=grace, marker=marker)
        attempts.append(a)
        if kill is not None and not a.killed:
            break  # the kill did not land (run ended first, even re-planned) or the run failed: nothing more to resume
        if kill is None or a.landed.startswith("HUNG"):
            break
    final = attempts[-1]
    untested = ""
    for i, a in enumerate(attempts):
        if a.landed.startswith("HUNG"):
            notes.append(f"attempt {i}: {a.landed}")
        elif i < len(case.kills) and not a.killed and a.rc == 0:
            untested = (f"attempt {i}: planned kill '{a.kill}' never landed (the run completed first, "
                        f"{replan_count(a)} re-plan(s)): the case is untested past that point")
            notes.append(untested)
        elif i < len(case.kills) and not a.killed:
            notes.append(f"attempt {i}: planned kill '{a.kill}' did not land (exit {a.rc})"
                         + (f": {last_line(a.log_tail)}" if a.rc else ""))
        if a.resumed_from not in ("", "error") and a.expected_from and a.resumed_from != a.expected_from:
            notes.append(f"attempt {i}: resumed from {a.resumed_from}, newest complete checkpoint was {a.expected_from}")
    for i, a in tries:
        if a.survivors:
            notes.append(f"attempt {i}: {len(a.survivors)} process(es) left after {a.orphans_gone_s:.0f}s: "
                         + "; ".join(f"pid {p} `{c[:120]}`" for p, c in a.survivors))
    # exit 0: the last attempt ran to completion, and every attempt before it was killed as planned
    # (an attempt that exits non-zero, or hangs, instead of being killed fails; one whose kill never
    # landed, even re-planned, completed: checked as the final run)
    completed = final.rc == 0 and all(a.killed for a in attempts[:-1])
    if final.rc not in (0, -signal.SIGKILL) and not final.landed.startswith("HUNG"):
        notes.append(f"attempt {len(attempts) - 1} exited {final.rc}: {last_line(final.log_tail)}")
    checks, why = {"exit 0": completed}, {}
    sft = case.command == "sft"
    for key, fn in (*([] if sft else [("once", check_once)]), ("steps", check_steps), ("loads", check_loads),
                    *([("critic", check_critic)] if CRITIC[0] in case.extra else []),
                    *([("exact", lambda d, n: check_exact(d, n, sft_reference(workdir, env, extra)))] if sft else [])):
        checks[key], why[key] = fn(run_dir, STEPS)
    blind = sorted({i for i, a in tries if a.seconds > 3 and a.procs_seen == 0})
    if blind:  # the CLI itself carries the marker: a scan that never saw it proves nothing
        notes.append(f"harness: the /proc scan saw no marked process while attempts {blind} ran")
    checks["no orphans"] = not any(a.survivors for _, a in tries) and not marked_processes(marker) and not blind
    notes += [f"{k}: {v}" for k, v in why.items() if v and (completed or k == "steps")]
    kills = [a for a in attempts if a.killed]
    result = {
        "case": index + 1,
        "mode": case.mode if case.command == "train" else "sft",
        "partial": case.partial,
        "eval": case.eval,
        "extra": list(case.extra),
        "planned": [asdict(k) for k in case.kills],
        "where": " → ".join(f"{a.kill} [{a.landed}]" + (f" (re-planned ×{replan_count(a)})" if a.replans else "")
                            for a in kills) or "—",
        "kills": len(kills),
        "replans": sum(replan_count(a) for a in attempts),
        "untested": untested,
        "resumed_from": [a.resumed_from or (f"({a.expected_from}?)" if a.expected_from else "?")
                         for a in attempts[1:]],
        "checks": checks,
        "passed": all(checks.values()),  # a kill that never landed (``untested``) is no failure of the resume
        "notes": notes,
        "seconds": round(time.monotonic() - t0, 1),
        "attempts": [asdict(a) for a in attempts],
        "run_dir": str(run_dir),
    }
    if not keep:
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(logs, ignore_errors=True)
    return result


def last_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[-1].strip()[:300] if lines else ""


def row(r: dict) -> list[str]:
    mark = lambda ok: "✓" if ok else "✗"  # noqa: E731
    c = r["checks"]
    mode = r["mode"] + (" +eval" if r["eval"] else "") + "".join(f" +{x}" for x in r.get("extra", []))
    return [str(r["case"]), mode, "on" if r["partial"] else "off", r["where"],
            str(r["kills"]) + (f" of {len(r['planned'])}" if r["kills"] != len(r["planned"]) else ""),
            str(r["replans"] or "—"), ", ".join(r["resumed_from"]) or "—", mark(c["exit 0"]),
            mark(c["once"] if "once" in c else c["exact"]),
            mark(c["steps"]), mark(c["loads"]), mark(c["critic"]) if "critic" in c else "—", mark(c["no orphans"]),
            f"{r['seconds']:.0f}"]


HEADER = ["#", "mode", "partial", "where killed [run dir at the kill]", "kills", "re-plans", "resumed from step",
          "exit 0", "once (sft: exact)", "steps", "loads", "critic", "no orphans", "s"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=len(CASES), help="run the first N cases (default: all)")
    ap.add_argument("--only", type=int, nargs="+", help="run these cases (1-based) instead")
    ap.add_argument("--seed", type=int, default=0, help="seeds the kill moments")
    ap.add_argument("--keep", action="store_true", help="keep the run directories (and each attempt's log)")
    ap.add_argument("--workdir", help="where the run directories go (default: a new temp folder)")
    ap.add_argument("--src", help="the relayrl source folder to test (default: this checkout's src/)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds before an attempt counts as hung")
    ap.add_argument("--grace", type=float, default=20.0, help="seconds children get to exit after a kill")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    ap.add_argument("--name", default="kill_torture", help="results file name (kill_torture.{md,json})")
    ap.add_argument("extra", nargs="*", help="overrides added to every case, e.g. after --: rollout.budget=adaptive")
    args = ap.parse_args()
    indices = [i - 1 for i in args.only] if args.only else list(range(min(args.cases, len(CASES))))
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kill_torture-"))
    workdir.mkdir(parents=True, exist_ok=True)
    results = []
    for i in indices:
        print(f"case {i + 1}: {case_label(CASES[i])} ...", flush=True)
        r = run_case(i, workdir, args.seed, Path(args.src) if args.src else None, args.timeout, args.grace, args.keep,
                     args.extra)
        results.append(r)
        print(f"  {'passed' if r['passed'] else 'FAILED'} in {r['seconds']:.0f}s: {r['where']}"
              + "".join(f"\n  - {n}" for n in r["notes"]), flush=True)
    passed = sum(r["passed"] for r in results)
    replans, untested = sum(r["replans"] for r in results), [r["case"] for r in results if r["untested"]]
    summary = (f"{passed}/{len(results)} passed" + (f"; {replans} kill(s) re-planned (the run completed first, or was killed past its last checkpoint)"
                                                     if replans else "")
               + (f"; a planned kill never landed in case(s) {untested}: untested past it" if untested else ""))
    out = Path(args.out)
    write_results(out, args.name, HEADER, [row(r) for r in results],
                  {"machine": machine_info(), "seed": args.seed, "steps": STEPS, "base_config": BASE, "extra": args.extra,
                   "summary": summary, "results": results})
    failures = [f"- case {r['case']} ({case_label(CASES[r['case'] - 1])}): " + "; ".join(r["notes"] or ["failed"])
                for r in results if not r["passed"]]
    with (out / f"{args.name}.md").open("a") as f:
        f.write(f"\n{summary} (seed {args.seed}{'; every case with ' + ' '.join(args.extra) if args.extra else ''}).\n" + ("\nFailures:\n\n" + "\n".join(failures) + "\n" if failures else ""))
    if failures:
        print("\n".join(failures))
    if args.keep:
        print(f"run directories kept under {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    print(summary)
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
