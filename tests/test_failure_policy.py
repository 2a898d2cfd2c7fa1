"""User code that fails is never training data (relayrl.failures): a failed verifier or environment
leaves its episode out, counted; too many stop the run with one line; environments have deadlines;
a template that cannot extend a conversation stops the run. Plus the smaller findings of the same
review: no phantom step on a budget overflow, every EOS id ends a turn, fewer rows than updates."""

import asyncio
import json
import math
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from relayrl import failures
from relayrl.config import AlgoCfg, TrainerCfg, load_config
from relayrl.envs.base import Env, StepResult, ToolEnv
from relayrl.envs.chat import TemplateMismatch, render_ids
from relayrl.rollout.runner import EpisodeLimits, EpisodeRunner
from relayrl.failures import UserCodeError
from relayrl.records import FinishReason, Group, SamplingParams, Trajectory
from relayrl.rollout.groups import drop_failed, training_batch
from relayrl.train.trainer import Trainer, build_batch
from tests.test_episodes import PROMPT, ScriptedEngine, add, calc_reply, make_runner, run, tok  # noqa: F401
from tests.test_chat_template import chatml_tokenizer  # noqa: F401 - a fixture

ROOT = Path(__file__).parent.parent


def _traj(kind=None, source="reward.fn=broken.py:score", error="ZeroDivisionError: division by zero", reward=1.0):
    t = Trajectory(PROMPT, "g", 0, [1], [2], [-0.1], [0], FinishReason.STOP, reward=reward)
    if kind:
        failures.fail(t, kind, source, error)
    return t


# ---------------------------------------------------------------- the policy itself


def test_more_failures_than_the_threshold_stop_with_one_line_naming_the_code():
    trajs = [_traj("reward") for _ in range(5)] + [_traj() for _ in range(3)]
    with pytest.raises(UserCodeError) as e:
        failures.check(trajs, 0.5, "step 1")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("step 1: reward.fn=broken.py:score raised in 5 of 8 episodes")
    assert "ZeroDivisionError: division by zero" in msg and "run.max_failure_frac=1" in msg
    # at the threshold (4 of 8 = 0.5): counted, the run goes on; engine failures are not user code
    counts = failures.check([_traj("reward")] * 4 + [_traj()] * 4, 0.5, "step 1")
    assert counts == {"reward": 4}
    eng = _traj()
    eng.finish_reason = FinishReason.FAILED
    assert failures.check([eng] * 8, 0.5, "step 1") == {"engine": 8}
    assert failures.check(trajs, 1.0, "step 1") == {"reward": 5}  # 1: never stops


def test_a_failed_episode_is_left_out_and_its_group_baseline_is_over_the_rest():
    p = PROMPT
    ok = [Trajectory(p, "a", i, [1], [2], [0.0], [0], FinishReason.STOP, reward=r) for i, r in enumerate([1.0, 0.0, 1.0])]
    bad = Trajectory(p, "a", 3, [1], [2], [0.0], [0], FinishReason.STOP, reward=math.nan)
    failures.fail(bad, "reward_timeout", "reward.fn=slow:score", "timed out after 5s")
    kept, dropped = drop_failed([Group(p, "a", ok + [bad])])
    assert dropped == 1 and kept[0].trajectories == ok
    from relayrl.algos import ESTIMATORS
    from relayrl.algos.estimators import Knobs
    from relayrl.config import AlgoCfg

    batch, _ = training_batch(kept, AlgoCfg(), 16, pad_id=0)  # what the loop builds; GRPO runs at training time
    adv, _, _ = ESTIMATORS["grpo"](batch.rewards, batch.loss_mask, batch.group, None, Knobs())
    adv = adv.sum(1)  # one response token each
    # GRPO over the 3 survivors (rewards 1, 0, 1): mean 2/3, unbiased std 0.57735
    assert torch.allclose(adv, torch.tensor([0.57735, -1.1547, 0.57735]), atol=1e-4)
    assert math.isfinite(adv.sum().item())  # the failed one's nan never reaches the estimator


