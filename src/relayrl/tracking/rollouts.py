"""Rollout records: every episode of a recorded step, one JSON line each, in
``<run dir>/rollouts/step_NNNNNN.jsonl.gz`` (``run.save_rollouts``: every N steps).

One gzip file per step: each is written whole to ``.part`` and renamed, so a kill never leaves a
half step or corrupts an earlier one; a resume from the checkpoint at step k deletes the files of
steps > k (the dead attempt's), so every step is recorded once; the viewer (``relayrl show``) opens
one step without reading the others. A line:

    {"id": "g12/3", "step": 4, "group": "g12", "sample": 3, "prompt_id": ..., "prompt": [messages],
     "answer": ..., "response": text, "turns": [{"assistant": ..., "env": ...}] (episodes of several
     turns: what the policy wrote and what the environment answered, tool calls and results with it),
     "reward": 1.0 (null where the episode failed: no reward), "failure": {...} | null, "finish_reason": "stop", "status": "trained" | "failed" |
     "filtered" (dynamic sampling), "versions": [[version, tokens], ...] (the policy versions of its
     tokens, run-length), "staleness": versions behind the one trained, "length": tokens,
     "info": {turns, tool_calls, step_rewards, ...}, "prompt_ids": [...], "response_ids": [...], "mask": [...]
     (episodes of several turns: 1 on the policy's tokens, 0 on the environment's)}

The token ids are the episode's own, token in, token out: ``relayrl sft data.path=RUN`` trains on them
(rejection-sampling fine-tuning, ``data.sft``).
"""

from __future__ import annotations

import gzip
import json
import math
import os
import re
from pathlib import Path

from relayrl.records import Group, Trajectory

FOLDER = "rollouts"
_STEP = re.compile(r"step_(\d+)\.jsonl\.gz$")
TABLE_COLUMNS = ["id", "step", "status", "reward", "finish_reason", "length", "staleness", "prompt", "response"]
TABLE_TEXT = 2000  # characters of prompt and response in the trackers' tables


