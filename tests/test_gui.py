"""``env.name=gui``: screens rendered with PIL, the policy's click/type/scroll actions on them, a new screenshot after
each, the reward the share of screens done; a task that cannot be drawn names its prompt."""

import asyncio
import random

import pytest

from relayrl.envs import gui
from relayrl.envs.base import load_env_class
from relayrl.records import Prompt

FORM = {"size": [128, 96], "screens": [
    {"widgets": [{"kind": "field", "label": "Name", "box": [4, 4, 124, 24]},
                 {"kind": "button", "label": "OK", "box": [40, 30, 88, 50]}],
     "goals": [{"type": {"field": "Name", "text": "Ada"}}, {"click": "OK"}]},
    {"widgets": [{"kind": "list", "items": ["red", "green", "blue", "gold"], "box": [4, 4, 124, 64], "rows": 3}],
     "goals": [{"select": "gold"}]}]}


def _prompt(task, text="Do it."):
    return Prompt("p1", [{"role": "user", "content": text}], metadata={"gui": task})


def test_actions_move_the_task_on_and_each_step_shows_the_next_screenshot():
    env = load_env_class("gui")()
    messages = asyncio.run(env.reset(_prompt(FORM)))
    first = messages[-1]["content"][0]["image"]
    assert first.size == (128, 96) and "click(x, y)" in messages[-1]["content"][1]["text"]
    step = lambda text: asyncio.run(env.step(text))  # noqa: E731
    r = step("I think type(\"Ada\")")  # (no field in focus: nothing typed)
    assert r.reward == 0 and not r.done and r.messages[0]["content"][0]["image"].tobytes() == first.tobytes()
    r = step("click(60, 14)")  # the field
    assert r.reward == 0 and r.messages[0]["content"][0]["image"].tobytes() != first.tobytes()  # (in focus: blue)
    typed = step('type("Ada")').messages[0]["content"][0]["image"]
    assert typed.tobytes() != first.tobytes()
    r = step("hmm")
    assert r.messages[0]["content"][1]["text"] == "No action." and r.info == {"gui_actions": False}
    r = step("click(1, 90) then click(60, 40)")  # (the last action counts: the OK button)
    assert r.reward == 0.5 and not r.done  # screen 1 done: the list's screen
    shown = r.messages[0]["content"][0]["image"]
    assert step("click(20, 40)").reward == 0  # "blue", not "gold"
    r = step("scroll(down)")
    assert r.reward == 0 and r.messages[0]["content"][0]["image"].tobytes() != shown.tobytes()
    r = step("click(20, 50)")  # the third row shown, after one row of scroll: "gold"
    assert r.reward == 0.5 and r.done


def test_the_built_in_tasks_reward_the_named_button_on_each_screen():
    instruction, task = gui.make_task(random.Random(0))
    env = gui.GuiEnv(explain=False)
    messages = asyncio.run(env.reset(_prompt(task, instruction)))
    assert messages[-1]["content"][1]["text"] == instruction
    rewards = []
    for screen in task["screens"]:
        target = next(w for w in screen["widgets"] if w["label"] == screen["goals"][0]["click"])
        other = next(w for w in screen["widgets"] if w is not target)
        assert asyncio.run(env.step(f"click({other['box'][0] + 1}, {other['box'][1] + 1})")).reward == 0
        r = asyncio.run(env.step(f"click({target['box'][2] - 1}, {target['box'][3] - 1})"))
        rewards.append(r.reward)
    assert rewards == [0.5, 0.5] and r.done
    assert instruction == "Click " + ", then ".join(s["goals"][0]["click"] for s in task["screens"]) + "."


@pytest.mark.parametrize("task, why", [(None, "metadata 'gui' must be"),
                                       ({"screens": [{"widgets": [{"kind": "slider", "box": [0, 0, 1, 1]}]}]},
                                        "screen 0: a widget is"),
                                       ({"screens": [{"goals": [{"drag": "x"}]}]}, "screen 0: a goal is")])
def test_a_task_that_cannot_be_drawn_names_its_prompt(task, why):
    with pytest.raises(gui.GuiError, match=f"prompt 'p1': {why}"):
        asyncio.run(gui.GuiEnv().reset(_prompt(task)))


def test_the_gui_demo_ships_its_weights_and_its_example_runs_two_turn_episodes_on_screenshots(tmp_path, capsys):
    """``examples/gui_agent.yaml``, shortened: the shipped warm start acts on both screens, engine = trainer."""
    import gzip
    import json
    from pathlib import Path

    import relayrl
    from relayrl.data.datasets import load_prompts
    from relayrl.demo import gui_model

    assert gui_model.gui_demo_model_path() == gui_model.SHIPPED  # (its recipe is the shipped one's: nothing built)
    rows = load_prompts("builtin:gui-eval")
    assert len(rows) == 200 and all(p.messages[0]["content"].startswith("Click ") and p.metadata["gui"] for p in rows)
    example = Path(__file__).resolve().parent.parent / "examples" / "gui_agent.yaml"
    run = relayrl.Run(str(example), ["run.steps=2", "eval.size=8", f"run.output_dir={tmp_path}", "run.progress=false",
                                     "rollout.prompts_per_step=4", "rollout.group_size=4"])
    summary = run.train()
    assert summary["steps"] == 2 and 0 <= summary["eval_accuracy_before"] <= 1
    metrics = [json.loads(x) for x in (run.dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["logprob_mismatch_max"] < 1e-5 for r in metrics)
    records = [json.loads(x) for f in run.dir.glob("rollouts/*.jsonl.gz") for x in gzip.open(f, "rt")]
    assert any(r["info"]["turns"] == 2 and r["reward"] > 0 for r in records)  # (a screen done, the next one shown)
    assert any(r["turns"][0]["assistant"].startswith("click(") for r in records if r["turns"])
    said = capsys.readouterr()
    assert "win rate" not in said.out + said.err and "tool-call rate" not in said.out + said.err  # (no tools here)
    assert "accuracy" in said.out + said.err
