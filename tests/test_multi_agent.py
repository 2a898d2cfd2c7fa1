"""Several agents in one episode: matches of a multi-agent environment, one trajectory per role
token-in-token-out, rewards and outcomes per role, the scripted opponent, baselines per role, and
user code that fails a match."""

import pytest

from relayrl.envs import games
from relayrl.envs.chat import render_ids
from relayrl.envs.multi import MultiAgentEnv, MultiStep, Players
from relayrl.failures import failed
from relayrl.records import Group, Prompt, SamplingParams, Trajectory
from relayrl.rollout.groups import baseline_groups
from relayrl.rollout.runner import EpisodeLimits, EpisodeRunner
from tests.test_chat_template import chatml_tokenizer  # noqa: F401 - a fixture
from tests.test_episodes import ScriptedEngine, _score


def optimal(context: str) -> str:
    """A player that knows Nim's rule: leave a multiple of 4 (1 where it cannot)."""
    tail = context.rsplit("<|im_start|>user\n", 1)[-1]
    pile = int(tail.split(" left")[0].split()[-1]) if " left" in tail else int(tail.split("Nim: ")[1].split()[0])
    return str(games.best(pile) or 1)


def runner_for(tok, players, reply=optimal, limits=EpisodeLimits(8, 400)):
    return EpisodeRunner(ScriptedEngine(tok, reply), tok, players, limits, _score)


def play(runner, pile, n, train=True, max_new_tokens=8):
    p = Prompt(f"pile{pile}", [{"role": "user", "content": str(pile)}])
    g = Group(p, "g0", [Trajectory(p, "g0", i, []) for i in range(n)])
    runner.run(runner.group(g, SamplingParams(max_new_tokens, 1.0), train))
    return g


def nim_players(train=(), eval_roles=(), group_size=2, skill=0.0):
    return Players.of(lambda: games.Nim(skill), games.Nim, "nim", list(train), list(eval_roles), group_size)


def test_self_play_records_each_role_token_in_token_out_with_its_reward(chatml_tokenizer):
    tok = chatml_tokenizer
    runner = runner_for(tok, nim_players())
    try:
        g = play(runner, 10, 2)  # first wins: 2 (8 left), then answers 4 - k each time
    finally:
        runner.close()
    first, second = g.trajectories
    assert (first.info["role"], second.info["role"]) == ("first", "second")
    assert (first.reward, second.reward) == (1.0, 0.0)
    assert (first.info["outcome"], second.info["outcome"]) == ("win", "loss")
    # each trajectory is its role's conversation as the template renders it: its moves trained (mask 1), the
    # other's moves observations (mask 0)
    for t, role in ((first, "first"), (second, "second")):
        opening = [{"role": "user", "content": games.opening(10, role == "first")}]
        if role == "second":  # the second's first prompt has the first's move in it
            opening.append({"role": "user", "content": games.after(2, 8)})
        assert t.prompt_ids == render_ids(tok, opening, add_generation_prompt=True)
        trained = tok.decode([x for x, m in zip(t.response_ids, t.mask) if m]).replace("<|im_end|>", "")
        assert trained == {"first": "233", "second": "11"}[role]
        assert 0 in t.mask and t.turns[-1] == t.info["turns"] - 1
    assert "They took 1. 7 left." in tok.decode(first.response_ids)
    assert first.info["turns"] == 3 and second.info["turns"] == 2


def test_evaluation_plays_each_role_against_the_scripted_player(chatml_tokenizer):
    tok = chatml_tokenizer
    runner = runner_for(tok, nim_players(eval_roles=["first", "second"]))
    try:
        g = play(runner, 9, 4, train=False)
    finally:
        runner.close()
    roles = [t.info["role"] for t in g.trajectories]
    assert roles == ["first", "second", "first", "second"]
    # from 9 the first player wins with optimal play; as second the optimal player wins once the random
    # opponent leaves a pile that is not a multiple of 4
    assert all(t.info["outcome"] == "win" for t in g.trajectories if t.info["role"] == "first")
    assert all(not failed(t) and t.info["outcome"] in ("win", "loss") for t in g.trajectories)


