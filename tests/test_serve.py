"""The OpenAI-compatible endpoint, driven by the real ``openai`` SDK: sessions recorded token-in-token-out
(the same tokens a ``ToolEnv`` episode records), tools, streaming, stop strings, history rewrites as
branches, the trainer's sampling parameters, OpenAI-style errors for bad input, agent programs under
the failure policy and their deadlines, a flood of connections."""

import asyncio
import base64
import io
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from relayrl.algos.estimators import ESTIMATORS, Knobs, over_episodes
from relayrl.config import AlgoCfg
from relayrl.envs.base import ToolEnv
from relayrl.envs.chat import render_ids
from relayrl.rollout.groups import expand_branches
from relayrl.rollout.runner import EpisodeLimits, EpisodeRunner
from relayrl.records import Group, SamplingParams, Trajectory
from relayrl.rollout.groups import training_batch
from relayrl.serve.agent import AgentEpisodes, AgentProgram
from relayrl.serve.server import Endpoint
from relayrl.serve.sessions import Session
from tests.test_episodes import PROMPT, ScriptedEngine, _score, add, calc_reply
from tests.test_chat_template import chatml_tokenizer  # noqa: F401 - a fixture

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]
PARAMS = SamplingParams(1000, 1.0)


def _png_url() -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8), "red").save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


PNG = _png_url()


@pytest.fixture()
def tok(chatml_tokenizer):
    return chatml_tokenizer


async def calc_program(client, prompt):
    """A plain OpenAI-SDK agent: calls the model with the ``add`` tool until it answers."""
    messages = list(prompt.messages)
    for _ in range(4):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return None
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": str(add(**json.loads(call.function.arguments)))})
    return 0.0


def served(tok, reply, program=calc_program, limits=EpisodeLimits(4, 4000), **kw) -> EpisodeRunner:
    agent = AgentEpisodes(AgentProgram("agent:test", program, {}), "agent:test", "policy", context=None)
    return EpisodeRunner(ScriptedEngine(tok, reply, **kw), tok, None, limits, _score, agent=agent)


def run(runner, t, params=PARAMS, train=True):
    runner.run(runner.episode(t, params, train))
    return t


def session(runner, t=None, params=PARAMS, max_turns=8, max_tokens=4000):
    """A session of the endpoint opened by hand (as an episode opens one), and a sync SDK client on it."""
    t = t or Trajectory(PROMPT, "g", 0, [])

    async def new():
        return runner.agent.table.new(runner, t, params, True, max_turns, max_tokens, None)

    s = runner.submit(new()).result(5)
    return s, openai.OpenAI(base_url=f"{runner.agent.url}/v1", api_key=s.key, max_retries=0)


def test_an_sdk_program_records_exactly_what_a_tool_env_episode_records(tok):
    """Two requests (a tool call, then the answer after the tool's result) are one trajectory: the
    prompt as the template renders it, the engine's sampled tokens (mask 1) and, between them, the
    template's tokens for the tool message (mask 0) — token for token what ``ToolEnv`` records."""
    runner = served(tok, calc_reply)
    try:
        t = run(runner, Trajectory(PROMPT, "g", 0, []))
        runner.make_env, runner.agent = (lambda: ToolEnv([add])), None
        ref = run(runner, Trajectory(PROMPT, "g", 1, []))
    finally:
        runner.make_env = None
        runner.close()
    assert t.failure is None and t.reward == 1.0 and ref.reward == 1.0
    assert t.prompt_ids == ref.prompt_ids and t.response_ids == ref.response_ids and t.mask == ref.mask
    assert t.turns == ref.turns and len(t.behav_logprobs) == len(t.versions) == len(t.response_ids)
    turn1 = tok(calc_reply(""), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert [x for x, m in zip(t.response_ids, t.mask) if m][: len(turn1)] == turn1
    assert t.info["turns"] == 2 and t.info["tool_calls"] == 1 and t.info["branches"] == 0
    assert t.info["merged_turns"] == 1 and t.info["tool_errors"] == 0 and t.text == "\\boxed{5}"


def test_tool_calls_come_back_in_openai_format_and_streaming_matches(tok):
    runner = served(tok, calc_reply)
    try:
        s, client = session(runner)
        r = client.chat.completions.create(model="policy", messages=PROMPT.messages, tools=TOOLS)
        (call,) = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and call.type == "function"
        assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 2, "b": 3}
        assert r.choices[0].message.content is None and r.usage.completion_tokens > 0
        # the same request streamed (a new branch: the same turn sampled again) reassembles to the same message
        chunks = list(client.chat.completions.create(model="policy", messages=PROMPT.messages, tools=TOOLS,
                                                     stream=True, stream_options={"include_usage": True}))
        calls = [c for ch in chunks if ch.choices for c in (ch.choices[0].delta.tool_calls or [])]
        assert len(calls) == 1 and json.loads(calls[0].function.arguments) == {"a": 2, "b": 3}
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == ""
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"
        assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
        # the streamed message, sent back as the client assembled it, extends the streamed branch
        history = PROMPT.messages + [{"role": "assistant", "content": None, "tool_calls": [
            {"id": calls[0].id, "type": "function", "function": {"name": "add",
                                                                 "arguments": calls[0].function.arguments}}]},
            {"role": "tool", "tool_call_id": calls[0].id, "content": "5"}]
        text = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
            model="policy", messages=history, tools=TOOLS, stream=True) if ch.choices)
        assert text == "\\boxed{5}"
        assert len(s.branches) == 2 and s.branches[1].turn == 2 and s.counts["merged"] == 1
    finally:
        runner.close()


