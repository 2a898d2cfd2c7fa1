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
                     "stop", "1 versions behind", "tool_calls=1", "v1×2", "a: 0+2=2"):
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
