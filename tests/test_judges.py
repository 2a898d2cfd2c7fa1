"""Judges (reward.judge): scores read from replies, a real OpenAI-compatible server on loopback (retries, cache,
failures counted with the reply quoted), ranking a group at once, relayrl's own engine as the judge, and a run
whose reward comes from the judge alone."""

import pytest
import torch

from relayrl.config import JudgeCfg
from relayrl.records import Prompt
from relayrl.rewards.judge import Judge, JudgeFailure, LocalJudge, parse_score, parse_scores
from tests.openai_server import Server


@pytest.mark.parametrize("reply, score", [("fine. Score: 0.8", 0.8), ("Score: 7/10", 0.7), ("Score: 3 out of 4", 0.75),
                                          ("Score: **1**", 1.0), ("Score: 0.2\nScore: 0.9", 0.9), ("1", 1.0),
                                          (" 0.5.\n", 0.5)])
def test_scores_are_read_off_the_end_of_a_reply(reply, score):
    assert parse_score(reply) == pytest.approx(score)


@pytest.mark.parametrize("reply, says", [("no idea", "no score"), ("Score: 1.5", "outside"), ("Score: 3/0", "out of 0"),
                                         ("47 times 86 is 4042, so 1", "no score"), ("so 3 out of 4", "no score")])
def test_a_reply_without_a_score_in_range_is_a_failure_quoting_it(reply, says):
    with pytest.raises(JudgeFailure, match=says) as e:
        parse_score(reply)
    assert repr(reply)[:20] in str(e.value)


def test_ranking_scores():
    assert parse_scores("a\nb\nScores: 0.2, 1, 0.5", 3) == [0.2, 1.0, 0.5]
    with pytest.raises(JudgeFailure, match="2 scores for 3 responses"):
        parse_scores("Scores: 1, 0", 3)


def _by_answer(text: str) -> str:
    """A judge whose verdict the test decides: 1 when the response holds the reference answer."""
    answer = text.split("Reference answer (empty if there is none): ")[1].split("\n")[0]
    response = text.split("Response to grade:\n")[1].split("\n\nGrade how well")[0]
    return "It matches." + (" Score: 1" if answer and answer in response else " Score: 0")


P = Prompt("p1", [{"role": "user", "content": "Add 1 2"}], "3")


def test_pointwise_over_http_with_retries_and_a_cache():
    srv = Server(reply=_by_answer, fail_first=2)  # (two 503s: retried)
    with srv as url:
        judge = Judge(JudgeCfg(url=url, retries=3))
        assert judge.score_pointwise([(P, "it is 3"), (P, "it is 4")]) == [1.0, 0.0]
        sent = srv.requests
        assert judge.score_pointwise([(P, "it is 3"), (P, "it is 4")]) == [1.0, 0.0]
        assert srv.requests == sent  # (the same (judge, prompt) again: from the cache)
        judge.cfg.cache = False
        judge.score_pointwise([(P, "it is 3")])
        assert srv.requests == sent + 1


def test_a_template_file_is_read_less_its_final_newline(tmp_path):
    """As Jinja reads a template: the newline an editor ends the file with is not the judge's prompt's last
    token (a judge fine-tuned on prompts without it read one token more than it learned on); a second stays."""
    (tmp_path / "one.txt").write_text("{response}\nReference: {answer}\n")
    (tmp_path / "two.txt").write_text("{response}\n\n")
    with Server(reply=_by_answer) as url:
        one = Judge(JudgeCfg(url=url, template=str(tmp_path / "one.txt")))
        two = Judge(JudgeCfg(url=url, template=str(tmp_path / "two.txt")))
        assert one._render(P, response="it is 3") == "it is 3\nReference: 3"
        assert two._render(P, response="x") == "x\n"


