"""Checkpoints survive a power loss and a crash at any step of writing one, and carry the CUDA RNG.

Before: nothing was fsynced (after a power loss a ``step_N`` folder could exist with files never
written out), a checkpoint written again under an existing name was deleted before its replacement
was renamed in (a crash there left no ``step_N`` at all, or a half-deleted one), and the CUDA RNG
state was not saved."""

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from relayrl.run import checkpoint
from relayrl.run.checkpoint import (
    RunState,
    latest_checkpoint,
    load_run_state,
    remove_incomplete,
    restore_rng,
    snapshot,
    write_snapshot,
)

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/fd")


def _record(monkeypatch) -> list[tuple]:
    """Every fsync (by the path of its fd) and every os.replace, in order."""
    events: list[tuple] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst, *a, **k):
        events.append(("replace", str(Path(src).resolve()), str(Path(dst).resolve())))
        return real_replace(src, dst, *a, **k)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return events


def _first(events: list[tuple], event: tuple) -> int:
    assert event in events, f"{event} not among {events}"
    return events.index(event)


@linux_only
def test_every_file_then_the_folder_then_the_parent_are_fsynced(tiny, tmp_path, monkeypatch):
    model, tok = tiny
    run = tmp_path.resolve()
    write_snapshot(run, snapshot(RunState(step=1), model, {}), model, tok, keep=2)  # checkpoints/ exists
    events = _record(monkeypatch)
    final = write_snapshot(run, snapshot(RunState(step=3), model, {"x": 1}), model, tok, keep=2)
    ckpts, tmp = run / "checkpoints", run / "checkpoints" / ".tmp-step_000003"
    synced = {e[1] for e in events if e[0] == "fsync"}
    names = sorted(p.name for p in final.iterdir())
    assert {"model.safetensors", "trainer.pt", "state.json", "config.json"} <= set(names)
    assert not [n for n in names if str(tmp / n) not in synced], "files in the checkpoint never fsynced"
    rename = _first(events, ("replace", str(tmp), str(final)))
    for f in names:  # every file before the folder, the folder before its rename
        assert _first(events, ("fsync", str(tmp / f))) < _first(events, ("fsync", str(tmp))) < rename
    assert ("fsync", str(ckpts)) in events[rename:], "the parent folder was not fsynced after the rename"
    # ``latest``: its temp file fsynced before it replaces the pointer, the folder after
    latest = _first(events, ("replace", str(ckpts / "latest.tmp"), str(ckpts / "latest")))
    assert _first(events, ("fsync", str(ckpts / "latest.tmp"))) < latest
    assert ("fsync", str(ckpts)) in events[latest:]
    assert (ckpts / "latest").read_text() == "step_000003"


@linux_only
def test_write_atomic_fsyncs_the_file_and_its_folder(tmp_path, monkeypatch):
    events = _record(monkeypatch)
    target = tmp_path.resolve() / "latest"
    checkpoint._write_atomic(target, "step_000007")
    tmp = target.with_name("latest.tmp")
    rename = _first(events, ("replace", str(tmp), str(target)))
    assert _first(events, ("fsync", str(tmp))) < rename
    assert ("fsync", str(tmp_path.resolve())) in events[rename:]
    assert target.read_text() == "step_000007" and not tmp.exists()


class Crash(Exception):
    """The process dying at this point (nothing after it runs)."""


