import json
import math
import time

import pytest

from relayrl.data.datasets import DataError, PromptSampler, load_prompts
from relayrl.rewards.verifiers import RewardRunner, extract_answer, math_reward


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
    assert ps[1].metadata == {"src": "y"} and ps[0].id == "row1"  # rows count from 1 in every format
    ds = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": "x"}], "answer": "5", "id": "k"}])
    ds.save_to_disk(str(tmp_path / "ds"))
    (p,) = load_prompts(str(tmp_path / "ds"))
    assert p.id == "k" and p.messages[0]["content"] == "x"


def _bad(tmp_path, name: str, content, **kw) -> str:
    """The DataError message for a dataset file holding ``content`` (bytes, text, or rows as JSON)."""
    f = tmp_path / name
    if isinstance(content, bytes):
        f.write_bytes(content)
    else:
        f.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(DataError) as e:
        load_prompts(str(f), **kw)
    return str(e.value)


def test_non_utf8_byte_names_file_line_and_byte(tmp_path):
    """Before: "'utf-8' codec can't decode byte 0xe9 in position 154", no file, no row."""
    msg = _bad(tmp_path, "d.jsonl", b'{"prompt": "a", "answer": "1"}\n{"prompt": "caf\xe9", "answer": "2"}\n')
    assert "d.jsonl: line 2: not valid UTF-8: byte 0xe9 at column 16" in msg
    msg = _bad(tmp_path, "d.json", b'[\n{"prompt": "a", "answer": "1"},\n{"prompt": "\xe9"}]')
    assert "d.json: line 3: not valid UTF-8: byte 0xe9" in msg


def test_utf16_file_is_named_and_utf8_bom_is_accepted(tmp_path):
    row = '{"prompt": "a", "answer": "1"}\n'
    assert "UTF-16" in _bad(tmp_path, "d.jsonl", row.encode("utf-16"))
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + row.encode())
    assert load_prompts(str(tmp_path / "bom.jsonl"))[0].messages[0]["content"] == "a"


def test_broken_json_file_names_file_line_and_column(tmp_path):
    """Before: json's own message with no file name."""
    msg = _bad(tmp_path, "d.json", '[{"prompt": "a", "answer": "1"},\n {"prompt": }]')
    assert "d.json: invalid JSON at line 2 column 13" in msg
    assert "name the file .jsonl" in _bad(tmp_path, "e.json", '{"prompt": "a"}\n{"prompt": "b"}\n')


def test_rows_count_from_one_in_json(tmp_path):
    """Before: a .json file's rows were numbered from 0 (and ids defaulted to row0)."""
    rows = [{"prompt": "a", "answer": "1"}, {"prompt": "b"}]
    assert "d.json: row 2: missing field 'answer'" in _bad(tmp_path, "d.json", rows)
    (tmp_path / "ok.json").write_text(json.dumps(rows[:1]))
    assert load_prompts(str(tmp_path / "ok.json"))[0].id == "row1"


def test_corrupt_parquet_and_datasets_folder_name_the_file(tmp_path):
    """Before: a pyarrow traceback."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"prompt": "a", "answer": "1"}] * 50), tmp_path / "ok.parquet")
    data = (tmp_path / "ok.parquet").read_bytes()
    for name, content in (("cut.parquet", data[: len(data) // 2]), ("junk.parquet", b"PAR1 not parquet"),
                          ("empty.parquet", b"")):
        assert f"{name}: not a readable Parquet file" in _bad(tmp_path, name, content)
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "dataset_info.json").write_text("{")
    with pytest.raises(DataError, match="folder: not a readable datasets folder"):
        load_prompts(str(tmp_path / "folder"))


@pytest.mark.parametrize("row, needle", [
    ({"prompt": "", "answer": "1"}, "line 1: field 'prompt' is empty"),
    ({"prompt": "   ", "answer": "1"}, "line 1: field 'prompt' is empty"),
    ({"prompt": [], "answer": "1"}, "line 1: field 'prompt' must be a non-empty string or a list"),
    ({"prompt": [{"role": "usr", "content": "x"}], "answer": "1"}, "field 'prompt' message 1: role 'usr' is not"),
    ({"prompt": [{"role": "user", "content": 3}], "answer": "1"}, "field 'prompt' message 1: content must be a str"),
    ({"prompt": ["x"], "answer": "1"}, "field 'prompt' message 1 must be an object"),
    ({"prompt": {"text": "x"}, "answer": "1"}, "field 'prompt' must be a non-empty string or a list"),
    ({"prompt": "x", "answer": {"a": 1}}, "line 1: field 'answer' must be a string or a number, got dict"),
    ({"prompt": "x", "answer": [1, 2]}, "line 1: field 'answer' must be a string or a number, got list"),
    ({"prompt": "x", "answer": True}, "line 1: field 'answer' must be a string or a number, got bool"),
    ({"prompt": "x", "answer": "1", "id": {"k": 1}}, "line 1: field 'id' must be a non-empty string or an integer"),
    ({"prompt": "x\ud800", "answer": "1"}, "line 1: field 'prompt': invalid Unicode: lone surrogate"),
])
def test_bad_prompt_answer_and_id_name_file_row_and_field(tmp_path, row, needle):
    msg = _bad(tmp_path, "d.jsonl", json.dumps(row) + "\n")
    assert msg.startswith(str(tmp_path / "d.jsonl")) and needle in msg


def test_number_answers_become_strings(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"prompt": "a", "answer": 2}\n{"prompt": "b", "answer": 0.5}\n')
    assert [p.answer for p in load_prompts(str(f))] == ["2", "0.5"]


def test_raw_prompt_format_takes_strings_only(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"prompt": "2+2=", "answer": "4"}\n{"prompt": [{"role": "user", "content": "x"}], "answer": "1"}\n')
    with pytest.raises(DataError, match=r"d.jsonl: line 2: field 'prompt': data.prompt_format=raw takes a plain"):
        load_prompts(str(f), prompt_format="raw")
    (p,) = load_prompts(str(f), prompt_format="raw", limit=1)
    assert p.messages == [{"role": "user", "content": "2+2="}]


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


def test_raising_and_hanging_rewards_are_failures_not_zeros_and_are_counted():
    r = RewardRunner("tests.test_data_rewards:raising_reward", timeout_s=2)
    try:
        out = r.score([("x", "1", {}), ("y", "1", {})])
        assert all(math.isnan(v) for v, _ in out)  # never a score of 0 that could be trained on
        assert [f["kind"] for _, f in out] == ["reward", "reward"]
        assert out[0][1]["source"] == "reward.fn=tests.test_data_rewards:raising_reward"
        assert "boom" in out[0][1]["error"]
        assert r.stats.failures == 2 and "boom" in r.stats.last_error
    finally:
        r.close()
    r = RewardRunner("tests.test_data_rewards:hanging_reward", timeout_s=0.5)
    try:
        out = r.score([("a", None, {}), ("hang", None, {}), ("b", None, {})])
        assert out[0] == (1.0, None) and out[2] == (1.0, None)
        assert out[1][1]["kind"] == "reward_timeout" and "reward.timeout_s=0.5" in out[1][1]["error"]
        assert r.stats.timeouts == 1
    finally:
        r.close()


def test_unknown_reward_name_lists_valid():
    with pytest.raises(ValueError, match="math, exact"):
        RewardRunner("maths")
