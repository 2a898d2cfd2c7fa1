"""A run the command line leaves unnamed gets a folder named by its command (``config.naming``): the docs'
``relayrl train``, ``relayrl train run.mode=async`` and ``relayrl train model.lora.r=8`` are three runs,
and the same command with --resume finds its own."""

import pytest

import relayrl.run.loop
import relayrl.run.sft
from relayrl.cli import main
from relayrl.config.naming import MAX_NAME, run_name


@pytest.fixture()
def started(monkeypatch):
    """The config each command would start its run with (the run itself not started)."""
    got = []
    monkeypatch.setattr(relayrl.run.loop, "train", lambda cfg, resume=False: got.append((cfg, resume)))
    monkeypatch.setattr(relayrl.run.sft, "sft", lambda cfg, resume=False: got.append((cfg, resume)))
    return got


def _name(started, tmp_path, *argv) -> str:
    assert main([*argv, f"run.output_dir={tmp_path}"]) == 0
    return started[-1][0].run.name


def test_each_documented_variant_of_the_demo_gets_its_own_folder(started, tmp_path):
    assert _name(started, tmp_path, "train") == "demo"
    assert _name(started, tmp_path, "train", "run.mode=async") == "demo-run.mode-async"
    assert _name(started, tmp_path, "train", "model.lora.r=8") == "demo-model.lora.r-8"
    assert _name(started, tmp_path, "train", "model.lora.r=1", "trainer.lr=2e-3") == "demo-model.lora.r-1-trainer.lr-2e-3"
    assert _name(started, tmp_path, "sft") == "sft"
    assert _name(started, tmp_path, "sft", "trainer.lr=1e-4") == "sft-trainer.lr-1e-4"


def test_the_same_command_with_resume_names_the_same_folder(started, tmp_path):
    first = _name(started, tmp_path, "train", "run.mode=async", "run.seed=3")
    assert _name(started, tmp_path, "train", "run.mode=async", "run.seed=3", "--resume") == first
    assert started[-1][1] is True
    # its length, saving and watching may change on resume: they leave the name alone
    assert _name(started, tmp_path, "train", "run.mode=async", "run.seed=3", "run.steps=200", "eval.size=8",
                 "run.progress=false", "run.threads=1", "--resume") == first


def test_a_name_that_is_set_is_the_folder(started, tmp_path):
    assert _name(started, tmp_path, "train", "run.mode=async", "run.name=mine") == "mine"
    (tmp_path / "my.yaml").write_text("run: {name: my-run, steps: 20}\n")
    assert _name(started, tmp_path, "train", str(tmp_path / "my.yaml"), "trainer.lr=1e-4") == "my-run"
    (tmp_path / "unnamed.yaml").write_text("run: {steps: 20}\n")  # a file without one names the run itself
    assert _name(started, tmp_path, "train", str(tmp_path / "unnamed.yaml"), "trainer.lr=1e-4") == "unnamed-trainer.lr-1e-4"
    assert _name(started, tmp_path, "sft", "run.name=demo-sft") == "demo-sft"


def test_values_become_plain_folder_names_of_bounded_length():
    assert run_name("demo", None, ["env.name=agent:my agent.py:run", "data.path=/data/x.jsonl"], False) == \
        "demo-env.name-agent_my_agent.py_run-data.path-data_x.jsonl"
    assert run_name("demo", None, ["env.roles=[writer,critic]"], False) == "demo-env.roles-writer_critic"
    long = [run_name("demo", None, [f"data.path=/data/{c * 300}.jsonl"], False) for c in "ab"]
    assert all(len(n) == MAX_NAME and "/" not in n for n in long) and long[0] != long[1]


def test_a_runs_folder_stands_for_its_newest_checkpoint(tmp_path):
    from relayrl.cli import UsageError, newest_checkpoint

    run = tmp_path / "demo-model.lora.r-8"
    for step in ("step_000002", "step_000010", ".tmp-step_000020"):  # (the last one half-written)
        (run / "checkpoints" / step).mkdir(parents=True)
        if not step.startswith("."):
            (run / "checkpoints" / step / "state.json").write_text("{}")
    assert newest_checkpoint(str(run)) == str(run / "checkpoints" / "step_000010")
    assert newest_checkpoint(str(run / "checkpoints" / "step_000002")) == str(run / "checkpoints" / "step_000002")
    (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
    with pytest.raises(UsageError, match="no complete checkpoint under"):
        newest_checkpoint(str(tmp_path / "empty"))


def test_a_missing_local_path_fails_at_once_naming_what_is_there(tmp_path):
    """Before: a mistyped local model path waited 51 s through the hub client's retries offline, and `relayrl
    eval` of a checkpoint that does not exist said it could not load the tokenizer."""
    from relayrl.cli import UsageError, newest_checkpoint
    from relayrl.models import ModelError, looks_local, resolve_model_path

    assert looks_local("./m") and looks_local("/m") and looks_local("~/m") and looks_local("runs/demo/checkpoints/x")
    assert not looks_local("Qwen/Qwen2.5-0.5B") and not looks_local("gpt2")
    ckpts = tmp_path / "demo" / "checkpoints"
    for step in ("step_000010", "step_000020"):
        (ckpts / step).mkdir(parents=True)
    with pytest.raises(UsageError, match=rf"step_000100: no such checkpoint; {ckpts} holds step_000010, step_000020$"):
        newest_checkpoint(str(ckpts / "step_000100"))
    (tmp_path / "my-model").mkdir()
    with pytest.raises(ModelError, match=rf"model.path='{tmp_path}/my-modle': no such folder; did you mean "
                                         rf"{tmp_path}/my-model\? \(a local path, so the hub was not asked\)"):
        resolve_model_path(f"{tmp_path}/my-modle")


def test_a_run_not_made_yet_says_a_run_of_that_name_makes_it(tmp_path, monkeypatch):
    """`relayrl train examples/self_play.yaml` before its warm start: model.path=runs/nim-sft went to the hub."""
    from relayrl.models import ModelError, resolve_model_path

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "demo" / "checkpoints").mkdir(parents=True)
    with pytest.raises(ModelError, match=r"model.path='runs/nim-sft': no run 'nim-sft' in runs \(its runs: demo\): the "
                                         r"run that makes it is named so \(run.name=nim-sft\)"):
        resolve_model_path("runs/nim-sft")