def finite(x):
    """``x`` with every float that is not finite (a failed episode's NaN reward) as None: strict JSON, which
    other readers (jq, JavaScript, Go) parse, where Python's NaN is not JSON."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite(v) for v in x]
    return x


def version_runs(versions: list[int]) -> list[list[int]]:
    """[[version, count], ...] of consecutive equal versions."""
    out: list[list[int]] = []
    for v in versions:
        if out and out[-1][0] == v:
            out[-1][1] += 1
        else:
            out.append([v, 1])
    return out


def expand_runs(runs: list[list[int]]) -> list[int]:
    return [v for v, n in runs for _ in range(n)]


def turn_texts(t: Trajectory, decode) -> list[dict] | None:
    """Per turn of a multi-turn episode: the policy's tokens (mask 1) and the environment's (mask 0) decoded."""
    if not t.turns or (max(t.turns) == 0 and all(t.mask or [1])):
        return None
    mask = t.mask or [1] * len(t.response_ids)
    out: list[dict] = []
    for k in range(max(t.turns) + 1):
        mine = [i for i, tk in zip(t.response_ids, zip(t.turns, mask)) if tk == (k, 1)]
        env = [i for i, tk in zip(t.response_ids, zip(t.turns, mask)) if tk == (k, 0)]
        out.append({"assistant": decode(mine), **({"env": decode(env)} if env else {})})
    return out


def episode_record(t: Trajectory, step: int, trained_at: int, status: str, decode) -> dict:
    info = {k: v for k, v in t.info.items() if k != "anchors"}  # (GiGPO's state hashes: no use to a reader)
    return {
        "id": t.request_id, "step": step, "group": t.group_id, "sample": t.sample_idx, "prompt_id": t.prompt.id,
        "prompt": t.prompt.messages, "answer": t.prompt.answer, "response": t.text,
        **({"turns": turns} if (turns := turn_texts(t, decode)) else {}),
        "reward": t.reward, "failure": t.failure, "status": status,
        "finish_reason": t.finish_reason.value if t.finish_reason is not None else None,
        "versions": version_runs(t.versions), "staleness": trained_at - min(t.versions) if t.versions else 0,
        "length": len(t.response_ids), "info": info, "prompt_ids": list(t.prompt_ids),
        "response_ids": list(t.response_ids), **({"mask": list(t.mask)} if t.mask and not all(t.mask) else {}),
    }


def step_records(step: int, groups: list[Group], trained: list[Group], filtered: list[Group], trained_at: int,
                 decode) -> list[dict]:
    """The records of a step: its batch's episodes (trained, or failed and left out) and dynamic
    sampling's filtered groups. ``trained``: the batch's groups without their failed episodes."""
    kept = {id(t) for g in trained for t in g.trajectories}
    out = [episode_record(t, step, trained_at, "trained" if id(t) in kept else "failed", decode)
           for g in groups for t in g.trajectories]
    return out + [episode_record(t, step, trained_at, "filtered", decode) for g in filtered for t in g.trajectories]


def step_file(run_dir: Path, step: int) -> Path:
    return run_dir / FOLDER / f"step_{step:06d}.jsonl.gz"


def recorded_steps(run_dir: Path) -> dict[int, Path]:
    folder = run_dir / FOLDER
    found = {int(m.group(1)): p for p in folder.glob("step_*.jsonl.gz") if (m := _STEP.search(p.name))} \
        if folder.is_dir() else {}
    return dict(sorted(found.items()))


def read_step(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(ln) for ln in f if ln.strip()]


def recorded_responses(run_dir: Path, upto: int, max_tokens: int) -> tuple[list[tuple[list[int], list[int]]], list[str]]:
    """The newest responses of the records of steps ≤ ``upto``, about ``max_tokens`` tokens of them, as (prompt
    ids, response ids) oldest first, each stopped or at its budget; and why each file left out could not be read.
    An episode of several turns comes whole, its environment's tokens with it: what the engine's history held at
    its last turn's end (every turn is a request for the episode's prompt continuing its response so far)."""
    out: list[tuple[list[int], list[int]]] = []
    damaged: list[str] = []
    tokens = 0
    for step, path in sorted(recorded_steps(run_dir).items(), reverse=True):
        if step > upto:
            continue
        if tokens >= max_tokens:
            break
        try:
            records = read_step(path)
        except (OSError, EOFError, ValueError) as e:  # (a gzip or JSON error: the file left out, the others read)
            damaged.append(f"{path}: {e}")
            continue
        for r in reversed(records):
            if (isinstance(r, dict) and r.get("prompt_ids") and r.get("response_ids")
                    and r.get("finish_reason") in ("stop", "length")):
                out.append((r["prompt_ids"], r["response_ids"]))
                tokens += len(r["response_ids"])
    return out[::-1], damaged


class RolloutLog:
    """Writes the records of every ``every``-th step (0: none). ``resume_step``: the checkpoint's step
    (0 on a fresh start): the records of later steps, a dead attempt's, are deleted."""

    def __init__(self, run_dir: Path, every: int, resume_step: int, tokenizer):
        self.dir, self.every, self.tok = run_dir / FOLDER, every, tokenizer
        for step, p in recorded_steps(run_dir).items():
            if step > resume_step:
                p.unlink()
        for p in self.dir.glob("*.part") if self.dir.is_dir() else ():
            p.unlink()

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def write(self, step: int, groups: list[Group], trained: list[Group], filtered: list[Group],
              trained_at: int) -> list[dict]:
        records = finite(step_records(step, groups, trained, filtered, trained_at, self.decode))
        self.dir.mkdir(parents=True, exist_ok=True)
        final = step_file(self.dir.parent, step)
        part = final.with_name(final.name + ".part")
        with gzip.open(part, "wt", encoding="utf-8", compresslevel=6) as f:
            f.writelines(json.dumps(r, ensure_ascii=False, allow_nan=False) + "\n" for r in records)
        os.replace(part, final)
        return records


def table_rows(records: list[dict]) -> list[list]:
    """The trackers' table of a step (``TABLE_COLUMNS``): the prompt's last message and the response,
    each cut to ``TABLE_TEXT`` characters."""
    def cut(s) -> str:
        s = "" if s is None else str(s)
        return s if len(s) <= TABLE_TEXT else s[:TABLE_TEXT] + "…"

    return [[r["id"], r["step"], r["status"], r["reward"], r["finish_reason"] or "", r["length"], r["staleness"],
             cut(r["prompt"][-1]["content"] if r["prompt"] else ""), cut(r["response"])] for r in records]