def test_streaming_sends_tokens_as_they_are_sampled(tiny):
    """With an engine that streams (the hf engine), content arrives in many chunks, before the end."""
    from relayrl.engine.hf import HFEngine

    model, tok = tiny
    agent = AgentEpisodes(AgentProgram("agent:test", calc_program, {}), "agent:test", "policy", context=None)
    runner = EpisodeRunner(HFEngine(model, tok, eos_token_ids=[]), tok, None, EpisodeLimits(4, 4000), _score,
                           agent=agent)
    try:
        for seed in range(4):  # (a random tiny model: replies cut multi-byte characters across tokens)
            torch.manual_seed(seed)
            s, client = session(runner, params=SamplingParams(40, 1.0))
            pieces = [ch.choices[0].delta.content for ch in client.chat.completions.create(
                model="policy", messages=PROMPT.messages, max_tokens=30, stream=True) if ch.choices]
            assert len([p for p in pieces if p]) > 3
            (b,) = s.branches
            assert len(b.traj.response_ids) == 30 and b.traj.mask == [1] * 30  # max_tokens: the client's, ≤ the run's
            assert "".join(p for p in pieces if p) == tok.decode(b.traj.response_ids, skip_special_tokens=False)
    finally:
        runner.close()


def test_a_streamed_character_cut_between_tokens_is_sent_whole():
    from relayrl.serve.openai_format import visible_prefix

    assert visible_prefix("caf\ufffd") == "caf" and visible_prefix("café") == "café"
    assert visible_prefix("ok <tool_") == "ok " and visible_prefix('ok <tool_call>{"name"') == "ok "


def test_a_rewritten_history_is_a_new_branch_trained_with_the_episodes_reward(tok):
    async def rewrites(client, prompt):
        first = await client.chat.completions.create(model="policy", messages=prompt.messages, tools=TOOLS)
        call = first.choices[0].message.tool_calls[0]
        # the program drops the tool call from its history and asks again with the result in a user turn
        await client.chat.completions.create(model="policy", messages=prompt.messages + [
            {"role": "user", "content": f"<tool_response>\n{add(**json.loads(call.function.arguments))}\n"}],
            tools=TOOLS)
        return 1.0

    runner = served(tok, calc_reply, rewrites)
    try:
        t = run(runner, Trajectory(PROMPT, "g", 0, []))
        other = run(runner, Trajectory(PROMPT, "g", 1, []))
    finally:
        runner.close()
    assert t.failure is None and t.reward == 1.0 and t.info["branches"] == 1 and t.info["merged_turns"] == 0
    g = Group(PROMPT, "g", [t, other])
    expand_branches(g)
    assert len(g.trajectories) == 4 and [x.info.get("branch_of") for x in g.trajectories] == [None, None, 0, 1]
    branch = g.trajectories[2]
    assert branch.reward == 1.0 and branch.complete and branch.mask == [1] * len(branch.response_ids)
    assert tok.decode(branch.response_ids) .startswith("<tool_call>")  # the first request's own branch
    assert "\\boxed{5}" in tok.decode(t.response_ids)  # the episode keeps its latest reply's branch
    # the baseline is over episodes: rewards 1 (episode 0) and 0 (episode 1) with GRPO, branches sharing theirs
    g.trajectories[1].reward = g.trajectories[3].reward = 0.0
    adv = episode_advantages([g], tok)
    assert torch.allclose(adv[2:], adv[:2]) and adv[0] > 0 > adv[1]
    assert torch.allclose(adv[:2], episode_advantages([Group(PROMPT, "g", g.trajectories[:2])], tok))


def episode_advantages(groups, tok) -> torch.Tensor:
    """Each row's GRPO advantage (on its trained tokens), as the trainer computes it from the batch."""
    batch, _ = training_batch(groups, AlgoCfg(), 64, tok.pad_token_id)
    args = (ESTIMATORS["grpo"], batch.rewards, batch.loss_mask, batch.group)
    adv = over_episodes(*args, batch.owner, Knobs()) if batch.owner is not None else args[0](*args[1:], None, Knobs())
    adv = adv[0]
    return (adv * batch.loss_mask).sum(-1) / batch.loss_mask.sum(-1)


def test_the_trainers_sampling_parameters_win_and_overrides_are_counted(tok):
    seen = []
    runner = served(tok, lambda c: "hello")
    submit = runner.engine.engine.submit
    runner.engine.engine.submit = lambda reqs: (seen.extend(r.params for r in reqs), submit(reqs))[1]
    try:
        s, client = session(runner, params=SamplingParams(1000, 0.7, top_p=0.9))
        client.chat.completions.create(model="policy", messages=PROMPT.messages, temperature=0.1, top_p=0.5,
                                       max_tokens=500)
        client.chat.completions.create(model="policy", messages=PROMPT.messages, temperature=0.7)
    finally:
        runner.close()
    assert [(p.temperature, p.top_p) for p in seen] == [(0.7, 0.9), (0.7, 0.9)]
    assert seen[0].max_new_tokens == 500 and seen[1].max_new_tokens == 1000  # bounded by the run's max_new_tokens
    assert s.counts["sampling_overrides"] == 1


