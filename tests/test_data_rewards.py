import json
import time

import pytest

from relayrl.data import DataError, PromptSampler, load_prompts
from relayrl.rewards import RewardRunner, extract_answer, math_reward


def test_jsonl_malformed_row_names_file_and_line(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": \n')
    with pytest.raises(DataError, match=r"d.jsonl: line 2: invalid JSON"):
        load_prompts(str(f))


def test_missing_field_names_row(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"prompt": "a", "answer": "1"}\n{"question": "b", "answer": "2"}\n')
    with pytest.raises(DataError, match=r"line 2: missing field 'prompt'"):
        load_prompts(str(f))


def test_parquet_and_datasets_folder_with_field_mapping(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"q": "What is 1+1?", "a": 2, "src": "x"}, {"q": [{"role": "user", "content": "hi"}], "a": 3, "src": "y"}]
    rows[1]["q"] = json.dumps(rows[1]["q"])  # parquet column must be one type; use strings there
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    ps = load_prompts(str(tmp_path / "d.parquet"), "q", "a", None, ["src"])
    assert ps[0].messages == [{"role": "user", "content": "What is 1+1?"}] and ps[0].answer == "2"
    assert ps[1].metadata == {"src": "y"} and ps[0].id == "row0"
    ds = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": "x"}], "answer": "5", "id": "k"}])
    ds.save_to_disk(str(tmp_path / "ds"))
    (p,) = load_prompts(str(tmp_path / "ds"))
    assert p.id == "k" and p.messages[0]["content"] == "x"


def test_sampler_resume_continues_exactly():
    prompts = load_prompts("builtin:demo-eval", limit=10)
    a = PromptSampler(prompts, seed=3)
    first = [p.id for p in a.take(13)]
    b = PromptSampler(prompts, seed=3)
    b.take(7)
    c = PromptSampler(prompts, seed=3, state=b.state)
    assert [p.id for p in c.take(6)] == first[7:]
    assert sorted(first[:10]) == sorted(p.id for p in prompts)  # each prompt once per epoch


def test_extract_and_math_equivalence():
    assert extract_answer(r"so \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    assert extract_answer("Answer: 42.") == "42"
    assert extract_answer("we get 3 then 7") == "7"
    assert math_reward(r"\boxed{0.5}", "1/2", {}) == 1.0
    assert math_reward(r"\boxed{13}", "13", {}) == 1.0
    assert math_reward(r"\boxed{12}", "13", {}) == 0.0


def raising_reward(completion, answer, metadata):
    raise RuntimeError("boom")


def hanging_reward(completion, answer, metadata):
    if completion == "hang":
        time.sleep(60)
    return 1.0


def test_raising_and_hanging_rewards_score_zero_and_are_counted():
    r = RewardRunner("tests.test_data_rewards:raising_reward", timeout_s=2)
    try:
        assert r.score([("x", "1", {}), ("y", "1", {})]) == [(0.0, True), (0.0, True)]
        assert r.stats.failures == 2 and "boom" in r.stats.last_error
    finally:
        r.close()
    r = RewardRunner("tests.test_data_rewards:hanging_reward", timeout_s=0.5)
    try:
        out = r.score([("a", None, {}), ("hang", None, {}), ("b", None, {})])
        assert out == [(1.0, False), (0.0, True), (1.0, False)]
        assert r.stats.timeouts == 1
    finally:
        r.close()


def test_unknown_reward_name_lists_valid():
    with pytest.raises(ValueError, match="math, exact"):
        RewardRunner("maths")