def test_the_greedy_evaluation_plays_each_role_once(chatml_tokenizer):
    """Greedy, as sampled, the policy plays every role of env.eval_roles (it played the first alone: half the
    matches, and a win rate of that side only)."""
    from relayrl.run.evaluation import EvalSettings, evaluate

    tok, records = chatml_tokenizer, []
    runner = runner_for(tok, nim_players(eval_roles=["first", "second"]))
    piles = [Prompt(f"pile{n}", [{"role": "user", "content": str(n)}]) for n in (8, 9, 12)]
    try:
        out = evaluate(runner, tok, piles, EvalSettings(samples=2, seed=0, temperature=1.0, max_new_tokens=8),
                       samples=records)
    finally:
        runner.close()
    greedy = [r for r in records if r["kind"] == "greedy"]
    assert sorted((r["prompt_id"], r["sample"]) for r in greedy) == sorted((f"pile{n}", i) for n in (8, 9, 12)
                                                                          for i in (0, 1))
    assert out["win_rate_greedy"] == sum(r["reward"] for r in greedy) / 6


def test_a_random_player_loses_to_the_rule(chatml_tokenizer):
    """The scripted player is a fixed function of the game: a policy that always takes 1 wins less."""
    tok = chatml_tokenizer
    wins = {}
    for name, reply in (("rule", optimal), ("ones", lambda c: "1")):
        runner = runner_for(tok, nim_players(eval_roles=["first"]), reply=reply)
        try:
            wins[name] = sum(play(runner, p, 1, train=False).trajectories[0].info["outcome"] == "win"
                             for p in range(5, 16) if p % 4)
        finally:
            runner.close()
    assert wins["rule"] == 9 > wins["ones"]


def test_a_role_against_the_scripted_player_in_training(chatml_tokenizer):
    runner = runner_for(chatml_tokenizer, nim_players(train=["second"], group_size=3))
    try:
        g = play(runner, 8, 3)  # second wins from 8 with the rule
    finally:
        runner.close()
    assert [t.info["role"] for t in g.trajectories] == ["second"] * 3
    assert all(t.reward == 1.0 for t in g.trajectories)


def test_vs_scripted_plays_the_first_trajectories_of_a_group_alone_against_the_scripted_player(chatml_tokenizer):
    """env.vs_scripted=0.25 of a group of 8 (2 roles): trajectories 0 and 1 each a match of their own (first, then
    second) against the scripted player, 2 … 7 three self-play matches. The rule wins from 10 as first, and as second
    against the scripted player's random moves (its moves are in the conversation, not the policy's)."""
    players = Players.of(lambda: games.Nim(0.0), games.Nim, "nim", [], [], 8, vs_scripted=0.25)
    assert players.solo == 2
    trajs = [Trajectory(Prompt("p", []), "g", i, []) for i in range(8)]
    shape = [sorted((r, t.sample_idx) for r, t in m.items()) for m in players.matches(trajs, True)]
    assert shape == [[("first", 0)], [("second", 1)], [("first", 2), ("second", 3)], [("first", 4), ("second", 5)],
                     [("first", 6), ("second", 7)]]
    runner = runner_for(chatml_tokenizer, players)
    try:
        g = play(runner, 10, 8)
    finally:
        runner.close()
    roles = [t.info["role"] for t in g.trajectories]
    assert roles == ["first", "second"] * 4
    selfplay = [t.reward for t in g.trajectories[2:]]
    assert selfplay == [1.0, 0.0] * 3  # the rule on both sides: the first wins from 10
    alone_first, alone_second = g.trajectories[:2]
    assert alone_first.reward == 1.0  # the rule against random moves, from 10 as first
    # the second's conversation: the scripted player's moves as observations, the rule's answers trained
    assert games.after(0, 0).split()[0] in chatml_tokenizer.decode(alone_second.prompt_ids)
    assert Players.of(lambda: games.Nim(0.0), games.Nim, "nim", [], [], 4, vs_scripted=0.25).solo == 2  # (a round)
    with pytest.raises(ValueError, match=r"env.vs_scripted=0.25: 2 of a group's 2 trajectories, in whole rounds of "
                       r"the 2 roles, would play the scripted player alone, and no self-play match would be left"):
        Players.of(lambda: games.Nim(0.0), games.Nim, "nim", [], [], 2, vs_scripted=0.25)
    with pytest.raises(ValueError, match=r"env.vs_scripted=0.9: 8 of a group's 8"):
        Players.of(lambda: games.Nim(0.0), games.Nim, "nim", [], [], 8, vs_scripted=0.9)


