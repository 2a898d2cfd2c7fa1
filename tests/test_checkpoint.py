"""Background checkpoint writing: the caller's thread only snapshots; what lands on disk is the
state at ``save`` time even if training goes on meanwhile; failures surface at the next call."""

import json
import random

import pytest
import torch
from safetensors.torch import load_file

from relayrl.run.checkpoint import (
    CheckpointWriter,
    RunState,
    latest_checkpoint,
    load_run_state,
    restore_rng,
    snapshot,
    write_snapshot,
)


def test_background_write_holds_the_state_at_save_time(tiny, tmp_path):
    model, tok = tiny
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(input_ids=torch.tensor([[5, 6, 7]])).logits.sum().backward()
    opt.step()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    writer = CheckpointWriter(tmp_path, model, tok, keep=2)
    state = RunState(step=3, samples=96, version=3, partial_buffer=[{"held": 1}])
    writer.save(state, {"optimizer": opt.state_dict()})
    # training goes on while the writer thread works: none of this may leak into the checkpoint
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    opt.step()
    state.step, state.partial_buffer = 4, []
    writer.wait()
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt is not None and ckpt.name == "step_000003"
    saved = load_file(ckpt / "model.safetensors")
    assert all(torch.equal(saved[k], before[k]) for k in saved)
    loaded, trainer_state = load_run_state(ckpt)
    assert loaded.step == 3 and loaded.partial_buffer == [{"held": 1}]
    assert "rng" in trainer_state and trainer_state["optimizer"]["state"]
    assert json.loads((ckpt / "state.json").read_text())["samples"] == 96


def test_a_failed_background_write_is_raised(tiny, tmp_path):
    model, tok = tiny
    blocker = tmp_path / "run"
    blocker.write_text("a file where the run directory should be")
    writer = CheckpointWriter(blocker, model, tok, keep=1)
    writer.save(RunState(step=1), {})
    with pytest.raises(RuntimeError, match="writing a checkpoint"):
        writer.wait()


def test_group_ids_continue_across_a_resume(tiny):
    """The async group-id counter restarted at 0 on resume, so a prompt drawn again in a later
    epoch could get the id of a group the checkpoint carries (and the engine refuses a pending id)."""
    from relayrl.run.checkpoint import RunState
    from relayrl.config import Config
    from relayrl.records import Prompt
    from relayrl.run.build import group_maker

    _, tok = tiny
    cfg = Config()

    def new_groups(state, prompts):
        return group_maker(cfg.rollout.group_size, cfg.data.prompt_format, tok, state)(prompts)

    p = Prompt("p0", [{"role": "user", "content": "Add 1 2"}])
    state = RunState()
    before = {t.request_id for _ in range(3) for g in new_groups(state, [p]) for t in g.trajectories}
    resumed = RunState.from_json(state.to_json())  # what the checkpoint holds
    after = {t.request_id for g in new_groups(resumed, [p]) for t in g.trajectories}
    assert len(before) == 3 * cfg.rollout.group_size and not before & after


def _draws(rng: dict) -> list:
    """Numbers from every generator the snapshot ``rng`` holds: torch's, Python's, CUDA's if there."""
    out = [torch.rand(4).tolist(), torch.randint(0, 10**6, (3,)).tolist(), [random.random() for _ in range(3)]]
    if "cuda" in rng:
        out.append(torch.rand(4, device="cuda").tolist())
    return out


def test_restore_rng_replays_the_random_numbers_drawn_after_the_snapshot(tiny):
    model, _ = tiny
    snap = snapshot(RunState(step=1), model, {})
    assert {"torch", "python"} <= set(snap["rng"]) <= {"torch", "python", "cuda"}
    first = _draws(snap["rng"])
    assert _draws(snap["rng"]) != first  # the generators moved on
    restore_rng({"rng": snap["rng"]})
    assert _draws(snap["rng"]) == first


def test_restore_rng_from_a_checkpoint_on_disk(tiny, tmp_path):
    """Through the real path: snapshot, write_snapshot, load_run_state, restore_rng."""
    model, tok = tiny
    snap = snapshot(RunState(step=5), model, {"optimizer": {}})
    first = _draws(snap["rng"])
    ckpt = write_snapshot(tmp_path, snap, model, tok, keep=1)
    assert _draws(snap["rng"]) != first
    _, trainer_state = load_run_state(ckpt)
    restore_rng(trainer_state)
    assert _draws(snap["rng"]) == first


def test_a_checkpoint_is_readable_by_other_users_as_the_umask_allows(tiny, tmp_path):
    """safetensors writes its files 0600; a checkpoint is for other users and serving containers too."""
    import os
    import stat

    from relayrl.files import umask

    model, tok = tiny
    ckpt = write_snapshot(tmp_path, snapshot(RunState(step=1), model, {}), model, tok, keep=1)
    mask = umask()
    assert stat.S_IMODE(os.stat(ckpt).st_mode) == 0o777 & ~mask
    modes = {p.name: stat.S_IMODE(os.stat(p).st_mode) for p in ckpt.iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o666 & ~mask}, modes


def test_the_demo_model_folder_is_readable_and_never_replaces_a_folder_of_other_things(tiny, tmp_path):
    import os
    import stat

    from relayrl.demo.model import RECIPE, save_built
    from relayrl.files import umask

    model, tok = tiny
    out = save_built(tmp_path / "demo", model, tok, RECIPE)
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o777 & ~umask()
    assert stat.S_IMODE(os.stat(out / "model.safetensors").st_mode) == 0o666 & ~umask()
    assert save_built(out, model, tok, RECIPE) == out  # a demo model built before is rebuilt in place
    (tmp_path / "project" / "src").mkdir(parents=True)
    with pytest.raises(ValueError, match="is not a demo model built before"):
        save_built(tmp_path / "project", model, tok, RECIPE)
    assert (tmp_path / "project" / "src").is_dir()