def test_stop_strings_cut_the_reply_and_its_tokens(tok):
    runner = served(tok, lambda c: "one two STOP three four" if "again" not in c else "done")
    try:
        s, client = session(runner)
        r = client.chat.completions.create(model="policy", messages=PROMPT.messages, stop=["STOP"])
        assert r.choices[0].message.content == "one two " and r.choices[0].finish_reason == "stop"
        (b,) = s.branches
        text = tok.decode(b.traj.response_ids)
        assert text.startswith("one two STOP") and "three" not in text  # sampled up to the stop string
        client.chat.completions.create(model="policy", messages=PROMPT.messages + [
            {"role": "assistant", "content": "one two "}, {"role": "user", "content": "again"}])
        # the next turn extends it: the turn ended with the template's end-of-turn token (mask 0)
        i = len(tok(text, add_special_tokens=False)["input_ids"])
        assert b.traj.response_ids[i] == tok.eos_token_id and b.traj.mask[i] == 0 and b.turn == 2
    finally:
        runner.close()



def test_generated_tokens_count_only_what_a_stop_left(tok):
    """The run's ``generated_tokens`` (and so ``tokens_per_s``) counts the tokens a reply kept: those
    sampled past a stop string (chat, text) or a stop token id (the token route) are cut from the branch,
    and from the count."""
    text = "one two STOP three four"
    runner = served(tok, lambda c: text)
    try:
        s, client = session(runner)
        prompt = render_ids(tok, PROMPT.messages, add_generation_prompt=True)
        runner.take_generated()
        client.chat.completions.create(model="policy", messages=PROMPT.messages, stop=["STOP"])
        client.completions.create(model="policy", prompt=tok.decode(prompt), stop=["two"], max_tokens=100)
        three = tok(text, add_special_tokens=False)["input_ids"][-2]  # (a token of " three four")
        httpx.post(f"{runner.agent.url}/sessions/{s.key}/inference/v1/generate", json={
            "model": "policy", "token_ids": prompt, "sampling_params": {"stop_token_ids": [three]}})
        kept = [len(b.traj.response_ids) for b in s.branches]
        assert len(kept) == 3 and "three" not in tok.decode(s.branches[0].traj.response_ids)
        assert runner.take_generated() == sum(kept)
    finally:
        runner.close()

def test_bad_input_gets_openai_errors_and_the_endpoint_goes_on(tok):
    runner = served(tok, lambda c: "fine")
    try:
        s, client = session(runner)
        url = f"{runner.agent.url}/v1/chat/completions"
        auth = {"Authorization": f"Bearer {s.key}"}
        r = httpx.post(url, content=b"{not json", headers={**auth, "content-type": "application/json"})
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
        r = httpx.post(url, json={"model": "policy"}, headers=auth)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        r = httpx.post(url, json={"model": "policy", "messages": [{"role": "wizard", "content": "x"}]}, headers=auth)
        assert r.status_code == 400 and "unknown role" in r.json()["error"]["message"]
        for image, why in (("https://example.com/a.png", "nothing is fetched from the network"),
                           ("data:image/png;base64,@@", "does not decode"), ("x", "not a data URL"),
                           ("data:image/png;base64," + base64.b64encode(b"not a png").decode(), "not a readable image"),
                           (PNG, "text-only")):  # (a good image: this endpoint's policy is a text model)
            r = httpx.post(url, json={"model": "policy", "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": "what?"}]}]}, headers=auth)
            assert r.status_code == 400 and why in r.json()["error"]["message"], (image[:30], r.text)
        r = httpx.post(url, json={"model": "policy", "messages": [{"role": "user", "content": [
            {"type": "audio", "audio": "x"}]}]}, headers=auth)
        assert r.status_code == 400 and "text or image_url" in r.json()["error"]["message"]
        with pytest.raises(openai.NotFoundError) as e:
            client.chat.completions.create(model="gpt-9", messages=PROMPT.messages)
        assert e.value.code == "model_not_found"
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="policy", messages=PROMPT.messages, n=2)
        with pytest.raises(openai.AuthenticationError) as e:
            openai.OpenAI(base_url=f"{runner.agent.url}/v1", api_key="rl-never-issued", max_retries=0) \
                .chat.completions.create(model="policy", messages=PROMPT.messages)
        assert e.value.code == "invalid_api_key"
        r = httpx.post(f"{runner.agent.url}/sessions/{s.key}/inference/v1/generate",
                       json={"model": "policy", "token_ids": [1, 10**9]})
        assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"]
        assert client.chat.completions.create(model="policy", messages=PROMPT.messages).choices[0].message.content \
            == "fine"  # after all that, the session still works
        runner.submit(_close(runner, s)).result(5)  # its episode ends
        with pytest.raises(openai.AuthenticationError) as e:
            client.chat.completions.create(model="policy", messages=PROMPT.messages)
        assert e.value.code == "session_expired"
    finally:
        runner.close()



