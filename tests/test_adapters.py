"""Environments from the ecosystem, with the real packages: reasoning-gym tasks as data scored by their
own scorers, TextArena games as seeded environments, skyrl-gym environments; each one line of config."""

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from relayrl.data.datasets import DataError, load_prompts
from relayrl.config import EnvCfg
from relayrl.envs.base import make_env_factory
from relayrl.run.build import env_factory
from relayrl.rollout.runner import EpisodeLimits, EpisodeRunner
from relayrl.records import Prompt, SamplingParams, Trajectory
from relayrl.rewards.verifiers import RewardRunner
from tests.test_chat_template import chatml_tokenizer  # noqa: F401 - a fixture
from tests.test_episodes import ScriptedEngine

ROOT = Path(__file__).resolve().parent.parent


def test_reasoning_gym_tasks_are_rows_scored_by_their_own_scorer():
    prompts = load_prompts("reasoning_gym:basic_arithmetic?size=6&seed=3")
    again = load_prompts("reasoning_gym:basic_arithmetic?size=6&seed=3")
    other = load_prompts("reasoning_gym:basic_arithmetic?size=6&seed=4")
    assert len(prompts) == 6 and prompts == again and prompts != other  # seeded
    import reasoning_gym

    truth = reasoning_gym.create_dataset("basic_arithmetic", size=6, seed=3)
    assert [p.messages[-1]["content"] for p in prompts] == [e["question"] for e in truth]
    runner = RewardRunner("reasoning_gym", workers=1)
    try:
        p, q = prompts[0], prompts[1]
        got = runner.score([(f"I think... <answer>{p.answer}</answer>", p.answer, p.metadata),
                            ("<answer>not a number</answer>", p.answer, p.metadata),
                            (f"so \\boxed{{{q.answer}}}", q.answer, q.metadata)])
    finally:
        runner.close()
    assert [r for r, _ in got] == [1.0, 0.0, 1.0] and all(f is None for _, f in got)
    # the task's config travels in the path; bad names fail naming the path
    easy = load_prompts("reasoning_gym:basic_arithmetic?size=3&seed=1&min_terms=2&max_terms=2")
    assert [p.messages[-1]["content"] for p in easy] == [
        e["question"] for e in reasoning_gym.create_dataset("basic_arithmetic", size=3, seed=1, min_terms=2, max_terms=2)]
    assert json.loads(easy[0].metadata["reasoning_gym"]["config"]) == {"min_terms": 2, "max_terms": 2}
    with pytest.raises(DataError, match="reasoning_gym cannot make 'no_such_task'"):
        load_prompts("reasoning_gym:no_such_task")


def guess(context: str) -> str:
    """A policy that plays GuessTheNumber by bisection, from the game's hints in its context."""
    lo, hi = 1, 20
    for g, hint in zip(re.findall(r"assistant\n\[(\d+)\]", context), re.findall(r"number is (higher|lower)", context)):
        lo, hi = (int(g) + 1, hi) if hint == "higher" else (lo, int(g) - 1)
    return f"[{(lo + hi) // 2}]"


def _run(runner, trajs):
    async def all_():
        await asyncio.gather(*(runner.episode(t, SamplingParams(200, 1.0)) for t in trajs))

    runner.run(all_())
    return trajs


def test_a_textarena_game_is_an_environment_seeded_per_row(chatml_tokenizer):
    tok = chatml_tokenizer
    prompts = load_prompts("textarena:GuessTheNumber-v0?size=3&seed=0")
    assert [p.metadata["seed"] for p in prompts] == [0, 1, 2] and "Guess The Number" in prompts[0].messages[0]["content"]
    make = make_env_factory("textarena:GuessTheNumber-v0", {})
    runner = EpisodeRunner(ScriptedEngine(tok, guess), tok, make, EpisodeLimits(10, 4000, env_name="textarena"),
                           lambda text, prompt: (0.0, None))
    try:
        trajs = _run(runner, [Trajectory(p, "g", i, []) for i, p in enumerate(prompts * 2)])
    finally:
        runner.close()
    for t in trajs:
        assert t.failure is None and t.reward == 1.0 and t.info["game_won"] == 1 and 1 <= t.info["turns"] <= 5
    text = [tok.decode(t.response_ids) for t in trajs]
    assert text[:3] == text[3:]  # the same row is the same game, with games running at once
    assert len(set(text[:3])) > 1  # and other rows are other games
    assert "target number is" in tok.decode(trajs[0].response_ids)  # the game's hints came back as user turns


