"""relayrl from Python: ``relayrl.Run`` builds a run from a YAML file, overrides and keyword arguments and
trains it; ``relayrl train`` is a layer over it (the same settings give the same run's folder and config)."""

import json

import pytest

import relayrl
from relayrl.config import ConfigError


def test_keyword_arguments_are_sections_dotted_names_or_trls_names(tmp_path):
    (tmp_path / "my.yaml").write_text("trainer: {lr: 3.0e-4}\nrollout: {group_size: 2}\n")
    run = relayrl.Run(tmp_path / "my.yaml", ["run.seed=3"], trainer={"lr": 1e-5}, model={"lora": {"r": 8}},
                      num_generations=4, **{"run.output_dir": str(tmp_path), "run.mode": "async"})
    c = run.cfg
    assert (c.trainer.lr, c.model.lora.r, c.rollout.group_size, c.run.seed, c.run.mode) == (1e-5, 8, 4, 3, "async")
    assert run.dir.parent == tmp_path and run.dir.name.startswith("my-run.seed-3-trainer.lr-1e-05-model.lora.r-8")
    # named as `relayrl train trainer.lr=1e-05 rollout.group_size=4` names it (TRL's name as relayrl's field)
    assert relayrl.Run(trainer={"lr": 1e-5}, num_generations=4).dir.name == "demo-trainer.lr-1e-05-rollout.group_size-4"
    with pytest.raises(ConfigError, match=r"unknown key 'trainer.lrr'. Did you mean 'trainer.lr'"):
        relayrl.Run(trainer={"lrr": 1})
    with pytest.raises(ValueError, match="sft.epochs is set, but it only applies to relayrl sft"):
        relayrl.Run(sft={"epochs": 1})


def test_a_run_from_python_trains_and_resumes(tiny_path, tmp_path):
    run = relayrl.Run(model={"path": tiny_path}, run={"output_dir": str(tmp_path), "name": "nb", "steps": 2,
                                                      "progress": False},
                      rollout={"max_new_tokens": 8, "prompts_per_step": 2, "group_size": 2},
                      data={"eval_path": None}, reward={"fn": "tests.rewards_for_tests:digit_fraction"})
    summary = run.train()
    assert summary["steps"] == 2 and json.loads((run.dir / "summary.json").read_text())["steps"] == 2
    more = relayrl.Run(model={"path": tiny_path}, run={"output_dir": str(tmp_path), "name": "nb", "steps": 3,
                                                       "progress": False},
                       rollout={"max_new_tokens": 8, "prompts_per_step": 2, "group_size": 2},
                       data={"eval_path": None}, reward={"fn": "tests.rewards_for_tests:digit_fraction"})
    assert more.train(resume=True)["steps"] == 3


def test_resume_finds_the_run_a_changed_setting_no_longer_names(tmp_path, capsys):
    """An unnamed run resumed with a setting --resume allows changing (run.max_failure_frac, as the failure
    message suggests) landed in a new folder and started from step 0; now it continues the run, said."""
    step = tmp_path / "demo-rollout.group_size-4" / "checkpoints" / "step_000002"
    step.mkdir(parents=True)
    (step / "state.json").write_text("{}")
    run = relayrl.Run(None, ["rollout.group_size=4", "run.max_failure_frac=0.9"], **{"run.output_dir": str(tmp_path)})
    assert run.dir.name == "demo-rollout.group_size-4-run.max_failure_frac-0.9"
    run._find_resumed()
    assert run.dir == tmp_path / "demo-rollout.group_size-4"
    assert "its name leaves out run.max_failure_frac=0.9, set since it started" in capsys.readouterr().err
    named = relayrl.Run(None, ["rollout.group_size=4", "run.name=mine"], **{"run.output_dir": str(tmp_path)})
    named._find_resumed()  # (a name the user gave is the folder, always)
    assert named.dir == tmp_path / "mine"