def test_every_route_needs_a_session_key_in_the_url_or_as_a_bearer_header(tok):
    """The key, in the session's base URL (as the SDK's ``base_url``) or as the API key (``Authorization:
    Bearer``, out of URLs that proxies log), on every route, ``/v1/models`` too; without an open
    session's key nothing is answered, not even which model the endpoint serves."""
    runner = served(tok, lambda c: "fine")
    try:
        s, by_url = session(runner)
        url, bearer = runner.agent.url, {"Authorization": f"Bearer {s.key}"}
        by_header = openai.OpenAI(base_url=f"{url}/v1", api_key=s.key, max_retries=0)  # the key in a header only
        prompt = render_ids(tok, PROMPT.messages, add_generation_prompt=True)
        for client in (by_url, by_header):
            assert client.models.list().data[0].id == "policy" and client.models.retrieve("policy").id == "policy"
            assert client.chat.completions.create(model="policy", messages=PROMPT.messages).choices[0] \
                .message.content == "fine"
            assert client.completions.create(model="policy", prompt=tok.decode(prompt)).choices[0].text == "fine"
        r = httpx.post(f"{url}/inference/v1/generate", json={"model": "policy", "token_ids": prompt}, headers=bearer)
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"]
        for path in ("/v1/models", "/v1/models/policy"):
            for where, headers in ((f"{url}{path}", {}), (f"{url}{path}", {"Authorization": "Bearer rl-never-issued"}),
                                   (f"{url}/sessions/rl-never-issued{path}", {})):
                r = httpx.get(where, headers=headers)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", where
        r = httpx.post(f"{url}/v1/chat/completions", json={"model": "gpt-9", "messages": PROMPT.messages})
        assert r.status_code == 401 and "gpt-9" not in r.text and "policy" not in r.text
        runner.submit(_close(runner, s)).result(5)  # its episode ends
        r = httpx.get(f"{url}/v1/models", headers=bearer)
        assert r.status_code == 401 and r.json()["error"]["code"] == "session_expired"
    finally:
        runner.close()


def test_an_endpoint_beyond_loopback_is_warned_about(recwarn):
    """Plain HTTP: a ``serve.host`` other than loopback is said at start, in one line naming the field."""
    from relayrl.serve.server import build_app
    from relayrl.serve.sessions import SessionTable

    app = build_app(SessionTable(), "policy", None, 8)
    for host in ("127.0.0.1", "localhost", "::1"):
        Endpoint(app, host).sock.close()
    assert not [w for w in recwarn if "serve.host" in str(w.message)]
    with pytest.warns(UserWarning, match=r"serve.host=0.0.0.0: the endpoint listens beyond this machine over "
                                         r"plain HTTP") as caught:
        Endpoint(app, "0.0.0.0").sock.close()
    assert "\n" not in str(caught[0].message)

async def _close(runner, s):
    runner.agent.table.close(s)


def test_a_session_refuses_requests_past_the_episodes_limits(tok):
    runner = served(tok, lambda c: "x " * 30)
    try:
        s, client = session(runner, max_turns=2, max_tokens=50)
        said = client.chat.completions.create(model="policy", messages=PROMPT.messages).choices[0].message.content
        with pytest.raises(openai.BadRequestError) as e:  # the second turn would need more than the budget
            client.chat.completions.create(model="policy", messages=PROMPT.messages + [
                {"role": "assistant", "content": said}, {"role": "user", "content": "more " * 20}])
        assert e.value.code == "context_length_exceeded" and len(s.branches) == 1  # nothing of it recorded
        client.chat.completions.create(model="policy", messages=PROMPT.messages)
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="policy", messages=PROMPT.messages)
        assert e.value.code == "max_turns_exceeded" and s.limit_hit
    finally:
        runner.close()


def test_a_history_that_outgrows_the_context_ends_the_episode_and_a_first_prompt_too_long_is_an_error(tok):
    runner = served(tok, lambda c: "x " * 5)
    try:
        s, client = session(runner)
        s.context = 60
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "long " * 40}])
        assert e.value.code == "context_length_exceeded" and s.limit_hit is None  # the program's own input: an error
        said = client.chat.completions.create(model="policy", messages=PROMPT.messages).choices[0].message.content
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="policy", messages=PROMPT.messages + [
                {"role": "assistant", "content": said}, {"role": "user", "content": "and more " * 20}])
        assert s.limit_hit == "the model's context (60 tokens)"  # scored as it stands, like a turn limit
        s2, client = session(runner)  # a rewritten history (a new branch) too long for the context, after a reply
        s2.context = 60
        client.chat.completions.create(model="policy", messages=PROMPT.messages)
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "summary " * 20}])
        assert s2.limit_hit == "the model's context (60 tokens)"
    finally:
        runner.close()


@pytest.mark.parametrize("program,kind,error", [
    ("raises", "env", "ZeroDivisionError"),
    ("hangs", "env_timeout", "env.step_timeout_s=0.3"),
    ("returns_text", "env", "must return a float or None"),
    ("never_asks", "env", "never asked the model"),
])
def test_agent_programs_that_fail_are_left_out_never_scored(tok, program, kind, error):
    async def raises(client, prompt):
        await client.chat.completions.create(model="policy", messages=prompt.messages)
        return 1 / 0

    async def hangs(client, prompt):
        await client.chat.completions.create(model="policy", messages=prompt.messages)
        await asyncio.sleep(1000)

    async def returns_text(client, prompt):
        await client.chat.completions.create(model="policy", messages=prompt.messages)
        return "great"

    async def never_asks(client, prompt):
        return 1.0

    programs = {f.__name__: f for f in (raises, hangs, returns_text, never_asks)}
    runner = served(tok, calc_reply, programs[program], limits=EpisodeLimits(4, 4000, step_timeout_s=0.3))
    try:
        t0 = time.monotonic()
        t = run(runner, Trajectory(PROMPT, "g", 0, []))
        assert time.monotonic() - t0 < 10
        assert t.failure["kind"] == kind and error in t.failure["error"]
        assert t.failure["source"].startswith("agent program agent:test")
        assert not runner.agent.table.open  # the session closed with its episode
        assert runner.submit(_other_tasks()).result(5) == 0  # nothing of the program is left running
        runner.agent.program = AgentProgram("agent:test", calc_program, {})
        assert run(runner, Trajectory(PROMPT, "g", 1, [])).reward == 1.0  # the next episode runs
    finally:
        runner.close()