@pytest.mark.parametrize("name,want", [
    # group a: one survivor of two (reward 1); group b: rewards 0, 1. The survivor has no baseline: A = 0, not
    # the single-sample rule's A = R = 1 (GRPO gave [1.0, -0.71, 0.71])
    ("grpo", [0.0, -0.5 / math.sqrt(0.5), 0.5 / math.sqrt(0.5)]),
    ("dr_grpo", [0.0, -0.5, 0.5]),
    ("rloo", [0.0, -1.0, 1.0]),
    # group b's [-0.5, 0.5] whitened over its 2 tokens (the survivor takes no part): mean 0, Bessel var 0.5
    ("reinforce_pp_baseline", [0.0, -0.5 / math.sqrt(0.5), 0.5 / math.sqrt(0.5)]),
])
def test_a_group_left_with_one_episode_gets_advantage_0(name, want):
    from relayrl.algos import ESTIMATORS
    from relayrl.algos.estimators import Knobs

    p = PROMPT
    a = [Trajectory(p, "a", i, [1], [2], [0.0], [0], FinishReason.STOP, reward=1.0) for i in range(2)]
    failures.fail(a[1], "reward", "reward.fn=x:y", "ValueError: bad")
    b = [Trajectory(p, "b", i, [1], [2], [0.0], [0], FinishReason.STOP, reward=r) for i, r in enumerate([0.0, 1.0])]
    kept, dropped = drop_failed([Group(p, "a", a), Group(p, "b", b)])
    assert dropped == 1 and [len(g.trajectories) for g in kept] == [1, 2]
    batch, _ = training_batch(kept, AlgoCfg(), 16, pad_id=0)
    adv, _, _ = ESTIMATORS[name](batch.rewards, batch.loss_mask, batch.group, None, Knobs(group_size=2))
    assert torch.allclose(adv.sum(1), torch.tensor(want), atol=1e-5), adv.sum(1)


@pytest.mark.parametrize("name,want", [
    ("grpo", [1.0, 0.0, 0.5]), ("dr_grpo", [1.0, 0.0, 0.5]), ("rloo", [1.0, 0.0, 0.5]),
    # R = [1, 0, 0.5] whitened: mean 0.5, Bessel var 0.25
    ("reinforce_pp_baseline", [1.0, -1.0, 0.0]),
])
def test_groups_of_one_by_choice_keep_the_single_sample_rule(name, want):
    """rollout.group_size=1: every group is one response by design, A = R (mean 0, std 1), as before."""
    from relayrl.algos import ESTIMATORS
    from relayrl.algos.estimators import Knobs

    groups = [Group(PROMPT, f"g{i}", [Trajectory(PROMPT, f"g{i}", 0, [1], [2], [0.0], [0], FinishReason.STOP,
                                                 reward=r)]) for i, r in enumerate([1.0, 0.0, 0.5])]
    batch, _ = training_batch(groups, AlgoCfg(), 16, pad_id=0)
    adv, _, _ = ESTIMATORS[name](batch.rewards, batch.loss_mask, batch.group, None, Knobs(group_size=1))
    assert torch.allclose(adv.sum(1), torch.tensor(want), atol=1e-4), adv.sum(1)


def test_the_trainer_gets_the_configured_group_size(tiny):
    from relayrl.run.build import make_trainer

    model, _ = tiny
    for g, adv in ((1, "reinforce_pp"), (4, "grpo")):  # (group_size=1 with a group baseline is refused at load)
        cfg = load_config(None, [f"rollout.group_size={g}", f"algo.advantage={adv}", "rollout.prompts_per_step=4",
                                 "rollout.budget=fixed"])
        assert make_trainer(cfg, model).est_knobs.group_size == g


def test_a_verifier_failure_fails_the_single_turn_episode(tok):
    failure = {"kind": "reward", "source": "reward.fn=x:y", "error": "ValueError: bad"}
    runner = EpisodeRunner(ScriptedEngine(tok, lambda c: "42"), tok, None, None,
                           score_batch=lambda items: [(math.nan, failure)] * len(items))
    try:
        t = Trajectory(PROMPT, "g", 0, render_ids(tok, PROMPT.messages, add_generation_prompt=True))
        runner.run(runner.episode(t, SamplingParams(16, 1.0)))
        assert t.failure == failure and failures.failed(t) and runner.error_count == 1 and t.complete
    finally:
        runner.close()


