"""Run state and atomic checkpoints.

``runs/<name>/checkpoints/step_NNNNNN/`` holds the policy (``save_pretrained``, safetensors,
with the tokenizer: loadable by ``from_pretrained``), ``trainer.pt`` (optimiser, scheduler,
RNG) and ``state.json`` (step, samples, data cursor, policy version). A checkpoint is written
to a temporary folder and renamed into place, then ``latest`` is replaced atomically, so a
kill at any moment leaves the previous checkpoint intact.

``CheckpointWriter`` writes in the background (DataStates-LLM's idea): the caller's thread only
takes an in-memory snapshot (tensors cloned, state serialised, RNG captured), and a writer
thread puts it on disk while training and generation go on. One write at a time; the next
``save`` (or ``close``) waits for the previous one and re-raises its failure.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from relayrl.data import SamplerState
from relayrl.faults import fault_point


@dataclass
class RunState:
    step: int = 0
    samples: int = 0
    version: int = 0
    wall_seconds: float = 0.0
    sampler: SamplerState = field(default_factory=SamplerState)
    eval_before: dict | None = None
    reward_failures: int = 0
    reward_timeouts: int = 0
    partial_buffer: list = field(default_factory=list)  # groups not yet trained (group_to_dict), run on when resumed
    partial_resumed: int = 0  # cumulative groups continued from the buffer
    staleness: dict = field(default_factory=dict)  # the rollout's cumulative counts (turns continued)
    failed_generations: int = 0  # responses the engine failed on (dropped, not trained)
    groups_made: int = 0  # groups created so far: their ids stay unique across resumes
    config: dict = field(default_factory=dict)  # the resolved config the run was started with
    data_fingerprint: str = ""  # of the training prompts: a resume must see the same data

    def advance(self, batch_size: int, reward_stats, wall_seconds: float) -> None:
        """One step done: the policy version moves with the step (one publish per step in sync mode)."""
        self.step += 1
        self.version += 1
        self.samples += batch_size
        self.reward_failures = reward_stats.failures
        self.reward_timeouts = reward_stats.timeouts
        self.wall_seconds = wall_seconds

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "RunState":
        d = dict(d)
        d["sampler"] = SamplerState(**d["sampler"])
        return cls(**d)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def snapshot(state: RunState, model, trainer_state: dict, weights=None) -> dict:
    """Everything a checkpoint holds, copied in memory now (so training may go on while it is written).
    ``weights()`` gives the policy's whole weights (default: ``model.state_dict``)."""
    import copy

    return {
        "step": state.step,
        "state_json": json.dumps(state.to_json(), indent=1),
        "weights": {k: v.detach().clone() for k, v in (weights or model.state_dict)().items()},
        "trainer": copy.deepcopy(trainer_state),
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
    }


def write_snapshot(run_dir: Path, snap: dict, model, tokenizer, keep: int) -> Path:
    ckpts = run_dir / "checkpoints"
    ckpts.mkdir(parents=True, exist_ok=True)
    final = ckpts / f"step_{snap['step']:06d}"
    tmp = ckpts / f".tmp-step_{snap['step']:06d}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    model.save_pretrained(tmp, state_dict=snap["weights"], safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    torch.save({**snap["trainer"], "rng": snap["rng"]}, tmp / "trainer.pt")
    (tmp / "state.json").write_text(snap["state_json"])
    fault_point("checkpoint")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _write_atomic(ckpts / "latest", final.name)
    old = sorted(p for p in ckpts.glob("step_*") if p.is_dir())
    for p in old[:-keep]:
        shutil.rmtree(p, ignore_errors=True)
    return final


class CheckpointWriter:
    def __init__(self, run_dir: Path, model, tokenizer, keep: int, weights=None):
        """``weights()``: the policy's whole weights on the CPU (default ``model.state_dict``; a trainer
        on a GPU or sharded over ranks gives ``Trainer.full_state_dict``)."""
        self.run_dir, self.model, self.tokenizer, self.keep = run_dir, model, tokenizer, keep
        self.weights = weights
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(self, state: RunState, trainer_state: dict) -> None:
        self.wait()
        snap = snapshot(state, self.model, trainer_state, self.weights)
        self._thread = threading.Thread(target=self._write, args=(snap,), name="relayrl-checkpoint", daemon=True)
        self._thread.start()

    def _write(self, snap: dict) -> None:
        try:
            write_snapshot(self.run_dir, snap, self.model, self.tokenizer, self.keep)
        except BaseException as e:  # re-raised by the next save or close
            self._error = e

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"writing a checkpoint under {self.run_dir} failed: {err!r}") from err


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint. A checkpoint folder only gets its ``step_*`` name by an
    atomic rename once every file is written, so any such folder is complete; ``latest`` is a
    pointer for people and is not trusted here (a kill can fall between the rename and it)."""
    done = [p for p in (run_dir / "checkpoints").glob("step_*") if (p / "state.json").exists()]
    return max(done, key=lambda p: p.name) if done else None


def remove_incomplete(run_dir: Path) -> list[Path]:
    """Delete checkpoint folders a kill left half-written (``.tmp-step_*``); returns them."""
    tmp = sorted((run_dir / "checkpoints").glob(".tmp-*"))
    for p in tmp:
        shutil.rmtree(p, ignore_errors=True)
    return tmp


def load_run_state(ckpt: Path) -> tuple[RunState, dict]:
    state = RunState.from_json(json.loads((ckpt / "state.json").read_text()))
    trainer_state = torch.load(ckpt / "trainer.pt", weights_only=False)
    return state, trainer_state


def restore_rng(trainer_state: dict) -> None:
    rng = trainer_state.get("rng")
    if rng:
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