async def _other_tasks() -> int:
    ignore = ("serve", "main_loop", "_heartbeat")
    return len([t for t in asyncio.all_tasks() if t is not asyncio.current_task()
                and not any(x in repr(t.get_coro()) for x in ignore)])


def test_the_episode_deadline_counts_the_programs_time_between_requests(tok):
    async def slow_tools(client, prompt):
        messages = list(prompt.messages)
        for _ in range(10):
            await client.chat.completions.create(model="policy", messages=messages)
            await asyncio.sleep(0.2)  # a slow tool, under each step's deadline
            messages = list(prompt.messages)
        return 1.0

    runner = served(tok, lambda c: "x", slow_tools,
                    limits=EpisodeLimits(20, 4000, step_timeout_s=5, episode_timeout_s=0.5))
    try:
        t = run(runner, Trajectory(PROMPT, "g", 0, []))
    finally:
        runner.close()
    assert t.failure["kind"] == "env_timeout" and "env.episode_timeout_s=0.5" in t.failure["error"]


def test_a_request_in_flight_at_a_weight_update_goes_on_under_the_new_weights(tok):
    runner = served(tok, calc_reply, delay=0.01)  # the first turn: 69 tokens, ~0.7 s
    eng = runner.engine.engine
    try:
        t = Trajectory(PROMPT, "g", 0, [])
        fut = runner.submit(runner.episode(t, PARAMS))
        t0, cut = time.monotonic(), 0
        while cut < 3 and time.monotonic() - t0 < 10:
            time.sleep(0.002)
            with eng.lock:
                cut = max((len(x["out"]) for x in eng.live.values()), default=0)
        with eng.pause():  # as a partial publish does: cut and load in one pause
            cut = max(len(x["out"]) for x in eng.live.values())
            runner.abort_inflight()
            eng.load_weights({}, 1)
        fut.result(timeout=30)
    finally:
        runner.close()
    assert runner.continued == 1 and t.reward == 1.0 and t.failure is None
    assert t.versions == [0] * cut + [1] * (len(t.response_ids) - cut)
    full = render_ids(tok, PROMPT.messages + [{"role": "assistant", "content": calc_reply("")},
                                              {"role": "tool", "content": "5"},
                                              {"role": "assistant", "content": "\\boxed{5}"}], add_generation_prompt=False)
    assert t.prompt_ids + t.response_ids == full[: len(t.prompt_ids) + len(t.response_ids)]


def test_the_token_route_extends_a_branch_token_in_token_out(tok, monkeypatch):
    late_start(monkeypatch)
    runner = served(tok, calc_reply)
    try:
        s, _ = session(runner)
        url = f"{runner.agent.url}/sessions/{s.key}/inference/v1/generate"
        models = httpx.get(f"{runner.agent.url}/sessions/{s.key}/v1/models").json()
        assert models["data"][0]["id"] == "policy" and "max_model_len" in models["data"][0]
        prompt = render_ids(tok, PROMPT.messages, add_generation_prompt=True)
        out = httpx.post(url, json={"model": "policy", "token_ids": prompt, "sampling_params": {
            "max_tokens": 200, "logprobs": 1, "stop_token_ids": [tok.eos_token_id]}}).json()
        (choice,) = out["choices"]
        assert choice["finish_reason"] == "stop" and choice["token_ids"][-1] == tok.eos_token_id
        assert [e["token"] for e in choice["logprobs"]["content"]] == [f"token_id:{i}" for i in choice["token_ids"]]
        bridge = tok("\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
                     add_special_tokens=False)["input_ids"]
        again = prompt + choice["token_ids"] + bridge
        with ThreadPoolExecutor(2) as pool:  # the next turn sampled twice at once: one of them extends the branch
            out2, other = pool.map(lambda _: httpx.post(url, json={"model": "policy", "token_ids": again}).json(),
                                   range(2))
        assert tok.decode(out2["choices"][0]["token_ids"]).startswith("\\boxed{5}")
        assert out2["prompt_token_ids"] == other["prompt_token_ids"] == again
        b, fresh = s.branches  # the other: a branch of its own, from the context it sent
        n1, n2 = len(choice["token_ids"]), len(out2["choices"][0]["token_ids"])
        assert b.traj.prompt_ids == prompt and b.traj.mask == [1] * n1 + [0] * len(bridge) + [1] * n2
        assert fresh.traj.prompt_ids == again and fresh.traj.mask == [1] * len(other["choices"][0]["token_ids"])
    finally:
        runner.close()


