"""What a new user meets in the first hour: settings that would do nothing refused at load,
``relayrl eval --checkpoint`` evaluating what the run trained on, a verifier's wrong return value
named, Ctrl-C, and the messages and pictures around them."""

from __future__ import annotations

import json
import math
import re

import pytest

from relayrl.cli import main
from relayrl.config import ConfigError, load_config
from tests.test_chat_template import chatml_tokenizer  # noqa: F401 - a fixture

# ---------------------------------------------------------------- group_size=1 with a group baseline


@pytest.mark.parametrize("advantage", ["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"])
def test_one_response_per_group_is_refused_with_a_group_baseline(advantage, capsys):
    with pytest.raises(ConfigError, match=rf"rollout.group_size=1 with algo.advantage='{advantage}'.*"
                                          r"rollout.group_size ≥ 2.*reinforce_pp"):
        load_config(None, ["rollout.group_size=1", f"algo.advantage={advantage}"])
    assert main(["train", "rollout.group_size=1", f"algo.advantage={advantage}"]) == 2
    assert capsys.readouterr().err.startswith("relayrl: config error: ")
    # baselines that need no group still take one response a prompt
    for other in ("reinforce_pp", "gae"):
        assert load_config(None, ["rollout.group_size=1", f"algo.advantage={other}"]).rollout.group_size == 1


# ---------------------------------------------------------------- a verifier's return value

VERIFIER = '''
import numpy as np

def score(completion, answer, metadata):
    return {"text-number": "1.0", "text-word": "correct", "none": None, "true": True, "false": False,
            "np-bool": np.bool_(True), "np-float": np.float32(0.5), "int": 1, "long": "x" * 500}[completion]
'''


def test_a_verifier_that_returns_a_non_number_fails_naming_what_it_returned(tmp_path):
    from relayrl.rewards.verifiers import RewardRunner

    (tmp_path / "verifier.py").write_text(VERIFIER)
    r = RewardRunner(f"{tmp_path / 'verifier.py'}:score", timeout_s=10, workers=1)
    try:
        keys = ["text-number", "text-word", "none", "true", "false", "np-bool", "np-float", "int", "long"]
        out = r.score([(k, None, {}) for k in keys])
    finally:
        r.close()
    got = dict(zip(keys, out))
    # True/False (and numpy's) count as 1.0/0.0; numbers are numbers
    assert {k: got[k] for k in ("true", "false", "np-bool", "np-float", "int")} == {
        "true": (1.0, None), "false": (0.0, None), "np-bool": (1.0, None), "np-float": (0.5, None), "int": (1.0, None)}
    # anything else is a failure of the user's code, counted like a raise, never a reward
    for key, shown in [("text-number", "returned str '1.0'"), ("text-word", "returned str 'correct'"),
                       ("none", "returned NoneType None"), ("long", "returned str 'xxxx")]:
        value, failure = got[key]
        assert math.isnan(value) and failure["kind"] == "reward", key  # (no reward)
        assert failure["error"].startswith(shown) and "a reward must be a finite real number" in failure["error"]
        assert "could not convert" not in failure["error"] and "ValueError" not in failure["error"]
    assert len(got["long"][1]["error"]) < 200  # the repr is cut short
    assert r.stats.failures == 4


DEBUGGED = """\
def helper(metadata):
    return metadata["b"]


def score(completion, answer, metadata):
    return float(helper(metadata) == completion)


def grpo_style(completions, **kwargs):
    return [1.0 for _ in completions]
"""


def test_a_failing_verifier_shows_the_users_own_file_and_line_and_what_metadata_holds(tmp_path, monkeypatch):
    from relayrl.rewards.verifiers import RewardRunner

    monkeypatch.chdir(tmp_path)  # (a verifier in the working folder: its path shown relative to it)
    (tmp_path / "my_reward.py").write_text(DEBUGGED)
    r = RewardRunner("my_reward.py:score", timeout_s=10, workers=1)
    try:
        (value, failure), = r.score([("x", None, {"a": 1})])
    finally:
        r.close()
    assert math.isnan(value)
    assert failure["error"] == ("KeyError: 'b' (at my_reward.py:2 in helper: return metadata[\"b\"] < my_reward.py:6 in "
                                "score: return float(helper(metadata) == completion)); metadata holds the row's "
                                "fields named in data.metadata_fields, here ['a']")