def test_baselines_are_per_prompt_and_role():
    p = Prompt("p", [])
    def t(i, role):
        return Trajectory(p, "g", i, [], info={"role": role} if role else {})
    groups = [Group(p, "a", [t(0, "first"), t(1, "second"), t(2, "first")]), Group(p, "b", [t(0, None), t(1, None)])]
    assert baseline_groups(groups) == [0, 1, 0, 2, 2]


def test_config_errors_name_the_field_and_the_roles():
    with pytest.raises(ValueError, match=r"env.roles: 'judge' is not a role of Nim \(its roles: first, second\)"):
        nim_players(train=["judge"])
    with pytest.raises(ValueError, match=r"rollout.group_size=3 is not a multiple of the 2 roles"):
        nim_players(group_size=3)

    class NoScript(MultiAgentEnv):
        async def step(self, role, text):
            return MultiStep(done=True)
    with pytest.raises(ValueError, match="has no scripted player"):
        Players.of(NoScript, NoScript, "x", ["first"], [], 2)


class Cheater(games.Nim):
    """Pays a role the game does not have."""

    async def step(self, role, text):
        return MultiStep(rewards={"referee": 1.0}, done=True)


class Broken(games.Nim):
    def scripted(self, role):
        raise RuntimeError("opponent crashed")


@pytest.mark.parametrize("cls, message", [(Cheater, "named role 'referee', which the game does not have"),
                                          (Broken, "RuntimeError: opponent crashed")])
def test_a_failing_match_is_each_of_its_trajectories_counted_failure(chatml_tokenizer, cls, message):
    players = Players.of(lambda: cls(), cls, "bad", [], ["first"], 2)
    runner = runner_for(chatml_tokenizer, players)
    try:
        g = play(runner, 6, 2, train=cls is Cheater)  # (Broken: its scripted player is in evaluation)
    finally:
        runner.close()
    assert all(failed(t) and message in t.failure["error"] for t in g.trajectories)
    assert runner.error_count >= 1 and message in runner.errors[0]


@pytest.mark.slow
def test_the_self_play_example_runs_and_reports_win_rates(tmp_path):
    """examples/self_play.yaml end to end (from the agent demo's model, no warm start: 2 steps, async):
    both sides trained, the win rates in metrics and summary.json."""
    import json
    from pathlib import Path

    from relayrl.config import load_config
    from relayrl.run.loop import train

    example = Path(__file__).resolve().parent.parent / "examples" / "self_play.yaml"
    cfg = load_config(str(example), [f"run.output_dir={tmp_path}", "run.steps=2", "model.path=builtin:agent-demo",
                                     "rollout.prompts_per_step=2", "rollout.group_size=4", "eval.samples=2",
                                     "run.mode=async", "run.name=sp"])
    s = train(cfg)
    assert s["eval_win_rate_before"] is not None and s["eval_win_rate_after"] is not None
    assert s["eval_after"]["win_rate/first"] is not None and s["eval_after"]["prompts"] == 11
    m = [json.loads(x) for x in (tmp_path / "sp" / "metrics.jsonl").read_text().splitlines()]
    assert len(m) == 2 and all("win_rate" in x for x in m)  # (of the trained episodes: a side that moved)
    assert all(0 < x["responses_per_group"] <= 4 for x in m)  # (a side that never moved is not trained)