def test_text_completions_extend_their_prompt(tiny, monkeypatch):
    from relayrl.engine.hf import HFEngine

    late_start(monkeypatch)
    model, tok = tiny
    agent = AgentEpisodes(AgentProgram("agent:test", calc_program, {}), "agent:test", "policy", context=None)
    runner = EpisodeRunner(HFEngine(model, tok, eos_token_ids=[]), tok, None, EpisodeLimits(4, 4000), _score,
                           agent=agent)
    try:
        s, client = session(runner)
        first = client.completions.create(model="policy", prompt="a=3 b=4", max_tokens=5).choices[0].text
        (b,) = s.branches
        assert first == tok.decode(b.traj.response_ids) and b.traj.mask == [1] * 5
        again = "a=3 b=4" + first + " c=5"
        with ThreadPoolExecutor(2) as pool:  # the next turn sampled twice at once: one of them extends the branch
            replies = list(pool.map(lambda _: client.completions.create(model="policy", prompt=again, max_tokens=5),
                                    range(2)))
        assert len(s.branches) == 2 and b.turn == 2  # the same branch: the engine's tokens, then " c=5"'s
        assert b.traj.mask == [1] * 5 + [0] * len(tok(" c=5", add_special_tokens=False)["input_ids"]) + [1] * 5
        other = s.branches[1].traj  # the other: a branch of its own, from the text it sent
        assert other.prompt_ids == tok(again)["input_ids"] and other.mask == [1] * 5
        assert sorted(r.usage.prompt_tokens for r in replies) == sorted(
            [len(b.traj.prompt_ids) + b.traj.mask.index(1, 5), len(other.prompt_ids)])
        assert sorted(r.choices[0].text for r in replies) == sorted(
            tok.decode(x.response_ids[-5:]) for x in (b.traj, other))
        client.completions.create(model="policy", prompt="a=3 b=5", max_tokens=5)
        assert len(s.branches) == 3  # another prompt: another branch
    finally:
        runner.close()


@pytest.mark.slow
def test_a_thousand_connections_are_bounded_and_nothing_crashes(tok, monkeypatch):
    """1,000 clients at once: the endpoint handles ``serve.max_requests`` of them and answers the rest 429
    (OpenAI clients retry those); the run's loop keeps its heartbeat and the endpoint serves after. And
    1,000 connections that never send a request: past ``serve.max_connections`` the endpoint answers 503,
    until it closes them (``Endpoint.FIRST_REQUEST_S``)."""
    agent = AgentEpisodes(AgentProgram("agent:test", calc_program, {}), "agent:test", "policy", context=None,
                          max_requests=64, max_connections=1100)
    runner = EpisodeRunner(ScriptedEngine(tok, lambda c: "ok", delay=0.002), tok, None, EpisodeLimits(4, 4000),
                           _score, agent=agent)
    fds = len(os.listdir("/proc/self/fd"))
    try:
        s, client = session(runner, max_turns=10_000)

        async def flood():
            limits = httpx.Limits(max_connections=1000, max_keepalive_connections=0)
            async with httpx.AsyncClient(limits=limits, timeout=60) as h:
                body = {"model": "policy", "messages": PROMPT.messages, "max_tokens": 5}
                return await asyncio.gather(*(h.post(f"{agent.url}/v1/chat/completions", json=body,
                                                     headers={"Authorization": f"Bearer {s.key}"})
                                              for _ in range(1000)), return_exceptions=True)

        out = asyncio.run(flood())
        codes = [r.status_code if isinstance(r, httpx.Response) else type(r).__name__ for r in out]
        assert set(codes) <= {200, 429}, {c for c in codes if c not in (200, 429)}
        assert codes.count(200) >= 64 and codes.count(429) > 0
        assert all(r.json()["error"]["code"] == "rate_limit_exceeded" for r in out if r.status_code == 429)
        assert runner.blocked_for() < 2 and len(s.branches) == codes.count(200)
        assert client.chat.completions.create(model="policy", messages=PROMPT.messages).choices[0].message.content \
            == "ok"
        assert client.models.list().data[0].id == "policy"

        # long enough that opening the 1,200 idle connections (1.3 s on a busy 2-core machine) ends before the
        # first of them is closed, short enough to wait out
        monkeypatch.setattr(Endpoint, "FIRST_REQUEST_S", 3.0)

        async def idle_flood():  # connections that never send a request, past serve.max_connections
            conns = [await asyncio.open_connection("127.0.0.1", agent.endpoint.port) for _ in range(1200)]
            async with httpx.AsyncClient(headers={"Authorization": f"Bearer {s.key}"}) as h:
                try:
                    blocked = (await h.get(f"{agent.url}/v1/models")).status_code
                except httpx.TransportError as e:  # its connection was closed at once
                    blocked = type(e).__name__
                await asyncio.sleep(Endpoint.FIRST_REQUEST_S + 0.5)  # they are closed: the endpoint serves again
                after = (await h.get(f"{agent.url}/v1/models")).status_code
            closed = sum([await r.read(1) == b"" for r, _ in conns])
            for _, w in conns:
                w.close()
            return blocked, after, closed

        blocked, after, closed = asyncio.run(idle_flood())
        assert blocked != 200 and after == 200 and closed == 1200
    finally:
        runner.close()
    time.sleep(0.5)
    assert len(os.listdir("/proc/self/fd")) <= fds + 8  # the connections are gone


def test_agent_programs_load_by_file_or_module_with_clear_errors(tmp_path, monkeypatch):
    from relayrl.config import EnvCfg
    from relayrl.envs.base import make_env_factory
    from relayrl.run.build import env_factory

    def load(spec, args):
        return env_factory(EnvCfg(name=spec, args=args))

    (tmp_path / "prog.py").write_text("async def run(client, prompt, k=1):\n    return None\n"
                                      "def sync(client, prompt):\n    return None\n")
    monkeypatch.chdir(tmp_path)
    p = load("agent:prog.py:run", {"k": 2})
    assert isinstance(p, AgentProgram) and p.args == {"k": 2}
    assert isinstance(load("agent:prog:run", {}), AgentProgram)
    with pytest.raises(ValueError, match="must be an async function"):
        load("agent:prog.py:sync", {})
    with pytest.raises(ValueError, match="does not fit its signature"):
        load("agent:prog.py:run", {"nope": 1})
    with pytest.raises(ValueError, match="no such file"):
        load("agent:missing.py:run", {})
    with pytest.raises(ValueError, match="names an agent program, not an environment"):
        make_env_factory("agent:prog.py:run", {})  # (envs never import serve: the assembly loads programs)