@pytest.mark.parametrize("name, needle", [
    ("grpo_style", r"reward.fn='my_reward.py:grpo_style' takes grpo_style\(completions, \*\*kwargs\) and cannot be "
                   r"called as fn\(completion: str, answer: str \| None, metadata: dict\) -> float, called once per "
                   r"response \(too many positional arguments\); it looks like TRL's reward function"),
    ("scor", r"'my_reward.py:scor': my_reward.py has no 'scor'; the functions it defines: grpo_style, helper, score$"),
])
def test_a_verifier_that_cannot_be_called_as_one_is_refused_at_start(tmp_path, monkeypatch, name, needle):
    """Before: TRL's signature failed every call once the first evaluation had been sampled, a misspelled name
    showed relayrl's private module name."""
    from relayrl.rewards.verifiers import RewardRunner

    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_reward.py").write_text(DEBUGGED)
    with pytest.raises(ValueError, match=needle):
        RewardRunner(f"my_reward.py:{name}", timeout_s=10, workers=1)


def test_a_run_whose_verifier_returns_text_stops_saying_what_it_returned(tiny_path, tmp_path, capsys):
    (tmp_path / "verifier.py").write_text("def score(completion, answer, metadata):\n    return 'correct'\n")
    assert main(["train", f"model.path={tiny_path}", f"reward.fn={tmp_path / 'verifier.py'}:score",
                 "rollout.max_new_tokens=4", "rollout.prompts_per_step=2", "rollout.group_size=2",
                 "data.eval_path=null", "run.steps=1", "run.progress=false", f"run.output_dir={tmp_path}"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("relayrl: user code error: step 1: reward.fn=") and "failed in 4 of 4 episodes: returned " \
        "str 'correct': a reward must be a finite real number" in err and "raised" not in err


def test_reward_fn_help_gives_the_verifier_signature():
    from relayrl.config import describe

    doc = describe().split("reward.fn ", 1)[1].split("reward.timeout_s", 1)[0]
    assert "fn(completion: str, answer: str | None, metadata: dict) -> float" in " ".join(doc.split())
    assert "True/False count as 1.0/0.0" in " ".join(doc.split())


# ---------------------------------------------------------------- a prompt with no room in the context


@pytest.mark.parametrize("overrides, field", [(["rollout.max_new_tokens=600"], "rollout.max_new_tokens=600"),
                                              (["env.name=calculator", "env.max_tokens=512"], "env.max_tokens=512")])
def test_no_room_for_a_prompt_gives_the_context_length_and_where_it_was_read(tiny_path, tmp_path, capsys, overrides,
                                                                             field):
    assert main(["train", f"model.path={tiny_path}", "data.eval_path=null", f"run.output_dir={tmp_path}",
                 "reward.fn=exact", *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"relayrl: input error: {field} leaves no room for a prompt: the model's context is 512 "
                          f"tokens (max_position_embeddings in the config.json of {tiny_path})")
    assert not any(tmp_path.iterdir())  # (no run directory, whatever its name)


def test_a_prompt_too_long_says_how_the_room_was_counted(tiny_path):
    from relayrl.models import load_tokenizer
    from relayrl.run.build import check_prompts_fit
    from relayrl.records import Prompt

    cfg = load_config(None, ["rollout.max_new_tokens=500"])
    long = Prompt(id="p0", messages=[{"role": "user", "content": "a=3 b=4 " * 40}])
    with pytest.raises(ValueError, match=r"more than the 12 the model's context of 512 tokens \(max_position_embeddings "
                                         r"in the config.json of .*\) leaves after rollout.max_new_tokens=500"):
        check_prompts_fit(cfg, tiny_path, load_tokenizer(tiny_path), [long], None)


# ---------------------------------------------------------------- relayrl eval --checkpoint DIR


@pytest.fixture(scope="module")
def trained_run(tiny_path, tmp_path_factory):
    """A one-step run whose data, generation length and verifier are all not the defaults."""
    import shutil
    from pathlib import Path

    tmp = tmp_path_factory.mktemp("run")
    held_out = tmp / "held_out.jsonl"
    held_out.write_text("".join((Path(__file__).parent / "data_small.jsonl").read_text().splitlines(True)[:5]))
    assert main(["train", f"model.path={tiny_path}", "data.path=tests/data_small.jsonl", f"data.eval_path={held_out}",
                 "eval.size=5", "rollout.max_new_tokens=8", "reward.fn=tests.rewards_for_tests:digit_fraction",
                 "rollout.prompts_per_step=2", "rollout.group_size=2", "run.steps=1", "run.progress=false",
                 f"run.output_dir={tmp}", "run.name=r"]) == 0
    ckpt = tmp / "r" / "checkpoints" / "step_000001"
    shutil.rmtree(tmp / "r" / "eval", ignore_errors=True)
    return ckpt, held_out


def test_eval_of_a_checkpoint_uses_the_runs_recorded_config_and_says_what_it_evaluates(trained_run, capsys):
    import json

    ckpt, held_out = trained_run
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(ckpt)]) == 0
    about = json.loads((ckpt / "eval.json").read_text())
    assert (about["data"], about["prompts"], about["max_new_tokens"], about["reward"]) == (
        str(held_out), 5, 8, "tests.rewards_for_tests:digit_fraction")
    err = capsys.readouterr().err
    said = next(line for line in err.splitlines() if line.startswith("evaluating "))
    assert said.startswith(f"evaluating {ckpt} on {held_out}: 5 prompts (eval.size=5), 1 sampled response")
    assert "rollout.max_new_tokens=8" in said and "reward.fn=tests.rewards_for_tests:digit_fraction" in said
    assert said.endswith(f"settings: the checkpoint's recorded config ({ckpt / 'state.json'})")


def test_eval_of_a_checkpoint_lets_the_command_line_override_the_recorded_config(trained_run, tmp_path, capsys):
    import json

    ckpt, held_out = trained_run
    assert main(["eval", "--checkpoint", str(ckpt), "rollout.max_new_tokens=4", "-o", str(tmp_path)]) == 0
    about = json.loads((tmp_path / "eval.json").read_text())
    assert (about["data"], about["max_new_tokens"]) == (str(held_out), 4)
    assert "settings: the checkpoint's recorded config" in capsys.readouterr().err


def test_eval_with_the_runs_arguments_evaluates_its_newest_checkpoint_and_the_base_only_when_asked(
        trained_run, tiny_path, tmp_path, capsys):
    """``relayrl eval ARGS`` after ``relayrl train ARGS`` evaluated the untrained base while writing into the
    run's folder (a guide presented that number as the run's): now the run's newest checkpoint, said."""
    import json

    ckpt, held_out = trained_run
    args = [f"model.path={tiny_path}", "data.path=tests/data_small.jsonl", f"data.eval_path={held_out}", "eval.size=5",
            "rollout.max_new_tokens=8", "reward.fn=tests.rewards_for_tests:digit_fraction",
            "rollout.prompts_per_step=2", "rollout.group_size=2", f"run.output_dir={ckpt.parent.parent.parent}",
            "run.name=r"]
    capsys.readouterr()
    assert main(["eval", *args, "-o", str(tmp_path / "run")]) == 0
    err = capsys.readouterr().err
    assert f"relayrl eval: the newest checkpoint of {ckpt.parent.parent}, step 1 ({ckpt};" in err
    assert f"evaluating {ckpt} on {held_out}" in err
    assert main(["eval", *args, "--base", "-o", str(tmp_path / "base")]) == 0
    err = capsys.readouterr().err
    assert "newest checkpoint" not in err and f"evaluating {tiny_path} on {held_out}" in err
    assert main(["eval", *args[:-1], "run.name=never-trained", "-o", str(tmp_path / "none")]) == 0
    assert f"{ckpt.parent.parent.parent / 'never-trained'} has no checkpoint: evaluating model.path={tiny_path}, " \
           "untrained" in capsys.readouterr().err
    assert json.loads((tmp_path / "run" / "eval.json").read_text())["data"] == str(held_out)


def test_a_runs_numbers_name_what_they_measured(trained_run):
    """digit_fraction gives partial credit: the summary's accuracy counts responses with reward ≥ 1, its mean
    reward is named so, in summary.json, the metrics and the evaluation's result alike."""
    import json

    ckpt, _ = trained_run
    run = ckpt.parent.parent
    summary = json.loads((run / "summary.json").read_text())
    after = summary["eval_after"]
    assert summary["eval_accuracy_after"] == after["accuracy"] and summary["eval_reward_mean_after"] == after["reward_mean"]
    assert {"accuracy", "accuracy_greedy", "reward_mean", "reward_mean_greedy"} <= set(after)
    assert after["accuracy"] <= after["reward_mean"]  # rewards in [0, 1]: successes (reward ≥ 1) at most the mean


def test_eval_lines_are_not_broken_mid_sentence(trained_run, tmp_path, capsys):
    ckpt, _ = trained_run
    out = tmp_path / ("a-folder-with-a-long-name-" * 3) / "eval"
    assert main(["eval", "--checkpoint", str(ckpt), "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"eval report: {out / 'eval.json'}; every response: {out / 'eval_samples.jsonl'}\n" in err


# ---------------------------------------------------------------- dynamic sampling multiplying generation


def test_filter_watch_speaks_once_after_three_costly_steps_in_a_row():
    from relayrl.rollout.filter_watch import FilterWatch

    w = FilterWatch(batch=16, cap_factor=4)
    # the cap (64), or 3x the groups trained (48); a cheap step in between starts the count again
    notes = [w.update(n) for n in [64, 64, 3, 64, 48, 64, 64, 64]]
    assert notes[:5] == [None] * 5 and notes[6:] == [None, None]
    assert notes[5].startswith("dynamic sampling filtered 64, 48, 64 groups in the last 3 steps (the cap is "
                               "rollout.dynamic_sampling_max=4 × rollout.prompts_per_step=16 = 64 a step)")
    assert "generation made 4.7× the groups trained" in notes[5] and "rollout.dynamic_sampling=false" in notes[5]
    w = FilterWatch(batch=16, cap_factor=4)
    # what the demo does while it learns (1-2.5x its batch filtered): the price of groups that teach, quiet
    assert [w.update(n) for n in [30, 20, 40, 47, 16]] == [None] * 5


def test_a_run_whose_groups_all_have_no_variance_says_so_once(tiny_path, tmp_path, capsys):
    assert main(["train", f"model.path={tiny_path}", "reward.fn=tests.rewards_for_tests:half",
                 "rollout.max_new_tokens=4", "rollout.prompts_per_step=2", "rollout.group_size=2",
                 "rollout.dynamic_sampling_max=1", "data.eval_path=null", "run.steps=5", "run.progress=false",
                 f"run.output_dir={tmp_path}"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # (the console folds long lines)
    assert out.count("dynamic sampling filtered") == 1
    assert "dynamic sampling filtered 2, 2, 2 groups in the last 3 steps (the cap is rollout.dynamic_sampling_max=1 " \
           "× rollout.prompts_per_step=2 = 2 a step)" in out and "rollout.dynamic_sampling=false" in out


# ---------------------------------------------------------------- Ctrl-C

# The run as `relayrl train` runs it. Python leaves SIGINT ignored in a child whose parent ignored it
# (a test runner started in the background): the CLI at a terminal has the default handler, so restore it.
CLI = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
       "from relayrl.cli import main; sys.exit(main(sys.argv[1:]))")


@pytest.mark.slow
@pytest.mark.parametrize("mode, save_every", [("sync", 2), ("periodic", 0)])
def test_ctrl_c_says_where_the_last_checkpoint_is_and_how_to_resume(tiny_path, tmp_path, mode, save_every):
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    args = [f"model.path={tiny_path}", "rollout.max_new_tokens=8", "rollout.prompts_per_step=2",
            "rollout.group_size=2", "data.eval_path=null", "run.steps=100000", f"run.save_every={save_every}",
            "run.progress=false", f"run.output_dir={tmp_path}", f"run.mode={mode}", "run.name=demo"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent.parent / "src"),
                                                        os.environ.get("PYTHONPATH", "")])}
    # its own process group, signalled whole: Ctrl-C at a terminal reaches every process of the run
    p = subprocess.Popen([sys.executable, "-c", CLI, "train", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env, start_new_session=True)
    try:
        metrics, deadline = tmp_path / "demo" / "metrics.jsonl", time.monotonic() + 240
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):  # past a checkpoint, mid-run
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()
            time.sleep(0.05)
        os.killpg(p.pid, signal.SIGINT)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    command = "relayrl train " + " ".join(args) + " --resume"
    assert p.returncode == 130, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err  # one line: no traceback, no "engine error"
    if save_every:
        ckpt = Path(lines[0].split("the last complete checkpoint is ", 1)[1].split(" (step ", 1)[0])
        assert lines[0].startswith(f"relayrl: interrupted; the last complete checkpoint is {tmp_path / 'demo'}")
        assert (ckpt / "state.json").is_file() and lines[0].endswith(f"; resume with: {command}")
    else:
        assert lines[0] == (f"relayrl: interrupted before the run's first checkpoint (run.save_every=0: only at the "
                            f"end, under {tmp_path / 'demo' / 'checkpoints'}): nothing to resume from; {command} "
                            "starts it over")


# ---------------------------------------------------------------- the endpoint: tools that change start a branch


def test_a_request_whose_tools_changed_starts_a_new_branch_and_is_counted(chatml_tokenizer):  # noqa: F811
    import json

    from relayrl.run.evaluation import episode_stats
    from relayrl.records import Trajectory
    from tests.test_episodes import PROMPT, add, calc_reply
    from tests.test_serve import TOOLS, run, served

    more = TOOLS + [{"type": "function", "function": {"name": "sub", "description": "Subtract.", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]

    def program(tools_then):
        async def go(client, prompt):
            first = await client.chat.completions.create(model="policy", messages=prompt.messages, tools=TOOLS)
            message = first.choices[0].message
            call = message.tool_calls[0]
            # the conversation extended exactly, message by message; only the tools may differ
            await client.chat.completions.create(model="policy", tools=tools_then, messages=[
                *prompt.messages, message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": str(add(**json.loads(call.function.arguments)))}])
            return 1.0
        return go

    infos = {}
    for name, tools in (("same", TOOLS), ("changed", more)):
        runner = served(chatml_tokenizer, calc_reply, program(tools))
        try:
            infos[name] = run(runner, Trajectory(PROMPT, "g", 0, [])).info
        finally:
            runner.close()
    assert (infos["same"]["branches"], infos["same"]["merged_turns"], infos["same"]["new_branch_tools_changed"]) == \
        (0, 1, 0)
    assert (infos["changed"]["branches"], infos["changed"]["merged_turns"],
            infos["changed"]["new_branch_tools_changed"]) == (1, 0, 1)

    class T:
        def __init__(self, info):
            self.info = info
    assert episode_stats([T(infos["changed"]), T(infos["same"])])["serve/new_branch_tools_changed"] == 1


# ---------------------------------------------------------------- relayrl plot RUN RUN: both step-0 markers show


def test_compared_runs_with_the_same_accuracy_before_training_both_show_at_step_0(tmp_path):
    from relayrl.tracking.pictures import curves_figure, read_run
    from tests.test_pictures import write_run

    runs = [read_run(write_run(tmp_path / name, [0.1, 0.2, 0.3], {2: acc}, before=0.2))
            for name, acc in (("a", 0.3), ("b", 0.5), ("c", 0.4))]
    acc = curves_figure(runs).axes[1]
    at_0 = [(line.get_marker(), line.get_markersize()) for line in acc.get_lines()
            if len(line.get_xdata()) > 1 and line.get_xdata()[0] == 0 and line.get_linestyle() == "-"]
    assert len(at_0) == 3 and len({m for m, _ in at_0}) == 3  # a shape of its own each
    sizes = [s for _, s in at_0]
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == 3  # each drawn later is smaller: on top


# ---------------------------------------------------------------- TensorBoard: scalars are scalars


def test_tensorboard_metrics_read_back_as_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from relayrl.tracking.trackers import TrackerContext, Trackers

    trackers = Trackers.open(["jsonl", "tensorboard"], TrackerContext(tmp_path, "r", "p", {"run": {"steps": 2}}, None),
                             print)
    trackers.log({"step": 1, "reward_mean": 0.25, "eval/accuracy": 0.5})
    trackers.log({"step": 2, "reward_mean": 0.75})
    trackers.close(ok=True)
    ea = EventAccumulator(str(tmp_path / "tensorboard"))
    ea.Reload()
    assert {"reward_mean", "eval/accuracy"} <= set(ea.Tags()["scalars"])
    assert [(e.step, e.value) for e in ea.Scalars("reward_mean")] == [(1, 0.25), (2, 0.75)]
    assert [(e.step, e.value) for e in ea.Scalars("eval/accuracy")] == [(1, 0.5)]


def test_threads_default_to_the_cores_neighbours_leave_free(monkeypatch):
    """Item 1: a torch thread on a core another process keeps busy slows every step to its pace (the demo
    3.4x with one busy neighbour at 2 threads, 1.5x at 1: benchmarks/busy_neighbours.py), so run.threads=0
    counts the idle cores at start."""
    from relayrl.config import RolloutCfg, RunCfg
    from relayrl.engine import placement

    monkeypatch.setattr(placement.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(placement.time, "sleep", lambda s: None)

    def sampled(idle_share: dict[int, float]):
        reads = iter([{c: (0, 0) for c in idle_share}, {c: (int(100 * s), 100) for c, s in idle_share.items()}])
        monkeypatch.setattr(placement, "_cpu_times", lambda: next(reads))

    sampled({0: 1.0, 1: 0.0})  # one core busy with a neighbour
    assert placement.free_cores() == 1
    sampled({0: 0.97, 1: 0.9})  # quiet
    assert placement.free_cores() == 2
    sampled({0: 0.05, 1: 0.1})  # both busy: still one thread
    assert placement.free_cores() == 1
    sampled({0: 1.0, 1: 0.0})
    assert placement.threads(RolloutCfg(), RunCfg()) == (False, 0, 1)
    sampled({0: 1.0, 1: 1.0})
    assert placement.threads(RolloutCfg(), RunCfg(mode="async")) == (True, 1, 1)  # split between engine and trainer
    monkeypatch.setattr(placement, "_cpu_times", lambda: pytest.fail("run.threads set: nothing to measure"))
    assert placement.threads(RolloutCfg(), RunCfg(threads=2)) == (False, 0, 2)


# ---------------------------------------------------------------- held-out prompts go with their data


def test_data_of_ones_own_is_never_evaluated_on_the_demos_prompts(tiny_path, tmp_path, capsys):
    from pathlib import Path

    assert load_config(None, []).data.eval_path == "builtin:demo-eval"  # the demo's data, its held-out set
    assert load_config(None, ["data.path=builtin:agent-demo"]).data.eval_path == "builtin:agent-demo-eval"
    assert load_config(None, ["data.path=mine.jsonl"]).data.eval_path is None
    assert load_config(None, ["data.path=mine.jsonl", "data.eval_path=test.jsonl"]).data.eval_path == "test.jsonl"
    rows = str(Path(__file__).parent / "data_small.jsonl")
    assert main(["train", f"model.path={tiny_path}", f"data.path={rows}", "reward.fn=exact", "run.steps=1",
                 "rollout.max_new_tokens=4", "rollout.prompts_per_step=2", "rollout.group_size=2", "run.progress=false",
                 f"run.output_dir={tmp_path}", "run.name=own"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"no held-out evaluation: data.path={rows} is data of your own and data.eval_path is not set" in out
    assert "eval before" not in out and not (tmp_path / "own" / "eval.json").exists()
    summary = json.loads((tmp_path / "own" / "summary.json").read_text())
    assert summary["eval_accuracy_before"] is None and summary["eval_accuracy_after"] is None
    assert "demo-eval" not in json.dumps(summary)


def test_several_reward_functions_with_weights():
    """TRL's reward_funcs and reward_weights: reward.fn a list, reward.fn_weights one each; the reward is the
    weighted sum, and an episode any of them fails is a failure (counted, left out), never a partial sum."""
    from relayrl.config import ConfigError
    from relayrl.rewards.verifiers import RewardRunner

    cfg = load_config(None, ["reward.fn=[tests.rewards_for_tests:half, tests.rewards_for_tests:not_a_number]",
                             "reward.fn_weights=[2, 0.5]"])
    assert cfg.reward.fn == ["tests.rewards_for_tests:half", "tests.rewards_for_tests:not_a_number"]
    r = RewardRunner(["tests.rewards_for_tests:half", "tests.rewards_for_tests:right"], timeout_s=10, workers=1,
                     weights=[2.0, 0.5])
    try:
        assert r.score([("x", None, {})]) == [(2 * 0.5 + 0.5 * 1.0, None)]
    finally:
        r.close()
    r = RewardRunner(["tests.rewards_for_tests:half", "tests.rewards_for_tests:not_a_number"], timeout_s=10, workers=1)
    try:
        (value, failure), = r.score([("str", None, {})])
    finally:
        r.close()
    assert math.isnan(value) and failure["error"].startswith("returned str 'high'")
    assert failure["source"] == "reward.fn=tests.rewards_for_tests:half,tests.rewards_for_tests:not_a_number"
    for overrides, needle in ((["reward.fn=[math]", "reward.fn_weights=[1, 2]"], "2 weights for the 1 functions"),
                              (["reward.fn_weights=[1]"], "reward.fn_weights is set, but reward.fn is one function"),
                              (["reward.fn=[math, none]"], "'none' is not one")):
        with pytest.raises(ConfigError, match=re.escape(needle)):
            load_config(None, overrides)