def _save(run: Path, model, tok, step: int, samples: int, keep: int, shift: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(shift)
    write_snapshot(run, snapshot(RunState(step=step, samples=samples), model, {"samples": samples}), model, tok, keep)


def _crash_at(monkeypatch, ckpts: Path, k: int, midway: bool) -> list[str]:
    """Make the k-th folder operation in ``ckpts`` (an os.replace, os.rename or shutil.rmtree) crash:
    before it does anything, or (``midway``, an rmtree) after it deleted one file."""
    ops: list[str] = []
    real = {"replace": os.replace, "rename": os.rename, "rmtree": shutil.rmtree}

    def wrap(name):
        def op(path, *a, **kw):
            if ckpts not in Path(path).resolve().parents:
                return real[name](path, *a, **kw)
            ops.append(f"{name} {Path(path).name}")
            if len(ops) == k:
                if midway and name == "rmtree":
                    files = sorted((f for f in Path(path).rglob("*") if f.is_file()),
                                   key=lambda f: (f.name != "model.safetensors", f.name))
                    victim = files[0] if files else None  # the weights first: the worst to lose
                    if victim is not None:
                        victim.unlink()
                raise Crash(ops[-1])
            return real[name](path, *a, **kw)
        return op

    for name, mod in (("replace", os), ("rename", os), ("rmtree", shutil)):
        monkeypatch.setattr(mod, name, wrap(name))
    return ops


def _loads_consistently(ckpt: Path, saved: dict) -> int:
    """The checkpoint loads (state, trainer state, weights, from_pretrained), all from one save;
    returns that save's ``samples``."""
    from transformers import AutoModelForCausalLM

    state, trainer_state = load_run_state(ckpt)
    assert state.step == 2 and state.samples in saved
    assert trainer_state["samples"] == state.samples
    weights = load_file(ckpt / "model.safetensors")
    assert all(torch.equal(weights[k], saved[state.samples][k]) for k in weights)
    AutoModelForCausalLM.from_pretrained(ckpt)
    return state.samples


@pytest.mark.parametrize("midway", [False, True], ids=["crash-before-op", "crash-midway-rmtree"])
def test_a_crash_at_any_step_of_overwriting_a_checkpoint_leaves_one_that_loads(tiny, tmp_path, monkeypatch, midway):
    """``step_000002`` is written again (the same step, new content) while ``step_000001`` is pruned
    (keep=1); the process dies at each folder operation in turn. Whatever the moment, a valid
    ``step_000002`` (the old or the new one, never a mix) is found, loads, and stays after the
    resume's clean-up, which leaves no temporary folder behind."""
    model, tok = tiny
    run = tmp_path.resolve()
    ckpts = run / "checkpoints"
    k, outcomes = 0, set()
    while True:
        k += 1
        shutil.rmtree(run, ignore_errors=True)
        _save(run, model, tok, 1, 10, keep=3, shift=0.0)
        _save(run, model, tok, 2, 20, keep=3, shift=0.5)
        saved = {20: {k_: v.clone() for k_, v in model.state_dict().items()}}
        with monkeypatch.context() as m:
            ops = _crash_at(m, ckpts, k, midway)
            try:
                _save(run, model, tok, 2, 30, keep=1, shift=0.25)
            except Crash:
                crashed = True
            else:
                crashed = False
        saved[30] = {k_: v.clone() for k_, v in model.state_dict().items()}
        where = f"crash at op {k} ({ops[-1] if crashed else 'none'}; ops {ops})"
        ckpt = latest_checkpoint(run)
        assert ckpt is not None, f"{where}: no checkpoint left"
        try:
            before = _loads_consistently(ckpt, saved)
            remove_incomplete(run)
            ckpt = latest_checkpoint(run)
            assert ckpt is not None and ckpt.name == "step_000002"
            assert _loads_consistently(ckpt, saved) == before
        except Exception as e:  # noqa: BLE001 - re-raised with the moment
            raise AssertionError(f"{where}: {type(e).__name__}: {e}") from e
        left = sorted(p.name for p in ckpts.iterdir() if p.name.startswith("."))
        assert not left, f"{where}: the clean-up left {left}"
        outcomes.add(before)
        if not crashed:
            assert before == 30
            break
        assert k < 50
    assert outcomes == {20, 30} and k > 3  # both sides of the switch were crashed on


def test_the_old_copy_set_aside_is_resumed_from_when_the_new_one_never_got_its_name(tiny, tmp_path, monkeypatch):
    """A crash right between setting ``step_N`` aside and renaming its replacement in: the copy set
    aside is the newest checkpoint, and the clean-up gives it its name back."""
    model, tok = tiny
    run = tmp_path.resolve()
    _save(run, model, tok, 2, 20, keep=2, shift=0.0)
    ckpts = run / "checkpoints"
    real = os.replace

    def replace(src, dst, *a, **kw):
        if Path(src).name.startswith(".tmp-step_"):
            raise Crash(f"{src} -> {dst}")
        return real(src, dst, *a, **kw)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(Crash):
        _save(run, model, tok, 2, 30, keep=2, shift=1.0)
    monkeypatch.undo()
    ckpt = latest_checkpoint(run)
    assert ckpt is not None and load_run_state(ckpt)[0].samples == 20
    removed = remove_incomplete(run)
    assert [p.name for p in removed] == [".tmp-step_000002"]
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_000002"]
    assert load_run_state(latest_checkpoint(run))[0].samples == 20


def test_a_newer_checkpoint_wins_over_an_old_copy_set_aside(tiny, tmp_path):
    model, tok = tiny
    run = tmp_path.resolve()
    _save(run, model, tok, 2, 20, keep=3, shift=0.0)
    _save(run, model, tok, 4, 40, keep=3, shift=0.0)
    ckpts = run / "checkpoints"
    shutil.copytree(ckpts / "step_000004", ckpts / ".old-step_000004")  # crash after the new one's rename
    shutil.copytree(ckpts / "step_000002", ckpts / ".old-step_000006")  # an incomplete one: no state.json
    (ckpts / ".old-step_000006" / "state.json").unlink()
    assert latest_checkpoint(run) == ckpts / "step_000004"
    remove_incomplete(run)
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_000002", "step_000004"]


# ---------------------------------------------------------------- the CUDA RNG


def _fake_cuda(monkeypatch, initialized: bool = True, devices: int = 2) -> dict:
    calls: dict = {"set": []}
    states = [torch.arange(16, dtype=torch.uint8) + i for i in range(devices)]

    def get_all():
        calls["get"] = calls.get("get", 0) + 1
        return [s.clone() for s in states]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialized)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: devices)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", get_all)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda new: calls["set"].append([s.clone() for s in new]))
    calls["states"] = states
    return calls