QWENISH = (  # CHATML, with assistant tool calls rendered as Qwen's templates render them
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'tool' -%}"
    "{{ '<|im_start|>user\n<tool_response>\n' + m['content'] + '\n</tool_response><|im_end|>\n' }}"
    "{%- else -%}{{ '<|im_start|>' + m['role'] + '\n' + (m['content'] or '') }}"
    "{%- for tc in m.get('tool_calls') or [] -%}"
    "{{ '<tool_call>\n{\"name\": \"' + tc['function']['name'] + '\", \"arguments\": ' "
    "+ (tc['function']['arguments'] | tojson) + '}\n</tool_call>' }}"
    "{%- endfor -%}{{ '<|im_end|>\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)


def test_verifiers_training_client_speaks_the_token_route(tok, tmp_path, monkeypatch):
    """verifiers' own training client (``TrainClient``: its renderer renders the chat to token ids,
    ``POST /inference/v1/generate``, reads ``max_model_len`` from ``GET /v1/models``) against a session:
    a tool call parsed by its renderer, then the next turn, which extends the same branch token for token."""
    from renderers.configs import DefaultRendererConfig
    from verifiers.v1.clients.train import TrainClient
    from verifiers.v1.configs.client import TrainClientConfig
    from verifiers.v1.dialects.chat import ChatDialect
    from verifiers.v1.types import SamplingConfig

    tok.add_tokens(["<tool_call>", "</tool_call>"], special_tokens=True)  # (Qwen's: the parser looks for them)
    tok.chat_template = QWENISH  # (verifiers renders the conversation itself: a template that renders tool calls)
    tok.save_pretrained(tmp_path / "tok")  # (the renderer loads the tokenizer by path)
    runner = served(tok, lambda c: calc_reply(c).replace("<tool_call>", "<tool_call>\n").replace(
        "</tool_call>", "\n</tool_call>"))  # (Qwen3's tool-call layout, as its parser reads it)
    try:
        s, _ = session(runner)
        monkeypatch.setenv("RELAYRL_KEY", s.key)
        config = TrainClientConfig(base_url=f"{runner.agent.url}/sessions/{s.key}/v1", api_key_var="RELAYRL_KEY",
                                   renderer_model_name=str(tmp_path / "tok"),
                                   renderer=DefaultRendererConfig(tool_parser="qwen3"))
        tools = [{"type": "function", "function": TOOLS[0]["function"]}]

        async def talk():
            client = TrainClient(config)
            try:
                body = {"model": "policy", "messages": PROMPT.messages, "tools": tools}
                first = await client.get_response(ChatDialect(), body, SamplingConfig(max_tokens=200))
                call = first.message.tool_calls[0]
                history = PROMPT.messages + [
                    {"role": "assistant", "content": first.message.content or "",
                     "tool_calls": [{"id": call.id, "type": "function",
                                     "function": {"name": call.name, "arguments": call.arguments}}]},
                    {"role": "tool", "tool_call_id": call.id, "content": "5"}]
                second = await client.get_response(ChatDialect(), {**body, "messages": history},
                                                   SamplingConfig(max_tokens=200))
                return first, second
            finally:
                await client.close()

        first, second = asyncio.run(talk())
    finally:
        runner.close()
    assert first.message.tool_calls[0].name == "add" and json.loads(first.message.tool_calls[0].arguments) == \
        {"a": 2, "b": 3}
    assert "\\boxed{5}" in second.message.content
    (b,) = s.branches  # one branch: the second prompt extended the first's tokens
    t = b.traj
    n1 = len(first.tokens.completion_ids)
    assert t.prompt_ids == first.tokens.prompt_ids and t.response_ids[:n1] == first.tokens.completion_ids
    assert t.behav_logprobs[:n1] == pytest.approx(first.tokens.completion_logprobs)
    assert t.prompt_ids + t.response_ids[:-len(second.tokens.completion_ids)] == second.tokens.prompt_ids
    assert [x for x, m in zip(t.response_ids, t.mask) if m] == first.tokens.completion_ids + \
        second.tokens.completion_ids


def test_a_template_that_cannot_extend_a_session_stops_the_run(tok):
    """Failing closed as an environment episode does: the second request's suffix would not be what the
    template renders, so the episode is not trained on it and the run stops with the cause."""
    from relayrl.failures import UserCodeError
    from tests.test_chat_template import FORGETFUL

    tok.chat_template = FORGETFUL
    runner = served(tok, calc_reply)
    try:
        with pytest.raises(UserCodeError, match="cannot extend a conversation token-in-token-out"):
            run(runner, Trajectory(PROMPT, "g", 0, []))
    finally:
        runner.close()