def test_a_reply_without_a_score_fails_quoting_it_and_errors_after_retries_fail():
    with Server(reply=lambda text: "I would rather not say.") as url:
        [out] = Judge(JudgeCfg(url=url)).score_pointwise([(P, "3")])
        assert isinstance(out, JudgeFailure) and "I would rather not say." in str(out)
    with Server(reply=_by_answer, fail_first=10, fail_status=502) as url:
        [out] = Judge(JudgeCfg(url=url, retries=1)).score_pointwise([(P, "3")])
        assert isinstance(out, JudgeFailure) and "HTTP 502" in str(out) and "after 2 tries" in str(out)


def test_ranking_one_call_per_group():
    def rank(text: str) -> str:
        n = text.count("Response ") - text.count("Responses ")
        return "ok\nScores: " + ", ".join("1" if f"Response {i + 1}:\n3" in text else "0" for i in range(n))

    with Server(reply=rank) as url:
        judge = Judge(JudgeCfg(url=url, mode="ranking"))
        [scores] = judge.score_groups([(P, ["3", "4", "3 again"])])
    assert scores == [1.0, 0.0, 1.0]


def test_an_unanswering_judge_url_is_one_line_before_any_work(tmp_path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "relayrl.cli", "train", "reward.judge.url=http://127.0.0.1:9/v1"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "relayrl: model error: reward.judge.url='http://127.0.0.1:9/v1': the server does not answer: "
        "http://127.0.0.1:9/v1/models: ConnectionRefusedError: [Errno 111] Connection refused (after 2 tries)"]
    assert not (tmp_path / "runs").exists()


def test_relayrl_s_own_engine_judges_greedily(tiny_path):
    from relayrl.models import load_policy, load_tokenizer
    from relayrl.models.prompts import encode_prompt

    judge = LocalJudge(tiny_path, "cpu", 6)
    try:
        [got] = judge.complete(["Add 1 2"], 30)
    finally:
        judge.close()
    model, tok = load_policy(tiny_path), load_tokenizer(tiny_path)
    ids = torch.tensor([encode_prompt(tok, [{"role": "user", "content": "Add 1 2"}])])
    want = model.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1]:]
    assert got == tok.decode(want, skip_special_tokens=True)


# -- a run whose reward is the judge's ---------------------------------------------------------------------

def _digit_fraction_judge(text: str) -> str:
    response = text.split("Response to grade:\n")[1].split("\n\nGrade how well")[0]
    from tests.rewards_for_tests import digit_fraction

    return f"Score: {digit_fraction(response, None, {}):.4f}"


@pytest.mark.slow
def test_the_policy_learns_from_a_judge_alone(tiny_path, tmp_path):
    from relayrl.config import load_config
    from relayrl.run.loop import train
    from tests.test_e2e import EASY, _metrics

    with Server(reply=_digit_fraction_judge) as url:
        args = [a for a in EASY if not a.startswith("reward.fn")]
        cfg = load_config(None, args + [f"model.path={tiny_path}", f"run.output_dir={tmp_path}", "run.steps=25",
                                        f"reward.judge.url={url}"])
        assert cfg.reward.fn == "none"
        train(cfg)
    m = _metrics(cfg.run_dir)
    first, last = sum(x["reward_mean"] for x in m[:5]) / 5, sum(x["reward_mean"] for x in m[-5:]) / 5
    assert last > first + 0.15, (first, last)
    assert all(x["failures/judge"] == 0 for x in m)


@pytest.mark.slow
def test_a_judge_that_cannot_be_read_fails_episodes_and_stops_the_run_naming_it(tiny_path, tmp_path):
    from relayrl.config import load_config
    from relayrl.failures import UserCodeError
    from relayrl.run.loop import train
    from tests.test_e2e import EASY

    with Server(reply=lambda text: "Looks good to me!") as url:
        cfg = load_config(None, [a for a in EASY if not a.startswith("reward.fn")] + [
            f"model.path={tiny_path}", f"run.output_dir={tmp_path}", "run.steps=2", f"reward.judge.url={url}"])
        with pytest.raises(UserCodeError, match=r"step 1: reward.judge.url=http://127.0.0.1:\d+/v1 failed in 32 of 32 "
                                                r"episodes: no score in the judge's reply \(a 'Score: X' line, X in "
                                                r"\[0, 1\], or a reply that is only a number\): 'Looks good to me!'"):
            train(cfg)