def test_roles_on_an_environment_with_none_are_refused():
    from relayrl.config.sections import EnvCfg
    from relayrl.run.build import env_factory

    with pytest.raises(ValueError, match="env.name=calculator is not a multi-agent environment"):
        env_factory(EnvCfg(name="calculator", roles=["first"]))
    assert isinstance(env_factory(EnvCfg(name="nim", eval_roles=["second"]), 4), Players)


def test_a_checkpoint_plays_the_other_role_the_same_move_for_the_same_game(chatml_tokenizer):
    """env.args.opponent: a frozen model (here the agent demo's) answers the scripted roles, seeded by the
    game so far: two evaluations of one policy against it play the same matches."""
    from relayrl.envs.players import ModelPlayer

    import torch

    player = ModelPlayer("builtin:agent-demo", max_new_tokens=4)
    view = [{"role": "user", "content": games.opening(9, False)}, {"role": "user", "content": games.after(1, 8)}]
    before = torch.random.get_rng_state()
    assert player.move_now(view) == player.move_now(view)
    assert torch.equal(torch.random.get_rng_state(), before)  # (its own generator: the process's RNG untouched)
    make = lambda: games.Nim(opponent="builtin:agent-demo")  # noqa: E731
    played = []
    for _ in range(2):
        runner = runner_for(chatml_tokenizer, Players.of(make, games.Nim, "nim", [], ["second"]))
        try:
            g = play(runner, 9, 2, train=False)
        finally:
            runner.close()
        assert all(not failed(t) and t.info["role"] == "second" for t in g.trajectories)
        played.append([(t.response_ids, t.info["outcome"]) for t in g.trajectories])
    assert played[0] == played[1]
    assert chatml_tokenizer.decode(g.trajectories[0].prompt_ids).count("They took") + (
        g.trajectories[0].info["illegal_moves"] == 1) == 1  # the model moved first (or forfeited)


def test_a_role_that_never_moved_is_left_out_of_training():
    from relayrl.rollout.groups import drop_failed

    p = Prompt("p", [])
    moved = Trajectory(p, "g", 0, [1], [2, 3], info={"role": "first", "turns": 1})
    idle = Trajectory(p, "g", 1, [1], [], info={"role": "second", "turns": 0})
    kept, dropped = drop_failed([Group(p, "g", [moved, idle])])
    assert kept[0].trajectories == [moved] and dropped == 0


def test_rae_by_hand():
    """SPIRAL's role-conditioned advantage: b ← α·b + (1 − α)·R per key in batch order, A = R − b."""
    import torch

    from relayrl.algos.agents import rae

    baselines = {}
    a = rae(torch.tensor([1.0, 0.0, 1.0]), ["g/first", "g/first", "g/second"], baselines, alpha=0.5)
    assert a.tolist() == [0.5, -0.25, 0.5] and baselines == {"g/first": 0.25, "g/second": 0.5}
    a = rae(torch.tensor([1.0]), ["g/first"], baselines, alpha=0.5)  # the baseline carries over steps
    assert a.tolist() == [1.0 - 0.625] and baselines["g/first"] == 0.625


def test_rae_in_the_training_batch_keys_by_role_and_updates_the_runs_baselines():
    from types import SimpleNamespace

    from relayrl.rollout.groups import training_batch

    p = Prompt("p", [])
    trajs = [Trajectory(p, "g", i, [1], [2, 3], [0.0, 0.0], [0, 0], reward=r, info={"role": role})
             for i, (r, role) in enumerate([(1.0, "first"), (0.0, "second")])]
    algo = SimpleNamespace(advantage="rae", rae_alpha=0.5, overlong="none")
    baselines = {"/first": 0.0}
    batch, metrics = training_batch([Group(p, "g", trajs)], algo, 16, 0, baselines)
    assert baselines == {"/first": 0.5, "/second": 0.0}
    assert metrics == {"rae/baseline/first": 0.5, "rae/baseline/second": 0.0}
    assert batch.advantages[0].max() == 0.5 and batch.advantages[1].abs().sum() == 0