@pytest.mark.parametrize("route", ["chat", "tokens", "text"])
def test_parallel_identical_requests_of_a_seeded_episode_draw_their_own_numbers(tok, route, monkeypatch):
    """An agent asking for several samples of one conversation at once (its n, best-of-n), on any route:
    each is a branch, and under seeded sampling (training and evaluation) each branch gets a seed of its own,
    else the engine would return the same reply n times. So too for n samples of the next turn, sent
    together and all matched before any of them generates: each extends a branch of its own."""
    late_start(monkeypatch)
    seen = []

    class Recording(ScriptedEngine):
        def submit(self, requests):
            seen.extend(r.params.seed for r in requests)
            super().submit(requests)

    first = render_ids(tok, PROMPT.messages, add_generation_prompt=True)
    bridge = "\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"

    async def n_samples(client, prompt):
        async with httpx.AsyncClient(base_url=str(client.base_url).removesuffix("v1/"), timeout=30) as h:
            async def ask(context):
                if route == "chat":
                    r = await client.chat.completions.create(model="policy", messages=context)
                    return r.choices[0].message.content
                if route == "tokens":
                    r = await h.post("inference/v1/generate", json={"model": "policy", "token_ids": context})
                    return r.json()["choices"][0]["token_ids"]
                return (await client.completions.create(model="policy", prompt=context, max_tokens=100)).choices[0].text

            context = {"chat": list(prompt.messages), "tokens": first, "text": tok.decode(first)}[route]
            said = (await asyncio.gather(*(ask(context) for _ in range(3))))[0]
            if route == "chat":
                again = context + [{"role": "assistant", "content": said}, {"role": "user", "content": "again"}]
            else:
                again = context + said + (tok(bridge, add_special_tokens=False)["input_ids"] if route == "tokens"
                                          else bridge)
            await asyncio.gather(*(ask(again) for _ in range(3)))
        return 1.0

    agent = AgentEpisodes(AgentProgram("agent:test", n_samples, {}), "agent:test", "policy", context=None)
    runner = EpisodeRunner(Recording(tok, lambda ctx: "4"), tok, None, EpisodeLimits(8, 4000), _score, agent=agent)
    try:
        t = run(runner, Trajectory(PROMPT, "g", 0, []), params=SamplingParams(100, 1.0, seed=7))
    finally:
        runner.close()
    assert t.failure is None and t.info["branches"] == 2 and t.info["merged_turns"] == 3  # one next turn each
    assert len(seen) == 6 and None not in seen and len(set(seen[:3])) == 3 and len(set(seen[3:])) == 3


@pytest.mark.parametrize("route", ["tokens", "text"])
def test_parallel_identical_requests_on_the_token_and_text_routes_are_branches_of_their_own(tok, route,
                                                                                        monkeypatch):
    """An agent sampling n continuations of one context at once on the token route or the text route
    (the chat route's case: ``test_parallel_identical_requests_...``): one of them extends the earlier
    branch, every other is a branch of its own, and each reply is generated on the context it was sent,
    never as a second turn after another's reply on a shared branch."""
    late_start(monkeypatch)
    runner = served(tok, calc_reply)
    n = 4
    try:
        s, _ = session(runner)
        base = f"{runner.agent.url}/sessions/{s.key}"
        first = render_ids(tok, PROMPT.messages, add_generation_prompt=True)
        bridge = "<|im_end|>\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        if route == "tokens":
            url, body = f"{base}/inference/v1/generate", (lambda ctx: {"model": "policy", "token_ids": ctx})
            said = lambda out: out["choices"][0]["token_ids"]
            prompt = first
        else:
            url, body = f"{base}/v1/completions", (lambda ctx: {"model": "policy", "prompt": ctx, "max_tokens": 200})
            said = lambda out: out["choices"][0]["text"]
            prompt = tok.decode(first)
        one = httpx.post(url, json=body(prompt)).json()
        (b0,) = s.branches
        before = b0.traj.prompt_ids + b0.traj.response_ids
        if route == "tokens":
            ids = tok(bridge[len("<|im_end|>"):], add_special_tokens=False)["input_ids"]
            again = prompt + said(one) + ids
            extended, fresh = again, again
        else:
            again = prompt + said(one) + bridge
            extended = before + tok(bridge, add_special_tokens=False)["input_ids"]
            fresh = tok(again)["input_ids"]

        async def together():
            async with httpx.AsyncClient(timeout=30) as h:
                return await asyncio.gather(*(h.post(url, json=body(again)) for _ in range(n)))

        replies = [r.json() for r in asyncio.run(together())]
    finally:
        runner.close()
    assert len(s.branches) == n and sorted(b.turn for b in s.branches) == [1] * (n - 1) + [2]
    contexts = []
    for b in s.branches:
        t = b.traj
        k = len(t.mask) - t.mask[::-1].index(0) if 0 in t.mask else 0  # the last reply: the trailing mask-1 tokens
        contexts.append(t.prompt_ids + t.response_ids[:k])
        assert set(t.turns[k:]) == {b.turn - 1} and tok.decode(t.response_ids[k:]).startswith("\\boxed{5}")
    assert sorted(contexts) == sorted([extended] + [fresh] * (n - 1))
    assert sorted(str(said(r)) for r in replies) == sorted(str(said(r)) for r in replies[:1] * n)


def late_start(monkeypatch, delay: float = 0.05) -> None:
    """Each reply's generation starts ``delay`` after its request was matched to a branch (as on a busy
    loop), so requests sent together are all matched before any of them generates."""
    generate = Session.generate

    async def late(self, *args, **kwargs):
        await asyncio.sleep(delay)
        return await generate(self, *args, **kwargs)

    monkeypatch.setattr(Session, "generate", late)
