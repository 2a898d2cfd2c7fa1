"""Where a run starts: from scratch, or from its newest complete checkpoint (``--resume``).

``--resume`` always works (verl's ``resume_mode=auto``): with a complete checkpoint the run
continues from it; with none (killed before its first checkpoint finished) it starts cleanly
from scratch. Half-written checkpoint folders are deleted, and a fresh start truncates the
per-step logs a crashed attempt left, so step numbers never repeat.

A checkpoint records the resolved config and a fingerprint of the training prompts. Resuming
with a change that would break exact resume (another data order, other prompts, other
tokens in the held groups, an optimiser setting the restored optimiser state would silently
override) fails naming the field; everything else (``run.steps``, ``eval.*``, ``run.save_every``,
the algorithm's knobs, ...) may change.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from relayrl.run.checkpoint import RunState, latest_checkpoint, load_run_state, remove_incomplete
from relayrl.config import Config
from relayrl.records import Prompt


class ResumeError(RuntimeError):
    pass


# field -> why changing it on resume breaks the run
UNSAFE_ON_RESUME = {
    "run.seed": "the data order and the sampling streams are seeded by it",
    "data.shuffle": "the saved data cursor points into the shuffled order",
    "data.prompt_format": "held groups were tokenized with it",
    "model.path": "held groups were tokenized with its tokenizer (and a KL reference is built from it)",
    "model.tokenizer": "held groups were tokenized with it",
    "rollout.group_size": "held groups have that many responses",
    "rollout.budget": "held groups were sized by it (adaptive: a first stage, then more from their window's budget)",
    "rollout.budget_min": "held groups' first stages have that many responses",
    "rollout.budget_max": "held groups were granted extra responses up to it",
    "data.selection": "the saved cursor and the epoch's passed-over prompts come from it",
    "data.selection_pool": "the epoch's passed-over prompts come from it",
    "env.name": "held groups are episodes of that environment (or single responses without one)",
    "trainer.lr": "the optimiser state restored from the checkpoint would silently override it",
    "trainer.betas": "the optimiser state restored from the checkpoint would silently override it",
    "trainer.weight_decay": "the optimiser state restored from the checkpoint would silently override it",
    "trainer.schedule": "the scheduler state restored from the checkpoint would silently override it",
    "trainer.warmup_steps": "the scheduler state restored from the checkpoint would silently override it",
    "critic.lr": "the critic's optimiser state restored from the checkpoint would silently override it",
    "critic.warmup_steps": "the critic's scheduler state restored from the checkpoint would silently override it",
    "critic.path": "the checkpoint holds the critic's weights for that architecture",
    "model.lora": "the checkpoint holds that adapter (model.lora.r > 0) or whole weights (0), and its optimiser state",
}


def data_fingerprint(prompts: list[Prompt]) -> str:
    """sha256 of the prompts as the sampler sees them (ids, messages, answers, metadata, order)."""
    h = hashlib.sha256()
    for p in prompts:
        h.update(json.dumps([p.id, p.messages, p.answer, p.metadata], sort_keys=True, default=str).encode())
        h.update(b"\n")
    return h.hexdigest()[:16]


def _get(tree: dict, dotted: str):
    sec, key = dotted.split(".")
    return tree.get(sec, {}).get(key)


def check_compatible(saved: dict, cfg: Config, saved_fp: str, fp: str, ckpt: Path) -> None:
    from relayrl.algos import NEEDS_CRITIC

    # (first: the estimator decides rollout.budget's and dynamic_sampling's defaults, which then differ too)
    was = _get(saved, "algo.advantage") if saved else None
    if was is not None and (was in NEEDS_CRITIC) != (cfg.algo.advantage in NEEDS_CRITIC):
        raise ResumeError(f"--resume from {ckpt}: algo.advantage was {was!r} and is now {cfg.algo.advantage!r}; "
                          f"the checkpoint {'holds' if was in NEEDS_CRITIC else 'has no'} critic and the new "
                          f"estimator {'needs' if cfg.algo.advantage in NEEDS_CRITIC else 'takes no'} one. Restore "
                          "it, or start a new run (another run.name)")
    now = cfg.model_dump(mode="json")
    for field, why in UNSAFE_ON_RESUME.items():
        if saved and field.split(".")[0] in saved and _get(saved, field) != _get(now, field):
            raise ResumeError(f"--resume from {ckpt}: {field} was {_get(saved, field)!r} and is now "
                              f"{_get(now, field)!r}; {why}. Restore it, or start a new run (another run.name)")
    if saved_fp and fp != saved_fp:
        raise ResumeError(f"--resume from {ckpt}: the training data ({cfg.data.path}) is not what the run was "
                          f"started with (fingerprint {fp} != {saved_fp}): the saved data cursor would repeat or "
                          "skip prompts. Restore the data, or start a new run (another run.name)")


def start_state(cfg: Config, resume: bool, log) -> tuple[RunState, dict | None, Path | None]:
    """(state, trainer state, checkpoint) to start from; raises ResumeError for a plain re-run of
    a run that has checkpoints. Reads only: nothing in the run directory changes here."""
    ckpt = latest_checkpoint(cfg.run_dir)
    if ckpt is None:
        if resume:
            log(f"--resume: no complete checkpoint under {cfg.run_dir / 'checkpoints'}: starting from scratch")
        return RunState(), None, None
    if not resume:
        free = next(f"{cfg.run.name}-{k}" for k in range(2, 10**6) if not (cfg.run_dir.parent / f"{cfg.run.name}-{k}").exists())
        raise ResumeError(f"{cfg.run_dir} already has checkpoints (newest: {ckpt.name}), from an earlier run of this "
                          f"name: for a new run give it another name (run.name={free}); to continue that one, "
                          "pass --resume")
    state, trainer_state = load_run_state(ckpt)
    return state, trainer_state, ckpt


def prepare_run_dir(run_dir: Path, fresh: bool) -> None:
    """Make the run directory ready: remove half-written checkpoints; on a fresh start, drop the
    per-step logs and outputs of an earlier attempt that crashed before its first checkpoint."""
    run_dir.mkdir(parents=True, exist_ok=True)
    remove_incomplete(run_dir)
    if fresh:
        for name in ("metrics.jsonl", "trained_prompts.jsonl", "summary.json", "timeline.json", "timeline.png",
                     "curves.png"):
            (run_dir / name).unlink(missing_ok=True)


def restore_drafts(cfg: Config, engine, step: int, log) -> None:
    """A resumed run's engines get the responses of the rollout records up to ``step`` as drafts
    (``rollout.speculative``'s history and recent, otherwise rebuilt only as the run generates again)."""
    r = cfg.rollout
    if r.speculative != "on" or not {"history", "recent"} & set(r.speculative_sources):
        return
    from relayrl.engine.drafts import HISTORY_TOKENS
    from relayrl.tracking.rollouts import recorded_responses

    responses, damaged = recorded_responses(cfg.run_dir, step, HISTORY_TOKENS)
    for why in damaged:
        log(f"[yellow]speculative drafts: a rollout record left out, unreadable: {why}", highlight=False)
    if not responses and not cfg.run.save_rollouts:
        log("speculative drafts: no rollout records (run.save_rollouts=0): history starts empty")
        return
    log(f"speculative drafts: {engine.remember(responses)} earlier responses from the rollout records")