def test_adaptive_budgets_are_refused_for_matches(tmp_path):
    from pathlib import Path

    from relayrl.config import load_config
    from relayrl.run.loop import train

    example = Path(__file__).resolve().parent.parent / "examples" / "self_play.yaml"
    cfg = load_config(str(example), [f"run.output_dir={tmp_path}", "model.path=builtin:agent-demo",
                                     "rollout.budget=adaptive"])
    with pytest.raises(ValueError, match="rollout.budget=adaptive does not combine with env.name=nim"):
        train(cfg)


def test_a_pool_opponent_is_one_of_the_runs_complete_checkpoints(tmp_path):
    from relayrl.envs.players import pool_member

    with pytest.raises(ValueError, match="no complete checkpoint under"):
        pool_member(f"pool:{tmp_path}", 0)
    assert games.Nim(opponent=f"pool:{tmp_path}").opponent is None  # the random player until there is one
    for step, whole in ((2, True), (4, True), (6, False)):  # step 6 still being written
        d = tmp_path / "checkpoints" / f"step_{step:06d}"
        d.mkdir(parents=True)
        if whole:
            (d / "state.json").write_text("{}")
    drawn = {pool_member(f"pool:{tmp_path}", 0) for _ in range(40)}
    assert drawn == {str(tmp_path / "checkpoints" / f"step_{s:06d}") for s in (2, 4)}
    assert games.Nim(opponent=f"pool:{tmp_path}").opponent.path in drawn


def first_listed(context: str) -> str:
    """A TicTacToe player that takes the first move the game lists."""
    return context.rsplit("Available Moves: '", 1)[1].split("'")[0]


@pytest.mark.parametrize("train", [True, False], ids=["self-play", "against-the-scripted-player"])
def test_a_textarena_two_player_game_as_matches(chatml_tokenizer, train):
    from relayrl.config.sections import EnvCfg
    from relayrl.run.build import env_factory

    players = env_factory(EnvCfg(name="textarena:TicTacToe-v0", args={"num_players": 2}), 2)
    assert players.roles == ("player_0", "player_1")
    runner = runner_for(chatml_tokenizer, players, reply=first_listed, limits=EpisodeLimits(8, 2000))
    try:
        g = play(runner, 3, 2, train=train)
    finally:
        runner.close()
    assert not any(failed(t) for t in g.trajectories), [t.failure for t in g.trajectories]
    for t in g.trajectories:
        k = t.info["role"][-1]
        assert f"You are Player {k} in Tic Tac Toe" in chatml_tokenizer.decode(t.prompt_ids)
        moves = chatml_tokenizer.decode([x for x, m in zip(t.response_ids, t.mask) if m]).replace("<|im_end|>", " ")
        assert moves.split() and all(m.startswith("[") for m in moves.split())
    if train:  # both sides by the policy: one won, or a draw
        first, second = g.trajectories
        assert {first.info["outcome"], second.info["outcome"]} in ({"win", "loss"}, {"draw"})
        assert first.reward + second.reward == 0
        # first-listed moves: player 0 takes 0, 2, 4, 6 while player 1 takes 1, 3, 5: the diagonal 2-4-6 wins
        assert first.info["outcome"] == "win" and second.reward < 0


def test_textarena_matches_are_refused_for_other_player_counts():
    from relayrl.config.sections import EnvCfg
    from relayrl.envs.adapters.textarena import rows
    from relayrl.run.build import env_factory

    assert [r["metadata"]["seed"] for r in rows("textarena:TicTacToe-v0?size=2&players=2")] == [0, 1]

    with pytest.raises(ValueError, match="num_players=3: two-player games only"):
        env_factory(EnvCfg(name="textarena:TicTacToe-v0", args={"num_players": 3}), 2)
    with pytest.raises(ValueError, match="env.args do not fit TextArenaMatch"):
        env_factory(EnvCfg(name="textarena:TicTacToe-v0", args={"num_players": 2, "colour": "red"}), 2)