def test_cli_error_kind_and_status_for_user_code():
    from relayrl.cli import classify

    assert classify(UserCodeError("x")) == ("user code", 1)


# ---------------------------------------------------------------- environments: deadlines, close


class Hangs(Env):
    """Its step never answers (an awaited service that hangs); close is recorded."""
    closed = []

    async def step(self, text):
        await asyncio.sleep(3600)

    async def close(self):
        Hangs.closed.append(True)


def test_a_step_that_hangs_fails_at_its_deadline_and_the_environment_is_closed(tok):
    Hangs.closed.clear()
    runner = make_runner(tok, calc_reply, Hangs, limits=EpisodeLimits(4, 4000, step_timeout_s=0.3))
    try:
        t0 = time.monotonic()
        t = run(runner, Trajectory(PROMPT, "g", 0, []))
        assert time.monotonic() - t0 < 5
        assert t.failure["kind"] == "env_timeout" and t.failure["source"].startswith("Hangs.step")
        assert "env.step_timeout_s=0.3" in t.failure["error"] and Hangs.closed == [True]
        # the runner goes on: the next episode (a working environment) runs to its end
        runner.make_env = lambda: ToolEnv([add])
        assert run(runner, Trajectory(PROMPT, "g", 1, [])).reward == 1.0
        pending = runner.submit(_other_tasks()).result(5)
        assert pending == 0  # nothing of the hung call is left running on the loop
    finally:
        runner.close()


async def _other_tasks() -> int:
    return len([t for t in asyncio.all_tasks() if t is not asyncio.current_task()])


def test_the_episode_deadline_bounds_all_environment_calls_together(tok):
    class Slow(ToolEnv):
        async def step(self, text):
            await asyncio.sleep(0.2)
            return await super().step(text)

    always = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>'
    runner = make_runner(tok, lambda c: always, lambda: Slow([add]),
                         limits=EpisodeLimits(10, 100_000, step_timeout_s=5, episode_timeout_s=0.5))
    try:
        t = run(runner, Trajectory(PROMPT, "g", 0, []))
        assert t.failure["kind"] == "env_timeout" and "env.episode_timeout_s=0.5" in t.failure["error"]
    finally:
        runner.close()


def test_reset_errors_and_non_finite_rewards_fail_the_episode(tok):
    class BadReset(Env):
        async def reset(self, prompt):
            raise RuntimeError("no such task")

    class NanReward(Env):
        async def step(self, text):
            return StepResult(reward=float("nan"), done=True)

    runner = make_runner(tok, calc_reply, BadReset)
    try:
        t = run(runner, Trajectory(PROMPT, "g", 0, []))
        assert t.failure["source"].startswith("BadReset.reset") and "RuntimeError: no such task" in t.failure["error"]
        runner.make_env = NanReward
        t = run(runner, Trajectory(PROMPT, "g", 1, []))
        assert t.failure["kind"] == "env" and "non-finite reward" in t.failure["error"]
    finally:
        runner.close()


class Blocks(Env):
    """A blocking call inside ``async def step``: the loop itself stops (no deadline can fire)."""

    async def step(self, text):
        while True:
            time.sleep(0.05)  # a poll loop with a blocking sleep


def test_an_environment_blocking_the_loop_stops_the_run_naming_the_line(tok, monkeypatch):
    monkeypatch.setattr(EpisodeRunner, "BLOCKED_GRACE_S", 1.0)
    runner = make_runner(tok, calc_reply, Blocks, limits=EpisodeLimits(4, 4000, step_timeout_s=0.5))
    try:
        t0 = time.monotonic()
        with pytest.raises(UserCodeError, match=r"blocked for \d+ s at .*test_failure_policy.py:\d+ in step"):
            run(runner, Trajectory(PROMPT, "g", 0, []))
        assert time.monotonic() - t0 < 10
        runner._thread.join(timeout=5)
        assert not runner._thread.is_alive()  # the stuck loop thread was stopped, not left behind
    finally:
        runner.close()


