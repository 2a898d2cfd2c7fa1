"""The episode core: token-in-token-out turns with tools, deadlines, limits, continuation across
an abort, failures that stay inside one episode, the gymnasium adapter, loading environments."""

import asyncio
import contextlib
import threading
import os
import time

import pytest

from relayrl.engine.base import Engine
from relayrl.envs.base import Env, StepResult, ToolEnv, load_env_class, make_env_factory
from relayrl.envs.chat import render_ids
from relayrl.envs.gym import GymTextEnv
from relayrl.rollout.runner import EpisodeLimits, EpisodeRunner
from relayrl.failures import failed
from relayrl.records import Completion, FinishReason, Prompt, SamplingParams, Trajectory
from relayrl.rewards.verifiers import last_boxed
from tests.test_chat_template import chatml_tokenizer  # noqa: F401 - a fixture


class ScriptedEngine(Engine):
    """Replies with ``reply(context_text)`` (text of the assistant turn), one token per ``get``,
    then the end-of-turn token. Each token carries the version loaded when it was emitted; an
    aborted request returns exactly the tokens emitted so far."""

    def __init__(self, tok, reply, delay: float = 0.001):
        self.tok, self.reply, self.delay = tok, reply, delay
        self._version, self.live, self.aborted = 0, {}, set()
        self.lock = threading.RLock()

    @property
    def version(self):
        return self._version

    def submit(self, requests):
        with self.lock:
            for r in requests:
                context = self.tok.decode(r.prompt_ids + r.response_so_far)
                ids = self.tok(self.reply(context), add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
                context_ids = r.prompt_ids + r.response_so_far
                done_before = len(context_ids) - _last_turn_start(self.tok, context_ids)  # of this turn
                self.live[r.request_id] = {"todo": ids[done_before:], "out": [], "vers": [],
                                           "left": r.params.max_new_tokens}

    def get(self, timeout=None):
        time.sleep(self.delay)
        out = []
        with self.lock:
            for rid in list(self.live):
                s = self.live[rid]
                if rid in self.aborted:
                    self.aborted.discard(rid)
                    del self.live[rid]
                    out.append(Completion(rid, s["out"], [-0.1] * len(s["out"]), s["vers"], FinishReason.ABORTED))
                    continue
                s["out"].append(s["todo"].pop(0))
                s["vers"].append(self._version)
                if not s["todo"] or len(s["out"]) == s["left"]:
                    del self.live[rid]
                    reason = FinishReason.STOP if not s["todo"] else FinishReason.LENGTH
                    out.append(Completion(rid, s["out"], [-0.1] * len(s["out"]), s["vers"], reason))
        return out

    def abort(self, ids):
        with self.lock:
            self.aborted |= set(ids) & set(self.live)

    @contextlib.contextmanager
    def pause(self):
        with self.lock:
            yield

    def load_weights(self, state_dict, version):
        with self.lock:
            self._version = version

    def num_pending(self):
        return len(self.live)


def _last_turn_start(tok, ids) -> int:
    """Index just after the last assistant header in ``ids`` (the current turn's first token)."""
    header = tok.convert_tokens_to_ids("<|im_start|>")
    starts = [i for i, x in enumerate(ids) if x == header]
    return starts[-1] + len(tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"])


@pytest.fixture()
def tok(chatml_tokenizer):
    return chatml_tokenizer


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def calc_reply(context: str) -> str:
    """A policy that calls ``add`` once, then answers with what the tool said."""
    if "<tool_response>" not in context:
        return '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    return "\\boxed{" + context.split("<tool_response>\n")[-1].split("\n")[0] + "}"


def _score(text, prompt):  # the pipeline's verifier runs in the worker pool; here, its answer check
    return float(last_boxed(text) == prompt.answer), False


def run(runner, t, params=SamplingParams(1000, 1.0)):
    runner.run(runner.episode(t, params))
    return t


def make_runner(tok, reply, env_factory, limits=EpisodeLimits(4, 4000), **kw):
    return EpisodeRunner(ScriptedEngine(tok, reply, **kw), tok, env_factory, limits, _score)


PROMPT = Prompt("p0", [{"role": "user", "content": "What is 2+3?"}], answer="5")


def test_a_tool_episode_is_the_template_rendering_with_the_engine_tokens_trained(tok):
    runner = make_runner(tok, calc_reply, lambda: ToolEnv([add]))
    try:
        t = run(runner, Trajectory(PROMPT, "g", 0, []))
    finally:
        runner.close()
    assert t.reward == 1.0 and t.finish_reason == FinishReason.STOP
    assert t.info["turns"] == 2 and t.info["tool_calls"] == 1 and t.info.get("tool_errors", 0) == 0
    conversation = PROMPT.messages + [
        {"role": "assistant", "content": calc_reply("")}, {"role": "tool", "content": "5"},
        {"role": "assistant", "content": "\\boxed{5}"}]
    full = render_ids(tok, conversation, add_generation_prompt=False)
    assert t.prompt_ids + t.response_ids == full[: len(t.prompt_ids) + len(t.response_ids)]
    assert len(full) - len(t.prompt_ids) - len(t.response_ids) == 1  # ChatML's "\n" after the last <|im_end|>
    trained = [x for x, m in zip(t.response_ids, t.mask) if m]
    turn1 = tok(calc_reply(""), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    turn2 = tok("\\boxed{5}", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert trained == turn1 + turn2  # exactly the engine's tokens; the tool result and headers are not
    assert t.turns == sorted(t.turns) and set(t.turns) == {0, 1}
    assert len(t.behav_logprobs) == len(t.versions) == len(t.mask) == len(t.turns) == len(t.response_ids)


async def slow_tool(seconds: float) -> str:
    """Sleep, then say so.

    Args:
        seconds: How long.
    """
    await asyncio.sleep(seconds)
    return "slept"


def broken_tool(x: int) -> int:
    """Always fails.

    Args:
        x: Anything.
    """
    raise RuntimeError("the tool broke")


def test_tool_timeouts_errors_and_bad_calls_go_back_to_the_model(tok):
    calls = ('<tool_call>{"name": "slow_tool", "arguments": {"seconds": 30}}</tool_call>'
             '<tool_call>{"name": "broken_tool", "arguments": {"x": 1}}</tool_call>'
             '<tool_call>{"name": "nope", "arguments": {}}</tool_call><tool_call>{bad json</tool_call>')
    seen = []

    def reply(context):
        if "<tool_response>" in context:
            seen.append(context)
            return "\\boxed{5}"
        return calls

    runner = make_runner(tok, reply, lambda: ToolEnv([slow_tool, broken_tool], timeout_s=0.5))
    try:
        start = time.monotonic()
        t = run(runner, Trajectory(PROMPT, "g", 0, []))
        took = time.monotonic() - start
    finally:
        runner.close()
    assert took < 5  # the 30 s call was cut at its 0.5 s deadline
    assert t.info["tool_calls"] == 4 and t.info["tool_timeouts"] == 1 and t.info["tool_errors"] == 3
    context = seen[0]
    assert "slow_tool timed out after 0.5 s" in context and "RuntimeError: the tool broke" in context
    assert "unknown tool 'nope'" in context and "invalid JSON" in context
    assert t.reward == 1.0  # the episode went on to its answer


def test_calls_of_one_turn_run_at_once(tok):
    spans = []

    def timed(seconds: float) -> str:
        """Sleep in a thread, recording when.

        Args:
            seconds: How long.
        """
        start = time.monotonic()
        time.sleep(seconds)
        spans.append((start, time.monotonic()))
        return "slept"

    two = '<tool_call>{"name": "timed", "arguments": {"seconds": 0.3}}</tool_call>' * 2
    runner = make_runner(tok, lambda c: "\\boxed{5}" if "<tool_response>" in c else two,
                         lambda: ToolEnv([timed], timeout_s=5))
    try:
        t = run(runner, Trajectory(PROMPT, "g", 0, []))
    finally:
        runner.close()
    assert t.info["tool_calls"] == 2 and len(spans) == 2
    (a0, a1), (b0, b1) = sorted(spans)
    assert b0 < a1  # the second started before the first ended


def test_an_episodes_time_in_its_environment_is_measured_and_on_the_timeline(tok):
    from relayrl.run.evaluation import env_share
    from relayrl.tracking.timeline import Timeline

    def timed(seconds: float) -> str:
        """Sleep in a thread.

        Args:
            seconds: How long.
        """
        time.sleep(seconds)
        return "slept"

    call = '<tool_call>{"name": "timed", "arguments": {"seconds": 0.3}}</tool_call>'
    runner = make_runner(tok, lambda c: "\\boxed{5}" if "<tool_response>" in c else call,
                         lambda: ToolEnv([timed], timeout_s=5))
    runner.timeline = tl = Timeline()
    try:
        t = run(runner, Trajectory(PROMPT, "g", 0, []))
    finally:
        runner.close()
    assert 0.3 <= t.info["env_s"] <= t.info["episode_s"]
    lane = [(s, e) for ln, s, e in tl.intervals if ln == "environment"]
    assert tl.busy_seconds("environment") >= 0.3 and all(0 <= s <= e <= tl.now() for s, e in lane)
    assert env_share([t.info, {"env_s": 1.0, "episode_s": 4.0}, {"turns": 1}]) == {
        "env_time_frac": (t.info["env_s"] + 1.0) / (t.info["episode_s"] + 4.0)}
    assert env_share([{"turns": 1}]) == {}  # (no environment: no share)


def long_output(n: int) -> str:
    """Words, many of them.

    Args:
        n: How many.
    """
    return " ".join(["word"] * n)


def test_env_context_elide_goes_on_in_a_new_branch_trained_as_sampled(tok):
    """env.context=elide: where the next observations do not fit, the earlier tool outputs become a marker and the
    episode goes on as a new branch; each branch is exactly what the engine sampled from (its prompt the rewritten
    history), trained with the episode's reward. With env.context=end the same episode ends at the limit."""
    from relayrl.envs.chat import elide
    from relayrl.rollout.groups import expand_branches
    from relayrl.run.evaluation import episode_stats
    from relayrl.records import Group

    call = '<tool_call>{"name": "long_output", "arguments": {"n": 20}}</tool_call>'
    reply = lambda c: call if c.count("<tool_response>") < 3 else "\\boxed{5}"  # noqa: E731
    outcomes = {}
    for context in ("end", "elide"):
        runner = make_runner(tok, reply, lambda: ToolEnv([long_output]),
                             EpisodeLimits(6, 300, context=context, max_context_tokens=650))
        try:
            outcomes[context] = run(runner, Trajectory(PROMPT, "g", 0, []), SamplingParams(80, 1.0))
        finally:
            runner.close()
    ended, t = outcomes["end"], outcomes["elide"]
    assert ended.finish_reason == FinishReason.LENGTH and ended.reward == 0.0 and "branch_tokens" not in ended.info
    assert t.reward == 1.0 and t.info["context_rewrites"] == len(t.info["branch_tokens"]) >= 1
    assert episode_stats([t, ended])["context_rewrites"] == t.info["context_rewrites"]
    assert "context_rewrites" not in episode_stats([ended])
    assert "characters of output elided]" in tok.decode(t.prompt_ids)
    g = Group(PROMPT, "g", [t])
    expand_branches(g)
    assert len(g.trajectories) == 1 + t.info["context_rewrites"]
    for b in g.trajectories:
        assert len(b.prompt_ids) + len(b.response_ids) <= 650 and b.reward == 1.0
        assert len(b.behav_logprobs) == len(b.versions) == len(b.mask) == len(b.response_ids)
        sampled = tok.decode([x for x, m in zip(b.response_ids, b.mask) if m])
        assert sampled.replace(call, "").replace("\\boxed{5}", "").replace(tok.eos_token, "") == ""
    assert [b.info.get("branch_of") for b in g.trajectories[1:]] == [0] * t.info["context_rewrites"]
    # by hand: every tool output is elided, once
    msgs = [{"role": "user", "content": "q"}, {"role": "tool", "content": "abc"}, {"role": "assistant", "content": "a"}]
    once = elide(msgs)
    assert once[1]["content"] == "[3 characters of output elided]" and once[0] == msgs[0] and msgs[1]["content"] == "abc"
    assert elide(once) is None


def test_max_turns_and_the_token_budget_end_an_episode(tok):
    always = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>'
    runner = make_runner(tok, lambda c: always, lambda: ToolEnv([add]), limits=EpisodeLimits(3, 10_000))
    try:
        t = run(runner, Trajectory(PROMPT, "g", 0, []))
        assert t.info["turns"] == 3 and t.info["turn_limit"] == 1 and t.info["tool_calls"] == 3 and t.reward == 0
        runner.limits = EpisodeLimits(10, 60)
        t = run(runner, Trajectory(PROMPT, "g", 1, []))
        assert len(t.response_ids) <= 60 and t.finish_reason == FinishReason.LENGTH and t.reward == 0
    finally:
        runner.close()


def test_a_turn_cut_by_an_abort_continues_from_its_tokens(tok):
    """A weight update cuts the first turn (the tool call) a few tokens in: the turn goes on from
    exactly those tokens under the new weights, and the episode ends as if it had not been cut."""
    runner = make_runner(tok, calc_reply, lambda: ToolEnv([add]), delay=0.01)  # the first turn: 69 tokens, ~0.7 s
    eng = runner.engine.engine
    try:
        t = Trajectory(PROMPT, "g", 0, [])
        fut = runner.submit(runner.episode(t, SamplingParams(1000, 1.0)))  # room for the whole turn
        t0, cut = time.monotonic(), 0
        while cut < 3 and time.monotonic() - t0 < 10:  # a few tokens of the first turn out
            time.sleep(0.002)
            with eng.lock:
                cut = max((len(s["out"]) for s in eng.live.values()), default=0)
        with eng.pause():  # as a publish does: cut and load in one pause, no token in between
            assert len(eng.live) == 1, "the first turn ended before it could be cut"
            cut = max(len(s["out"]) for s in eng.live.values())
            runner.abort_inflight()
            eng.load_weights({}, 1)
        fut.result(timeout=30)
    finally:
        runner.close()
    assert runner.continued == 1
    turn1 = tok(calc_reply(""), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    turn2 = tok("\\boxed{5}", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert 3 <= cut < len(turn1)  # cut inside the first turn
    # the tokens go on where the cut left them: the uncut conversation, the engine's turns trained
    full = render_ids(tok, PROMPT.messages + [{"role": "assistant", "content": calc_reply("")},
                                              {"role": "tool", "content": "5"},
                                              {"role": "assistant", "content": "\\boxed{5}"}], add_generation_prompt=False)
    assert t.prompt_ids + t.response_ids == full[: len(t.prompt_ids) + len(t.response_ids)]
    assert len(full) - len(t.prompt_ids) - len(t.response_ids) == 1
    assert [x for x, m in zip(t.response_ids, t.mask) if m] == turn1 + turn2  # mask 1 on every generated token
    assert t.mask[: len(turn1)] == [1] * len(turn1) and t.mask[-len(turn2):] == [1] * len(turn2)
    # the version changes at the cut: the tokens before it are version 0's, every one after it 1's
    assert t.versions == [0] * cut + [1] * (len(t.response_ids) - cut)
    # the reward is the verifier's for the whole episode: the cut tool call still ran, the answer is right
    assert t.info["tool_calls"] == 1 and t.info.get("tool_errors", 0) == 0
    assert t.text == "\\boxed{5}" and t.reward == 1.0 and t.finish_reason == FinishReason.STOP


def test_an_environment_that_raises_fails_only_its_episode(tok):
    class Broken(Env):
        async def step(self, text):
            raise KeyError("env bug")

    runner = make_runner(tok, calc_reply, Broken)
    try:
        t = run(runner, Trajectory(PROMPT, "g", 0, []))
        assert t.failure["kind"] == "env" and t.failure["source"].startswith("Broken.step")
        assert "KeyError: 'env bug'" in t.failure["error"] and failed(t)
        assert runner.error_count == 1
    finally:
        runner.close()


class GuessNumber:
    """A gymnasium-style text game: guess the hidden digit; told higher/lower."""

    def reset(self, seed=None):
        self.target = seed % 10
        return "Guess a digit.", {}

    def step(self, action):
        guess = int(action.strip()[-1]) if action.strip()[-1:].isdigit() else -1
        if guess == self.target:
            return "right", 1.0, True, False, {}
        return ("higher" if guess < self.target else "lower"), 0.0, False, False, {}


def test_the_gym_adapter_plays_a_text_game(tok):
    def bisect(context):
        lo, hi = 0, 9
        for line in context.split("<|im_start|>"):
            said = line.split("\n")[1].replace("<|im_end|>", "") if line.startswith("assistant") else ""
            if said:
                last = int(said[-1])
            if line.startswith("user") and "higher" in line:
                lo = last + 1
            if line.startswith("user") and "lower" in line:
                hi = last - 1
        return f"guess {(lo + hi) // 2}"

    runner = make_runner(tok, bisect, lambda: GymTextEnv(GuessNumber), limits=EpisodeLimits(5, 4000))
    try:
        t = run(runner, Trajectory(Prompt("x", [], metadata={"seed": 7}), "g", 0, []))
    finally:
        runner.close()
    assert t.reward == 1.0 and t.info["step_rewards"][-1] == 1.0 and t.info["turns"] >= 2


def test_environments_load_by_name_module_or_file(tmp_path, monkeypatch):
    assert load_env_class("single_turn") is Env and load_env_class("calculator").__name__ == "CalculatorEnv"
    (tmp_path / "my_env.py").write_text("class Mine:\n    def __init__(self, k=1): pass\n"
                                        "    async def reset(self, p): return []\n    async def step(self, t): pass\n")
    assert load_env_class(f"{tmp_path}/my_env.py:Mine").__name__ == "Mine"
    monkeypatch.chdir(tmp_path)
    assert load_env_class("my_env:Mine").__name__ == "Mine"
    with pytest.raises(ValueError, match="not a built-in environment"):
        load_env_class("calculater")
    with pytest.raises(ValueError, match="cannot import no_such_mod"):
        load_env_class("no_such_mod:X")
    with pytest.raises(ValueError, match="has no 'Nope'"):
        load_env_class("my_env:Nope")
    with pytest.raises(ValueError, match="no reset/step"):
        load_env_class("relayrl.records:Prompt")
    with pytest.raises(ValueError, match="env.args do not fit Mine"):
        make_env_factory("my_env:Mine", {"j": 2})
    assert make_env_factory("my_env:Mine", {"k": 2})().__class__.__name__ == "Mine"


def test_step_result_defaults_end_nothing():
    r = StepResult()
    assert r.messages == [] and r.reward == 0.0 and not r.done


def test_the_python_environment_runs_the_models_code_in_the_sandbox(tok):
    """env.name=python: the model's code runs in the sandboxed worker pool and its output comes
    back as the tool message the next turn reads."""
    import shutil

    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed (apt-get install bubblewrap)")
    code = '<tool_call>{"name": "python", "arguments": {"code": "import os; print(6 * 7, os.getuid())"}}</tool_call>'
    seen = []

    def reply(context):
        if "<tool_response>" in context:
            seen.append(context.split("<tool_response>\n")[-1].split("\n</tool_response>")[0])
            return "\\boxed{42}"
        return code

    runner = make_runner(tok, reply, load_env_class("python"))
    try:
        t = run(runner, Trajectory(Prompt("p", [{"role": "user", "content": "6*7?"}], answer="42"), "g", 0, []))
    finally:
        runner.close()
    assert t.reward == 1.0 and t.info["tool_calls"] == 1 and t.info.get("tool_errors", 0) == 0
    out = seen[0].split()
    assert out[0] == "42" and (os.getuid() != 0 or out[1] == "65534")  # as root the code runs as nobody


def test_a_hold_on_an_engine_that_never_returns_its_aborted_requests_fails_with_a_deadline(tok):
    """A checkpoint holds the training episodes and waits for the engine to return what it aborted;
    a hung engine returns nothing: the wait ends at its deadline with an error, not never."""
    from relayrl.engine.base import EngineError
    from tests.fake_engine import FakeEngine

    class Hung(FakeEngine):
        def get(self, timeout=None):  # takes requests and aborts, returns nothing ever
            time.sleep(0.005)
            return []

    eng = Hung(0)
    runner = EpisodeRunner(eng, tok, None, None, _score)
    runner.ABORT_WAIT_S = 0.5
    try:
        fut = runner.submit(runner.episode(Trajectory(PROMPT, "g", 0, [1, 2]), SamplingParams(100, 1.0)))
        t0 = time.monotonic()
        while not eng.live and time.monotonic() - t0 < 10:
            time.sleep(0.002)
        assert eng.live, "the request never reached the engine"
        raised = []
        holding = threading.Thread(target=lambda: raised.append(_raised(runner.hold)), daemon=True)
        holding.start()
        holding.join(timeout=5)
        assert not holding.is_alive(), "hold() still waits for the hung engine after 5 s"
        assert isinstance(raised[0], EngineError), raised
        assert "did not return its 1 aborted request within 0.5 s" in str(raised[0])
        assert eng.aborted == set(eng.live) and not fut.done()  # it was asked to abort; nothing came back
    finally:
        runner.close()


def _raised(fn) -> BaseException | None:
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - what the test looks at
        return e
    return None
