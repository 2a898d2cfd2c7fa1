"""``relayrl show RUN``: the list of a run's rollout records, filtered and sorted; one episode with its
prompt, turns and tokens coloured by policy version; a bad run folder is one line."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import yaml

from relayrl.cli import main
from relayrl.run.show import PALETTE, token_view
from relayrl.tracking.rollouts import step_file


def _rec(step, i, reward, length, status="trained", failure=None, **kw):
    return {"id": f"g{step}/{i}", "step": step, "group": f"g{step}", "sample": i, "prompt_id": f"p{step}",
            "prompt": [{"role": "user", "content": f"question of step {step}"}], "answer": "6",
            "response": f"answer-{step}-{i}", "reward": reward, "failure": failure, "status": status,
            "finish_reason": "stop", "versions": [[step - 1, length]], "staleness": 0, "length": length,
            "info": {}, "response_ids": [], **kw}


@pytest.fixture()
def run(tmp_path, tiny_path) -> Path:
    from relayrl.models import load_tokenizer

    tok = load_tokenizer(tiny_path)
    ids = tok.encode("a: 0+2=2", add_special_tokens=False)
    agent = _rec(3, 2, 0.75, len(ids), versions=[[1, 2], [2, len(ids) - 2]], staleness=1, response_ids=ids,
                 turns=[{"assistant": "<tool_call>add(2, 4)</tool_call>", "env": "tool result: 6"},
                        {"assistant": "the sum is \\boxed{6}"}], info={"turns": 2, "tool_calls": 1})
    steps = {1: [_rec(1, 0, 0.0, 10), _rec(1, 1, 1.0, 30)],
             2: [_rec(2, 0, 0.5, 20), _rec(2, 1, 0.0, 5, "failed", {"kind": "reward", "source": "reward.fn=x:y",
                                                                     "error": "ValueError: bad"})],
             3: [_rec(3, 0, 0.25, 40, "filtered"), _rec(3, 1, 1.0, 15), agent]}
    d = tmp_path / "run"
    (d / "rollouts").mkdir(parents=True)
    (d / "config.yaml").write_text(yaml.safe_dump({"model": {"path": tiny_path}}))
    for s, recs in steps.items():
        with gzip.open(step_file(d, s), "wt") as f:
            f.writelines(json.dumps(r) + "\n" for r in recs)
    return d


def _show(capsys, monkeypatch, *args) -> tuple[int, str, str]:
    monkeypatch.setenv("COLUMNS", "200")
    capsys.readouterr()
    rc = main(["show", *map(str, args)])
    got = capsys.readouterr()
    return rc, got.out, got.err


def _ids(out: str) -> list[str]:
    return [w for line in out.splitlines() for w in line.replace("│", " ").split() if w.startswith("g") and "/" in w]


def test_the_list_filters_and_sorts(run, capsys, monkeypatch):
    rc, out, _ = _show(capsys, monkeypatch, run)
    assert rc == 0 and _ids(out) == ["g1/0", "g1/1", "g2/0", "g2/1", "g3/0", "g3/1", "g3/2"]
    assert "7 of 7 episodes (steps 1..3" in out and "filtered" in out and "v1×2 v2×" in out
    assert ": rollouts, in the run's order" in out
    assert ": rollouts, by reward, highest first" in _show(capsys, monkeypatch, run, "--sort", "reward")[1]
    assert _ids(_show(capsys, monkeypatch, run, "--step", 2)[1]) == ["g2/0", "g2/1"]
    assert _ids(_show(capsys, monkeypatch, run, "--failures")[1]) == ["g2/1"]
    assert _ids(_show(capsys, monkeypatch, run, "--status", "filtered")[1]) == ["g3/0"]
    assert _ids(_show(capsys, monkeypatch, run, "--sort", "reward")[1])[:2] == ["g1/1", "g3/1"]
    assert _ids(_show(capsys, monkeypatch, run, "--sort", "length", "--limit", 2)[1]) == ["g3/0", "g1/1"]
    assert _ids(_show(capsys, monkeypatch, run, "--min-reward", 0.3, "--max-reward", 0.9)[1]) == ["g2/0", "g3/2"]


def test_an_episode_shows_its_prompt_turns_and_tokens_by_version(run, capsys, monkeypatch):
    for key in ("g3/2", "6"):  # its id, or its # in the list
        rc, out, _ = _show(capsys, monkeypatch, run, "--episode", key)
        assert rc == 0 and "episode g3/2 (#6, step 3)" in out
        for want in ("question of step 3", "turn 0: policy", "<tool_call>add(2, 4)</tool_call>",
                     "turn 0: environment", "tool result: 6", "turn 1: policy", "the sum is \\boxed{6}", "0.75",
                     "stop", "1 version behind", "tool_calls=1", "v1×2", "[v1]a:[v2] 0+2=2"):
            assert want in out, want
    rc, out, _ = _show(capsys, monkeypatch, run, "--episode", "g2/1")
    assert "ValueError: bad" in out and "failed" in out


def test_tokens_are_coloured_by_the_version_that_sampled_them(tiny_path):
    from relayrl.models import load_tokenizer

    tok = load_tokenizer(tiny_path)
    ids = tok.encode("a: 0+2=2", add_special_tokens=False)
    rec = {"versions": [[4, 2], [5, len(ids) - 2]], "response_ids": ids}
    legend, text = token_view(rec, tok).renderables
    assert text.plain == "".join(tok.batch_decode([[i] for i in ids]))
    pieces = [(text.plain[s.start:s.end], s.style) for s in text.spans]
    assert [st for _, st in pieces] == [PALETTE[0]] * 2 + [PALETTE[1]] * (len(ids) - 2)
    assert "v4×2" in legend.plain and f"v5×{len(ids) - 2}" in legend.plain
    _, note = token_view(rec, None).renderables  # no tokenizer: the runs only
    assert "no tokenizer" in note.plain


def test_a_bad_run_or_one_without_records_is_one_line(run, tmp_path, capsys, monkeypatch):
    rc, out, err = _show(capsys, monkeypatch, tmp_path / "nope")
    assert rc == 2 and err.startswith("relayrl: show error:") and "no such run folder" in err
    assert err.count("\n") == 1 and not out
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "config.yaml").write_text("{}")
    rc, _, err = _show(capsys, monkeypatch, tmp_path / "bare")
    assert rc == 2 and "no rollout records" in err and "run.save_rollouts=0" in err and err.count("\n") == 1
    rc, _, err = _show(capsys, monkeypatch, run, "--episode", "g9/9")
    assert rc == 2 and "no episode 'g9/9'" in err and "from 0 to 6" in err
    rc, _, err = _show(capsys, monkeypatch, run, "--step", 7)
    assert rc == 2 and "step 7 has no records" in err


# ---------------------------------------------------------------- what a record holds never acts on the terminal

HOSTILE = "\x1b]0;pwned\x07 \x1b]52;c;aGk=\x07 \x9b31m \r\u202eevil"  # title, clipboard, C1 CSI, CR, bidi


def _write(d: Path, recs: list[dict], step: int = 1) -> None:
    (d / "rollouts").mkdir(parents=True, exist_ok=True)
    (d / "config.yaml").write_text("{}")
    with gzip.open(step_file(d, step), "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in recs)


def test_control_sequences_from_a_model_tool_or_dataset_never_reach_the_terminal(tmp_path, capsys, monkeypatch):
    import io

    from rich.console import Console

    from relayrl.run.show import show

    rec = _rec(1, 0, 1.0, 3, response="said " + HOSTILE, answer=HOSTILE, id="g1/0" + HOSTILE,
               failure={"kind": "env", "error": "tool said " + HOSTILE}, info={"note": HOSTILE},
               turns=[{"assistant": HOSTILE, "env": "tool result " + HOSTILE}, {"assistant": "done"}],
               prompt=[{"role": "user" + HOSTILE, "content": "asked " + HOSTILE}])
    _write(tmp_path / "run", [rec])
    outs = [_show(capsys, monkeypatch, tmp_path / "run")[1], _show(capsys, monkeypatch, tmp_path / "run", "--episode", "0")[1]]
    for episode in (None, "0"):  # and on a colour terminal, where rich writes its own escapes (CSI colours only)
        buf = io.StringIO()
        show(str(tmp_path / "run"), episode, console=Console(file=buf, force_terminal=True, color_system="standard",
                                                             width=200))
        outs.append(buf.getvalue())
    for out in outs:
        assert "\x1b]" not in out and "\x07" not in out and "\x9b" not in out and "\r" not in out, repr(out)
        assert "\u202e" not in out
    assert "said \\x1b]0;pwne" in outs[0] and "tool result \\x1b]0;pwned\\x07 \\x1b]52;c;aGk=\\x07" in outs[1], outs[1]


def test_step_opens_that_steps_file_alone(run, capsys, monkeypatch):
    import relayrl.run.show

    opened = []
    real = relayrl.run.show.read_step
    monkeypatch.setattr(relayrl.run.show, "read_step", lambda p: opened.append(p.name) or real(p))
    rc, out, _ = _show(capsys, monkeypatch, run, "--step", 2)
    assert rc == 0 and _ids(out) == ["g2/0", "g2/1"] and opened == ["step_000002.jsonl.gz"]
    assert f"open one: relayrl show {run} --step 2 --episode ID|#" in " ".join(out.split())
    rc, out, _ = _show(capsys, monkeypatch, run, "--step", 2, "--episode", 1)  # (# among that step's)
    assert rc == 0 and "episode g2/1 (#1, step 2)" in out


def test_a_failed_episodes_reward_is_strict_json_and_sorts_last(tmp_path, capsys, monkeypatch):
    import math

    from relayrl.records import FinishReason, Group, Prompt, Trajectory
    from relayrl.tracking.rollouts import RolloutLog

    class Decode:
        def decode(self, ids, skip_special_tokens=True):
            return "x" * len(ids)

    def traj(i, reward):
        return Trajectory(Prompt("p", [{"role": "user", "content": "q"}], answer="1"), "g", i, [1], [2, 3],
                          [-0.1, -0.2], [0, 0], FinishReason.STOP, reward=reward)

    failed = traj(1, math.nan)
    failed.failure = {"kind": "reward", "error": "boom"}
    g = Group(failed.prompt, "g", [traj(0, 0.5), failed, traj(2, 1.0)])
    RolloutLog(tmp_path / "run", 1, 0, Decode()).write(1, [g], [g], [], 1)
    (tmp_path / "run" / "config.yaml").write_text("{}")
    with gzip.open(step_file(tmp_path / "run", 1), "rt") as f:
        rows = [json.loads(line, parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}")) for line in f]
    assert [r["reward"] for r in rows] == [0.5, None, 1.0]
    # a step recorded before (NaN in the file) and this one: the episodes without a reward sort last
    _write(tmp_path / "run", [_rec(2, 0, math.nan, 3), _rec(2, 1, 0.75, 3)], step=2)
    out = _show(capsys, monkeypatch, tmp_path / "run", "--sort", "reward")[1]
    assert _rewards(out) == ["1", "0.75", "0.5", "-", "-"] and _ids(out)[3:] == ["g/1", "g2/0"], out
    assert _ids(_show(capsys, monkeypatch, tmp_path / "run", "--max-reward", 0.6)[1]) == ["g/0"]


def _rewards(out: str) -> list[str]:
    return [line.split("│")[5].strip() for line in out.splitlines() if line.count("│") > 8]


def test_the_list_has_prompt_and_answer_and_an_empty_filter_says_so(run, capsys, monkeypatch):
    rc, out, _ = _show(capsys, monkeypatch, run, "--step", 1)
    assert "prompt" in out and "answer" in out and "question of step 1" in out
    rc, out, _ = _show(capsys, monkeypatch, run, "--min-reward", 5)
    assert rc == 0 and out.strip() == "no episode of 7 (steps 1..3 (3 files)) passes these filters"


def test_piped_tokens_name_their_versions_and_broken_bytes_show_as_bytes(tiny_path):
    from relayrl.models import load_tokenizer

    tok = load_tokenizer(tiny_path)
    e_acute = tok.encode("é", add_special_tokens=False)  # two byte tokens: U+FFFD each, decoded alone
    ids = e_acute + e_acute[:1] + tok.encode(" 2", add_special_tokens=False)  # é, then a lone first byte
    rec = {"versions": [[4, 2], [5, len(ids) - 2]], "response_ids": ids}
    _, text = token_view(rec, tok, color=False).renderables
    assert text.plain.startswith("[v4]é[v5]\\xc3 2") and "\ufffd" not in text.plain
    _, text = token_view(rec, tok).renderables  # (in colour, the colours say it)
    assert text.plain.startswith("é\\xc3 2")


def test_a_workspace_episode_shows_its_tests_and_the_diff_they_ran_on(tmp_path, capsys, monkeypatch):
    record = {"reward": 0.0, "resolved": False, "statuses": {"tests/test_add.py::test_add": "FAILED"},
              "patch": "diff --git a/calc.py b/calc.py\n-    return a - b\n+    return a * b\n",
              "dropped": ["conftest.py"], "note": ""}
    _write(tmp_path / "run", [_rec(1, 0, 0.0, 3, info={"turns": 2, "record": record})])
    out = _show(capsys, monkeypatch, tmp_path / "run", "--episode", "0")[1]
    assert "tests: not resolved, reward 0.0" in out and "FAILED   tests/test_add.py::test_add" in out
    assert "+    return a * b" in out and "dropped from the diff (tests and their configuration): conftest.py" in out
    assert "record=" not in out and "turns=2" in out