def test_a_skyrl_gym_environment_runs_multi_turn(chatml_tokenizer):
    tok = chatml_tokenizer
    make = make_env_factory("skyrl:gsm8k_multi_turn", {"extras": {"max_turns": 3}})
    reply = lambda c: "It is #### 5" if "Please provide" in c else "It is #### 4"  # noqa: E731
    runner = EpisodeRunner(ScriptedEngine(tok, reply), tok, make, EpisodeLimits(4, 4000, env_name="skyrl"),
                           lambda text, prompt: (0.0, None))
    prompt = Prompt("q", [{"role": "user", "content": "What is 2+3?"}], answer="5")
    try:
        (t,) = _run(runner, [Trajectory(prompt, "g", 0, [])])
    finally:
        runner.close()
    assert t.failure is None and t.info["turns"] == 2 and t.info["step_rewards"][-1] == 1.0
    assert t.reward == pytest.approx(1.0 + 0.2 / 3)  # skyrl's per-turn rewards: a well-formatted miss, then right


@pytest.mark.parametrize("module,extra,what", [
    ("textarena", "textarena", lambda: make_env_factory("textarena:GuessTheNumber-v0", {})),
    ("textarena", "textarena", lambda: load_prompts("textarena:GuessTheNumber-v0?size=2")),
    ("skyrl_gym", "skyrl", lambda: make_env_factory("skyrl:gsm8k", {})),
    ("reasoning_gym", "reasoning-gym", lambda: load_prompts("reasoning_gym:leg_counting?size=2")),
    ("reasoning_gym", "reasoning-gym", lambda: RewardRunner("reasoning_gym", workers=1)),
    ("openai", "serve", lambda: env_factory(EnvCfg(name=f"agent:{ROOT / 'examples' / 'openai_agent.py'}:run"))),
    ("fastapi", "serve", lambda: env_factory(EnvCfg(name=f"agent:{ROOT / 'examples' / 'openai_agent.py'}:run"))),
])
def test_a_missing_package_stops_the_run_at_start_naming_its_extra(monkeypatch, module, extra, what):
    monkeypatch.setitem(sys.modules, module, None)  # (importing it raises ImportError)
    with pytest.raises(ValueError, match=re.escape(f"pip install 'relayrl[{extra}]'")):
        what()


def test_unknown_games_and_environments_fail_at_start():
    with pytest.raises(ValueError, match="not a TextArena game"):
        make_env_factory("textarena:NoSuchGame-v0", {})
    with pytest.raises(ValueError, match="not a skyrl-gym environment"):
        make_env_factory("skyrl:no_such_env", {})


@pytest.mark.slow
def test_a_reasoning_gym_task_and_a_textarena_game_train_from_one_line(tmp_path, tiny_path):
    """`relayrl train` with the one-line configs the README gives: a few steps each, on a tiny model
    (its context made long enough for TextArena's rules: 482 tokens of the demo tokenizer)."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_path, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))
    base = [f"model.path={model}", f"run.output_dir={tmp_path}", "run.steps=2", "run.progress=false",
            "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=12", "run.threads=1"]
    runs = {
        "rg": ["data.path=reasoning_gym:basic_arithmetic?size=50&seed=1", "reward.fn=reasoning_gym",
               "data.eval_path=reasoning_gym:basic_arithmetic?size=8&seed=2", "eval.size=8"],
        "ta": ["data.path=textarena:GuessTheNumber-v0?size=20&seed=0", "env.name=textarena:GuessTheNumber-v0",
               "env.max_turns=3", "env.max_tokens=120", "data.eval_path=null"],
    }
    for name, args in runs.items():
        out = subprocess.run([sys.executable, "-m", "relayrl.cli", "train", f"run.name={name}", *base, *args],
                             capture_output=True, text=True, timeout=600, cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-2000:]
        run = tmp_path / name
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2] and all(r["failures/reward"] + r["failures/env"] == 0 for r in rows)
        trained = [json.loads(x) for x in (run / "trained_prompts.jsonl").read_text().splitlines()]
        prefix = "basic_arithmetic-1-" if name == "rg" else "GuessTheNumber-v0-"
        assert all(i.startswith(prefix) for t in trained for i in t["prompt_ids"])
        if name == "ta":
            assert all(r["turns_mean"] >= 1 for r in rows)
        else:
            assert json.loads((run / "summary.json").read_text())["eval_accuracy_after"] is not None