class HighCard(MultiAgentEnv):
    """Both name a number at once; the higher wins. Neither sees the other's before moving."""

    roles = ["a", "b"]

    async def reset(self, prompt):
        self.said = {}
        return {r: [{"role": "user", "content": f"You are {r}. Say a number."}] for r in self.roles}

    def turn(self):
        return list(self.roles)

    def scripted(self, role):
        return "5"

    async def step(self, role, text):
        self.said[role] = int(text)
        if len(self.said) < 2:
            return MultiStep(messages={"b": [{"role": "user", "content": f"a said {text}"}]})  # (seen after: too late)
        win = max(self.said, key=self.said.get)
        return MultiStep(rewards={win: 1.0}, done=True, outcome={r: "win" if r == win else "loss" for r in self.roles})


def test_roles_acting_at_once_move_on_the_same_game(chatml_tokenizer):
    players = Players.of(HighCard, HighCard, "highcard", [], [], 2)
    runner = runner_for(chatml_tokenizer, players, reply=lambda c: "7" if "You are a" in c else "3")
    try:
        g = play(runner, 1, 2)
    finally:
        runner.close()
    a, b = g.trajectories
    assert (a.info["outcome"], b.info["outcome"], a.reward, b.reward) == ("win", "loss", 1.0, 0.0)
    assert "a said" not in chatml_tokenizer.decode(b.prompt_ids + b.response_ids)  # b moved before it could read it
    assert a.info["turns"] == b.info["turns"] == 1


def test_half_solved_by_hand():
    assert [games.half_solved(k, 4) for k in range(5)] == [0.0, 0.5, 1.0, 0.5, 0.0]
    assert games.parse_problem("Sum mod 10: a=3 b=4") == [3, 4]
    assert games.parse_problem("Sum mod 10: a=3 c=4") is None and games.parse_problem("Sum mod 10: a=3") is None


@pytest.mark.parametrize("problem, solver_says, rewards", [
    ("Sum mod 10: a=3 b=4", lambda c: "\\boxed{7}", [0.0, 1, 1, 1, 1]),  # always solved: nothing to learn from
    ("Sum mod 10: a=3 b=5", lambda c: "\\boxed{1}", [0.0, 0, 0, 0, 0]),  # never solved: nothing either
    ("Add three and four", lambda c: "\\boxed{7}", [0.0]),  # not a problem: the solvers never move
])
def test_a_proposer_and_four_solvers(chatml_tokenizer, problem, solver_says, rewards):
    players = Players.of(games.ProposerSolver, games.ProposerSolver, "ps", [], ["solver#1"], 5)
    reply = lambda c: problem if "Write a problem." in c.rsplit("<|im_start|>user\n", 1)[-1] else solver_says(c)  # noqa: E731
    runner = runner_for(chatml_tokenizer, players, reply=reply)
    try:
        g = play(runner, 0, 5, max_new_tokens=40)
    finally:
        runner.close()
    proposer, *solvers = g.trajectories
    assert not any(failed(t) for t in g.trajectories)
    assert [t.info["role"] for t in g.trajectories] == ["proposer", "solver#1", "solver#2", "solver#3", "solver#4"]
    assert [t.reward for t in g.trajectories][: len(rewards)] == rewards
    if len(rewards) == 1:
        assert all(not s.response_ids for s in solvers) and proposer.info["bad_problems"] == 1
    else:
        assert all("Sum mod 10: a=3" in chatml_tokenizer.decode(s.prompt_ids) for s in solvers)
    p = Prompt("p", [])
    assert baseline_groups([Group(p, "g", g.trajectories)]) == [0, 1, 1, 1, 1]  # the solvers: one baseline