def test_the_cuda_rng_state_is_saved_and_restored(tiny, tmp_path, monkeypatch):
    model, tok = tiny
    cuda = _fake_cuda(monkeypatch)
    ckpt = write_snapshot(tmp_path, snapshot(RunState(step=1), model, {}), model, tok, keep=1)
    _, trainer_state = load_run_state(ckpt)
    saved = trainer_state["rng"].get("cuda")
    assert saved is not None, "the CUDA RNG state was not saved"
    assert len(saved) == 2 and all(torch.equal(a, b) for a, b in zip(saved, cuda["states"]))
    restore_rng(trainer_state)
    assert len(cuda["set"]) == 1 and all(torch.equal(a, b) for a, b in zip(cuda["set"][0], cuda["states"]))


def test_the_cuda_rng_restores_on_as_many_devices_as_there_are(monkeypatch):
    cuda = _fake_cuda(monkeypatch, devices=1)
    restore_rng({"rng": {"torch": torch.get_rng_state(), "python": __import__("random").getstate(),
                         "cuda": [torch.zeros(16, dtype=torch.uint8), torch.ones(16, dtype=torch.uint8)]}})
    (restored,) = cuda["set"]
    assert len(restored) == 1 and torch.equal(restored[0], torch.zeros(16, dtype=torch.uint8))


def test_cuda_not_in_use_is_not_initialised_to_save_it(tiny, monkeypatch):
    model, _ = tiny
    cuda = _fake_cuda(monkeypatch, initialized=False)
    assert "cuda" not in snapshot(RunState(step=1), model, {})["rng"] and "get" not in cuda


def test_old_checkpoints_and_cpu_machines_restore_without_the_cuda_rng(monkeypatch):
    import random

    base = {"torch": torch.get_rng_state(), "python": random.getstate()}
    cuda = _fake_cuda(monkeypatch)
    restore_rng({"rng": dict(base)})  # an older checkpoint: no "cuda" key
    assert cuda["set"] == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # saved on a GPU, resumed on a CPU
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda s: pytest.fail("set on a machine without CUDA"))
    restore_rng({"rng": {**base, "cuda": [torch.zeros(16, dtype=torch.uint8)]}})
    x = torch.rand(3)
    restore_rng({"rng": {**base, "cuda": [torch.zeros(16, dtype=torch.uint8)]}})
    assert torch.equal(torch.rand(3), x)  # the CPU RNG was restored all the same


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_real_cuda_rng_round_trips(tiny, tmp_path):
    model, tok = tiny
    torch.cuda.manual_seed_all(123)
    torch.rand(4, device="cuda")
    ckpt = write_snapshot(tmp_path, snapshot(RunState(step=1), model, {}), model, tok, keep=1)
    expected = torch.rand(4, device="cuda")
    torch.rand(100, device="cuda")
    restore_rng(load_run_state(ckpt)[1])
    assert torch.equal(torch.rand(4, device="cuda"), expected)


def test_state_json_is_the_snapshot(tiny, tmp_path):
    """(the fsync changes kept what is written)"""
    model, tok = tiny
    ckpt = write_snapshot(tmp_path, snapshot(RunState(step=5, samples=7), model, {}), model, tok, keep=1)
    assert json.loads((ckpt / "state.json").read_text())["samples"] == 7
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_000005"