@pytest.mark.parametrize("mode, text", [("pointwise", "Rate {response} against {reference}."),
                                        ("ranking", "Rank {responses}; {rubric}")])
def test_a_template_naming_a_field_a_judge_does_not_have_fails_at_start(tmp_path, mode, text):
    """It failed at the first scored episode (in ranking mode, outside the failure accounting)."""
    from relayrl.config.sections import JudgeCfg

    (tmp_path / "t.txt").write_text(text)
    with pytest.raises(ValueError, match=r"reward.judge.template=.*t.txt': cannot fill it \(KeyError: '(reference|rubric)'\); "
                                         r"its fields are prompt, answer, metadata, respons"):
        Judge(JudgeCfg(url="http://127.0.0.1:9", template=str(tmp_path / "t.txt"), mode=mode))


def test_how_a_judges_score_and_the_verifiers_reward_combine():
    """Training: reward.fn_weight × the verifier's reward + reward.judge.weight × the judge's score (the episode's
    own reward kept once in info, so a group re-ranked does not add the judge twice); held-out: the verifier's
    reward stays, unless reward.fn is none (judge_in_eval), where it is the judge's score."""
    from relayrl.records import Trajectory
    from relayrl.rewards.judge import JudgeFailure
    from relayrl.rollout.scoring import EpisodeScoring
    from tests.test_episodes import PROMPT

    s = EpisodeScoring.__new__(EpisodeScoring)
    s.fn_weight, s.judge_weight, s.judge = 0.5, 2.0, type("J", (), {"name": "judge"})()
    t = Trajectory(PROMPT, "g", 0, [1], reward=1.0)
    s._set(t, 0.25, train=True)
    assert t.reward == 0.5 * 1.0 + 2.0 * 0.25 and t.info == {"reward_own": 1.0, "judge": 0.25}
    s._set(t, 0.75, train=True)  # (re-ranked: from its own reward again)
    assert t.reward == 0.5 * 1.0 + 2.0 * 0.75
    held_out = Trajectory(PROMPT, "g", 1, [1], reward=1.0)
    s._set(held_out, 0.25, train=False)
    assert held_out.reward == 0.25  # (held-out with a judge scoring it: judge_in_eval, reward.fn none)
    failed = Trajectory(PROMPT, "g", 2, [1], reward=1.0)
    s._set(failed, JudgeFailure("no score"), train=True)
    assert failed.failure["kind"] == "judge" and failed.reward == 1.0  # (left out: never a reward of 0)


def test_a_ranking_judge_inside_a_run_and_a_judge_in_the_evaluation(tiny_path, tmp_path):
    """A ranking judge scores each group in a run (here the first response of every pair 1, the second 0: every
    step's mean reward 0.5); with reward.fn none, the held-out evaluation is the judge's (pointwise: every reply
    "Score: 1", so accuracy 1). Neither had a test inside a run."""
    import json

    from relayrl.config import load_config
    from relayrl.run.loop import train

    def judge(text: str) -> str:
        return "Scores: 1, 0" if "Response 2:" in text else "Score: 1"

    with Server(reply=judge) as url:
        common = [f"model.path={tiny_path}", f"run.output_dir={tmp_path}", "run.steps=2", "run.progress=false",
                  "rollout.max_new_tokens=4", "rollout.prompts_per_step=2", "rollout.group_size=2",
                  "rollout.budget=fixed", "rollout.dynamic_sampling=false", f"reward.judge.url={url}"]
        ranked = load_config(None, common + ["reward.judge.mode=ranking", "data.eval_path=null", "run.name=ranked"])
        train(ranked)
        steps = [json.loads(x) for x in (ranked.run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [m["reward_mean"] for m in steps] == [0.5, 0.5] and all(m["failures/judge"] == 0 for m in steps)
        judged = load_config(None, common + ["eval.size=4", "run.name=judged"])
        summary = train(judged)
    assert summary["eval_accuracy_before"] == 1.0 and summary["eval_accuracy_after"] == 1.0