def test_gigpo_over_matches_compares_a_move_with_the_same_roles_moves(chatml_tokenizer):
    """Each role's moves are its steps (the reward on its last, the observation each started from its anchor
    state), and its episodes and steps are compared with the same role's only: rewards (first 1, second 0) and
    (first 1, second 1) give the first's rows no advantage at all (a mixed baseline of 0.75 would give them one)."""
    from relayrl.rollout.groups import step_advantages

    runner = runner_for(chatml_tokenizer, nim_players(group_size=4))
    try:
        g = play(runner, 10, 4)  # two identical matches (the optimal player on both sides)
    finally:
        runner.close()
    first = [t for t in g.trajectories if t.info["role"] == "first"]
    second = [t for t in g.trajectories if t.info["role"] == "second"]
    for t in g.trajectories:
        assert len(t.info["anchors"]) == len(t.info["step_rewards"]) == t.info["turns"]
        assert t.info["step_rewards"][-1] == t.reward and not any(t.info["step_rewards"][:-1])
    assert first[0].info["anchors"] == first[1].info["anchors"] != second[0].info["anchors"]
    second[1].reward = 1.0
    second[1].info["step_rewards"][-1] = 1.0
    adv = step_advantages([g], 1.0, 1.0)
    rows = {id(t): a for t, a in zip(g.trajectories, adv)}
    assert all(rows[id(t)].abs().sum() == 0 for t in first)
    assert rows[id(second[0])].max() < 0 < rows[id(second[1])].min()



def test_a_batch_where_the_policys_roles_never_moved_says_so():
    """Every match ended before the roles the policy plays moved (nothing failed, nothing to train): one line."""
    from types import SimpleNamespace

    from relayrl.run.loop import take_failures

    p = Prompt("p", [])
    g = Group(p, "g", [Trajectory(p, "g", i, [], info={"role": "second"}) for i in range(2)])
    state = SimpleNamespace(step=4, failures={})
    cfg = SimpleNamespace(run=SimpleNamespace(max_failure_frac=0.5))
    with pytest.raises(ValueError, match=r"step 5: nothing to train: in every match of the batch the roles the "
                                         r"policy plays never moved"):
        take_failures([g], state, cfg)


def test_dynamic_sampling_reads_each_roles_variance():
    """A zero-sum match's two sides always differ from each other (1 and -1): measured across roles, no group of
    self-play was ever filtered. Per role, as advantages are: a group whose every match went the same way is."""
    from relayrl.records import Group, Trajectory
    from relayrl.rollout.groups import no_variance
    from tests.test_episodes import PROMPT

    def group(*outcomes):
        trajs = []
        for k, (first, second) in enumerate(outcomes):
            trajs += [Trajectory(PROMPT, "g", 2 * k, [1], reward=first, info={"role": "first"}),
                      Trajectory(PROMPT, "g", 2 * k + 1, [1], reward=second, info={"role": "second"})]
        return Group(PROMPT, "g", trajs)

    assert no_variance(group((1.0, -1.0), (1.0, -1.0)))  # the first player won every match: nothing to compare
    assert not no_variance(group((1.0, -1.0), (-1.0, 1.0)))


@pytest.mark.slow
def test_a_multi_agent_run_with_the_default_budget_runs_with_fixed_groups(tmp_path, capsys):
    """The default rollout.budget (adaptive, where a group baseline reads variance) was refused for a multi-agent
    environment with a message implying the user had set it: now fixed, said in the log; set, still refused."""
    from relayrl.cli import main

    args = ["model.path=builtin:agent-demo", "env.name=nim", "data.path=builtin:nim", "run.steps=1",
            "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8", "data.eval_path=null",
            f"run.output_dir={tmp_path}", "run.progress=false"]
    assert main(["train", *args]) == 0
    assert "rollout.budget: fixed for env.name=nim, a multi-agent environment" in capsys.readouterr().out
    assert main(["train", *args, "rollout.budget=adaptive", "run.name=set"]) == 2
    assert "rollout.budget=adaptive does not combine with env.name=nim" in capsys.readouterr().err