BLOCKING_ENV = """import time

from relayrl.envs.base import Env


class Blocks(Env):
    async def step(self, text):
        while True:
            time.sleep(0.05)
"""


def test_a_blocking_environment_in_a_folder_named_relayrl_is_still_named(tok, monkeypatch, tmp_path):
    """relayrl's own frames are those of the installed package: a user's code under a folder named
    relayrl (where `git clone` puts the repository) is named all the same."""
    import importlib.util

    path = tmp_path / "relayrl" / "envs" / "my_env.py"
    path.parent.mkdir(parents=True)
    path.write_text(BLOCKING_ENV)
    spec = importlib.util.spec_from_file_location("my_env_in_a_relayrl_folder", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(EpisodeRunner, "BLOCKED_GRACE_S", 1.0)
    runner = make_runner(tok, calc_reply, module.Blocks, limits=EpisodeLimits(4, 4000, step_timeout_s=0.5))
    try:
        with pytest.raises(UserCodeError, match=rf"blocked for \d+ s at {re.escape(str(path))}:9 in step"):
            run(runner, Trajectory(PROMPT, "g", 0, []))
        runner._thread.join(timeout=5)
    finally:
        runner.close()


def test_a_template_that_cannot_extend_the_conversation_stops_the_run(tok, monkeypatch):
    def mismatch(*a, **k):
        raise TemplateMismatch("the chat template renders the conversation so far differently")

    monkeypatch.setattr("relayrl.rollout.episode.next_turn_suffix", mismatch)
    runner = make_runner(tok, calc_reply, lambda: ToolEnv([add]))
    try:
        with pytest.raises(UserCodeError, match="cannot extend a conversation token-in-token-out.*model.tokenizer"):
            run(runner, Trajectory(PROMPT, "g", 0, []))
    finally:
        runner.close()


# ---------------------------------------------------------------- smaller findings


def test_a_budget_overflow_after_a_tool_call_adds_no_phantom_step(tok):
    """The tool result does not fit env.max_tokens: the episode ends after its one generated turn,
    with one step (its reward the verifier's), not two."""
    first = len(tok(calc_reply(""), add_special_tokens=False)["input_ids"]) + 1
    runner = make_runner(tok, calc_reply, lambda: ToolEnv([add]), limits=EpisodeLimits(4, first + 1))
    try:
        t = run(runner, Trajectory(PROMPT, "g", 0, []))
    finally:
        runner.close()
    assert t.finish_reason == FinishReason.LENGTH and set(t.turns) == {0} and len(t.response_ids) == first
    assert t.info["turns"] == 1 and len(t.info["step_rewards"]) == 1 and len(t.info["anchors"]) == 1


class EndsWithAnotherEos(ScriptedEngine):
    """Stops each turn on a second EOS id of the generation config (Qwen2.5's <|endoftext|>)."""

    def __init__(self, tok, reply, other):
        super().__init__(tok, reply)
        self.other = other

    def submit(self, requests):
        super().submit(requests)
        with self.lock:
            for r in requests:
                todo = self.live[r.request_id]["todo"]
                if todo and todo[-1] == self.tok.eos_token_id:
                    todo[-1] = self.other


def test_every_eos_id_ends_a_turn_and_the_template_end_of_turn_follows_it(tok):
    other = tok.convert_tokens_to_ids("<|end|>")
    seen = []

    class Record(ToolEnv):
        async def step(self, text):
            seen.append(text)
            return await super().step(text)

    runner = EpisodeRunner(EndsWithAnotherEos(tok, calc_reply, other), tok, lambda: Record([add]),
                           EpisodeLimits(4, 4000), lambda text, p: (1.0, None), eos_ids=[tok.eos_token_id, other])
    try:
        t = run(runner, Trajectory(PROMPT, "g", 0, []))
    finally:
        runner.close()
    assert t.failure is None and seen[0] == calc_reply("")  # the engine's EOS is not text for the environment
    end = t.mask.index(0)  # the first template token: the end of turn the template puts there, then the rest
    assert t.response_ids[end - 1] == other and t.response_ids[end] == tok.eos_token_id


def test_fewer_rows_than_updates_per_step_train_without_an_empty_mini_batch(tiny):
    model, tok = tiny
    prompt_ids = render_ids(tok, PROMPT.messages, add_generation_prompt=True)
    trajs = [Trajectory(PROMPT, "g", i, prompt_ids, [5, 6, 7], [-1.0] * 3, [0] * 3, FinishReason.STOP) for i in range(2)]
    tr = Trainer(model, TrainerCfg(lr=1e-2, warmup_steps=0, updates_per_step=4), AlgoCfg(), 1.0, 10, 16)
    batch = build_batch(trajs, torch.tensor([1.0, -1.0]), tok.pad_token_id)
    before = [p.detach().clone() for p in model.parameters()]
    m = tr.step(batch)
    assert math.isfinite(m["loss"]) and any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


# ---------------------------------------------------------------- end to end


EASY = ["rollout.budget=fixed", "rollout.dynamic_sampling=false",  # (counts: 16 of 16 episodes)
        "data.eval_path=null", "rollout.max_new_tokens=8", "rollout.prompts_per_step=4", "rollout.group_size=4",
        "trainer.warmup_steps=0", "run.progress=false", "run.save_every=0"]

APPENDS = ("def score(completion, answer, metadata):\n"
           "    with open('calls.txt', 'a') as f:\n"
           "        f.write(repr(completion) + '\\n')\n"
           "    return float(any(c.isdigit() for c in completion))\n")


class AddEnv(ToolEnv):
    """A user's own tool environment; its final answers are scored by reward.fn."""

    def __init__(self):
        super().__init__([add])


@pytest.mark.slow
@pytest.mark.parametrize("env", [None, "tests.test_failure_policy:AddEnv"])
def test_a_verifier_that_appends_to_a_file_in_the_working_directory_trains_normally(tiny_path, tmp_path,
                                                                                   monkeypatch, env):
    """As root the verifier's workers run as another uid (the fork-bomb guard); the working directory
    is root's, and writing there must work as it does for the user's own code."""
    work = tmp_path / "work"
    work.mkdir(mode=0o755)
    (work / "appends.py").write_text(APPENDS)
    monkeypatch.chdir(work)
    monkeypatch.syspath_prepend(str(ROOT))
    from relayrl.run.loop import train

    extra = [f"env.name={env}", "env.max_tokens=64"] if env else []
    cfg = load_config(None, EASY + extra + [f"model.path={tiny_path}", f"run.output_dir={tmp_path}/runs",
                                            "run.steps=2", "reward.fn=appends.py:score"])
    summary = train(cfg)
    calls = (work / "calls.txt").read_text().splitlines()
    assert summary["steps"] == 2 and summary["episodes_left_out"] == {} and summary["reward_failures"] == 0
    assert len(calls) >= 2 * 16  # every reward call counted in the file (more: generated past the last step)
    metrics = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(m["failures/reward"] == 0 for m in metrics)


@pytest.mark.slow
@pytest.mark.parametrize("with_eval", [False, True])
def test_a_verifier_that_always_raises_stops_the_run_in_its_first_step(tiny_path, tmp_path, with_eval):
    (tmp_path / "broken.py").write_text("def score(completion, answer, metadata):\n    return 1 / 0\n")
    args = [a for a in EASY if not (with_eval and a.startswith("data.eval_path"))]
    args += ["eval.size=8"] if with_eval else []
    cmd = [sys.executable, "-m", "relayrl.cli", "train", *args, f"model.path={tiny_path}", "run.output_dir=runs",
           "run.steps=3", "reward.fn=broken.py:score"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = [x for x in proc.stderr.splitlines() if x.startswith("relayrl:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    where, of = ("the evaluation before training (sampled)", "8 of 8") if with_eval else ("step 1", "16 of 16")
    assert lines[0].startswith(f"relayrl: user code error: {where}: reward.fn=broken.py:score raised in {of} episodes")
    assert "ZeroDivisionError: division by zero" in lines[0] and "run.max_failure_frac" in lines[0]
    assert not any(tmp_path.glob("runs/*/checkpoints/*"))  # nothing of the failed step was saved


class SometimesHangs(ToolEnv):
    """Every third episode's environment never answers (a task server that hangs): in reset, which
    every episode calls (the tiny random model seldom ends a turn, so few episodes reach a step; a
    hanging step is the unit test's ``Hangs``)."""
    made = 0

    def __init__(self):
        super().__init__([add])
        SometimesHangs.made += 1
        self.hang = SometimesHangs.made % 3 == 0

    async def reset(self, prompt):
        if self.hang:
            await asyncio.Event().wait()
        return await super().reset(prompt)


@pytest.mark.slow
def test_a_run_whose_environment_sometimes_hangs_goes_on_without_those_episodes(tiny_path, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    from relayrl.run.loop import train

    threads_before = {t.name for t in threading.enumerate()}
    cfg = load_config(None, EASY + [f"model.path={tiny_path}", f"run.output_dir={tmp_path}", "run.steps=2",
                                    "reward.fn=tests.rewards_for_tests:digit_fraction",
                                    "env.name=tests.test_failure_policy:SometimesHangs", "env.max_tokens=64",
                                    "env.step_timeout_s=0.5"])
    summary = train(cfg)
    assert summary["steps"] == 2 and summary["episodes_left_out"].get("env_timeout", 0) >= 2
    metrics = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sum(m["failures/env_timeout"] for m in metrics) >= 2
    time.sleep(0.5)
    left = {t.name for t in threading.enumerate()} - threads_before
    assert not [n for n in left if n.startswith(("relayrl-episodes", "relayrl-verify"))], left


def test_a_tool_that_raises_is_an_observation_but_a_step_where_every_call_raised_stops(tok):
    def broken_add(a: int, b: int) -> int:
        """Add two integers (but the file it needs is not writable).

        Args:
            a: The first.
            b: The second.
        """
        raise PermissionError("[Errno 13] Permission denied: 'cache.db'")

    broken_add.__name__ = "add"
    runner = make_runner(tok, calc_reply, lambda: ToolEnv([broken_add]))
    try:
        trajs = [run(runner, Trajectory(PROMPT, "g", i, [])) for i in range(8)]
    finally:
        runner.close()
    t = trajs[0]
    assert t.failure is None and t.info["tool_calls"] == 1 and t.info["tool_raised"] == 1 and t.info["tool_errors"] == 1
    assert "PermissionError" in t.info["tool_raised_example"]
    with pytest.raises(UserCodeError, match=r"step 2: every one of the 8 tool calls raised inside the tool, e\.g\. "
                                            r"tool add: PermissionError"):
        failures.check_tools(trajs, 0.5, "step 2")
    failures.check_tools(trajs, 1.0, "step 2")  # 1: goes on
    failures.check_tools(trajs[:7], 0.5, "step 2")  # too few calls to tell


def test_arguments_a_tool_does_not_take_are_the_models_mistake_not_the_tools():
    env = ToolEnv([add])
    out = asyncio.run(env.step('<tool_call>{"name": "add", "arguments": {"a": 1, "c": 2}}</tool_call>'))
    assert out.info["tool_errors"] == 1 and out.info["tool_raised"] == 0 and out.raised == []
    assert out.messages[0]["content"].startswith("error: add: ")  # what binding the arguments said


def test_a_shutdown_coroutine_the_loop_never_ran_is_not_left_unawaited(tok):
    """close() makes its coroutines on the loop (``_on_loop``): a loop that stops first drops a callback, not a
    coroutine that warns 'was never awaited' when the loop is collected."""
    import gc
    import warnings

    runner = make_runner(tok, calc_reply, None)
    runner.loop.call_soon_threadsafe(runner.loop.stop)
    runner._thread.join(timeout=5)

    async def cleanup():
        pass

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        runner._on_loop(cleanup)  # (the loop is stopped: never run)
        runner.loop.close()
        gc.collect()
        runner.close()
    assert not [w for w in seen if "never awaited" in str(w.message)], [str(w.message) for w in seen]
    with warnings.catch_warnings(record=True) as seen:  # what submit(coroutine) leaves, the way close() did
        warnings.simplefilter("always")
        loop = asyncio.new_event_loop()
        asyncio.run_coroutine_threadsafe(cleanup(), loop)
        loop.close()
        gc.collect()
    assert [w for w in seen if "never awaited" in str(w.message)]
