"""relayrl sft: the supervised tokens of demonstrations under a chat template (data/sft.py), the supervised
step (Trainer.sft_step), and the command end to end (run/sft.py)."""

import copy
import gzip
import json
import re
import subprocess
import sys

import pytest
import torch

from relayrl.data.datasets import DataError
from relayrl.data.sft import encode_conversation, load_examples
from relayrl.demo import model as demo_model

# a template that puts tokens around every turn (ChatML's shape), tool calls and tool results included
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}<tool_call>{{ c['function']['name'] }}"
    "({{ c['function']['arguments'] }})</tool_call>{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tok():
    t = demo_model.build_tokenizer(demo_model.RECIPE["seed"], 300)
    t.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    t.chat_template = CHATML
    return t


def _supervised_text(tok, ex) -> list[str]:
    """The supervised spans of an example, decoded."""
    spans, cur = [], []
    for i, m in zip(ex.response_ids, ex.mask):
        if m:
            cur.append(i)
        elif cur:
            spans.append(cur)
            cur = []
    spans += [cur] if cur else []
    return [tok.decode(s) for s in spans]


def test_only_the_assistants_turns_are_supervised_with_their_end_of_turn(tok):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Add 1 2"},
            {"role": "assistant", "content": "3"}, {"role": "user", "content": "and 4?"},
            {"role": "assistant", "content": "7"}]
    [ex] = encode_conversation(tok, msgs, "r1", "f: line 1")
    # the header the generation prompt writes is context; the turn's text and its end of turn are supervised
    assert _supervised_text(tok, ex) == ["3<|im_end|>\n", "7<|im_end|>\n"]
    full = tok.decode(ex.prompt_ids + ex.response_ids)
    assert full == tok.apply_chat_template(msgs, tokenize=False)
    assert tok.decode(ex.prompt_ids).endswith("<|im_start|>assistant\n")


def test_tool_calls_are_supervised_and_tool_results_are_not(tok):
    call = {"type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    msgs = [{"role": "user", "content": "Add 1 2"}, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "content": "3", "tool_call_id": "c1"}, {"role": "assistant", "content": "It is 3."}]
    rows = [{"id": "a", "messages": msgs}]
    path = _write(rows)
    [ex] = load_examples(str(path), tok)
    sup = _supervised_text(tok, ex)
    assert sup == ['<tool_call>add({"a": 1})</tool_call><|im_end|>\n', "It is 3.<|im_end|>\n"]
    assert "3<|im_end|>" in tok.decode([i for i, m in zip(ex.response_ids, ex.mask) if not m])  # (the result: context)


def test_a_template_that_rewrites_earlier_turns_gives_one_example_per_turn(tok):
    t = copy.deepcopy(tok)  # (drops earlier assistant turns' text, as Qwen3's drops earlier reasoning)
    t.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] != 'assistant' or "
                       "loop.last %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
                       "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"},
            {"role": "assistant", "content": "d"}]
    exs = encode_conversation(t, msgs, "r", "f: line 1")
    assert [e.id for e in exs] == ["r#0", "r#1"]
    assert [_supervised_text(t, e) for e in exs] == [["b<|im_end|>\n"], ["d<|im_end|>\n"]]


def _write(rows, name="d.jsonl"):
    import tempfile
    from pathlib import Path

    p = Path(tempfile.mkdtemp()) / name
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def test_prompt_and_response_fields(tok):
    p = _write([{"id": "x", "q": "Add 1 2", "a": "3"}])
    [ex] = load_examples(str(p), tok, prompt_field="q", response_field="a")
    assert _supervised_text(tok, ex) == ["3<|im_end|>\n"]


@pytest.mark.parametrize("row, says", [
    ({"id": "x", "prompt": "Add 1 2", "response": ""}, "line 1: field 'response' (data.response_field) must be a "
                                                       "non-empty string"),
    ({"id": "x", "prompt": [{"role": "user", "content": "hi"}]}, "line 1: no assistant turn"),
    ({"id": "x", "prompt": "hi"}, "line 1: field 'prompt' is a string but the row has no field 'response'"),
    ({"id": "x", "text": "hi"}, "line 1: missing field 'prompt'"),
    ({"id": "x", "messages": [{"role": "robot", "content": "hi"}]}, "message 1: role 'robot' is not one of"),
])
def test_bad_rows_are_one_line_naming_the_file_and_row(tok, row, says):
    p = _write([row])
    with pytest.raises(DataError, match=re.escape(says)) as e:
        load_examples(str(p), tok)
    assert str(p) in str(e.value) and "\n" not in str(e.value)


def test_raw_prompt_format_supervises_the_response_and_eos(tok):
    p = _write([{"id": "x", "prompt": "Add 1 2 =", "response": " 3"}])
    [ex] = load_examples(str(p), tok, prompt_format="raw")
    assert ex.response_ids[-1] == tok.eos_token_id and all(ex.mask)
    assert tok.decode(ex.response_ids[:-1]) == " 3"


def test_rollout_records_are_examples_filtered_by_reward(tmp_path, tok):
    folder = tmp_path / "run" / "rollouts"
    folder.mkdir(parents=True)
    recs = [{"id": "g0/0", "prompt": [{"role": "user", "content": "a"}], "prompt_ids": [5, 6], "response_ids": [7, 8],
             "reward": 1.0, "status": "trained", "failure": None},
            {"id": "g0/1", "prompt": [{"role": "user", "content": "a"}], "prompt_ids": [5, 6], "response_ids": [9],
             "reward": 0.0, "status": "trained", "failure": None},
            {"id": "g0/2", "prompt": [], "prompt_ids": [5, 6], "response_ids": [7, 8], "reward": 1.0,
             "status": "filtered", "failure": None},  # (the same tokens again: once)
            {"id": "g0/3", "prompt": [], "prompt_ids": [5], "response_ids": [4], "reward": float("nan"),
             "status": "failed", "failure": {"kind": "verifier"}},
            {"id": "g1/0", "prompt": [], "prompt_ids": [1], "response_ids": [2, 3, 4], "mask": [1, 0, 1],
             "reward": 2.0, "status": "trained", "failure": None}]
    with gzip.open(folder / "step_000001.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in recs)
    said = []
    exs = load_examples(str(tmp_path / "run"), tok, min_reward=0.5, log=said.append)
    assert [(e.prompt_ids, e.response_ids, e.mask) for e in exs] == [([5, 6], [7, 8], [1, 1]), ([1], [2, 3, 4], [1, 0, 1])]
    eval_file = tmp_path / "eval_samples.jsonl"  # (relayrl eval's samples: the same records, one file)
    eval_file.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert len(load_examples(str(eval_file), tok, min_reward=0.5)) == 2
    assert "2 episodes of 5" in said[0] and "1 failed, 1 below data.min_reward=0.5, 1 repeated" in said[0]
    assert len(load_examples(str(folder), tok)) == 3  # (the rollouts folder itself; no filter: the 0.0 one too)
    with pytest.raises(DataError, match="data.min_reward=0.5 filters episodes' records"):
        load_examples(str(_write([{"prompt": "a", "response": "b"}])), tok, min_reward=0.5)


# -- the command -----------------------------------------------------------------------------------------

SMALL = ["sft.batch_size=8", "trainer.micro_batch_tokens=256", "run.progress=false", "eval.size=8",
         "rollout.max_new_tokens=24", "run.threads=1"]


def _cli(*args, env=None, cwd=None):
    import os

    return subprocess.run([sys.executable, "-m", "relayrl.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, cwd=cwd, timeout=600)


def _metrics(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_sft_learns_checkpoints_load_and_a_killed_run_resumes_exactly(tiny_path, tmp_path):
    """The demonstrations' loss falls; a run killed after its step-4 checkpoint resumes to the same weights and
    metrics as one never killed; its checkpoint is taken by relayrl train and relayrl eval as it is."""
    args = [f"model.path={tiny_path}", *SMALL, "run.steps=8", "run.save_every=2", "trainer.lr=3e-3", "run.name=sft"]
    whole = _cli("sft", *args, f"run.output_dir={tmp_path / 'a'}", cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr
    m = _metrics(tmp_path / "a" / "sft")
    assert [r["step"] for r in m] == list(range(1, 9)) and m[-1]["loss"] < m[0]["loss"] - 0.5
    assert m[0]["supervised_tokens"] > 0 and "held-out accuracy" in whole.stdout
    # killed as step 7 starts (the step-4 checkpoint written, the step-6 one perhaps), then resumed
    killed = _cli("sft", *args, f"run.output_dir={tmp_path / 'b'}", env={"RELAYRL_KILL_AT": "train:7"}, cwd=tmp_path)
    assert killed.returncode == -9
    resumed = _cli("sft", *args, f"run.output_dir={tmp_path / 'b'}", "--resume", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout
    m2 = _metrics(tmp_path / "b" / "sft")
    assert [r["step"] for r in m2] == list(range(1, 9))
    assert [r["loss"] for r in m2] == pytest.approx([r["loss"] for r in m], rel=1e-5)
    from safetensors.torch import load_file

    a = load_file(tmp_path / "a" / "sft" / "checkpoints" / "step_000008" / "model.safetensors")
    b = load_file(tmp_path / "b" / "sft" / "checkpoints" / "step_000008" / "model.safetensors")
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    ckpt = tmp_path / "a" / "sft" / "checkpoints" / "step_000008"
    card = (ckpt / "README.md").read_text()
    assert "fine-tuned on demonstrations" in card and "relayrl sft config.yaml" in card
    ev = _cli("eval", "--checkpoint", str(ckpt), "eval.size=4", "run.threads=1", cwd=tmp_path)
    assert ev.returncode == 0, ev.stderr
    assert json.loads(ev.stdout)["prompts"] == 4
    rl = _cli("train", f"model.path={ckpt}", "run.steps=1", "data.eval_path=null", "rollout.prompts_per_step=2",
              "rollout.group_size=2", "rollout.max_new_tokens=8", "run.progress=false", "run.threads=1",
              f"run.output_dir={tmp_path / 'rl'}", cwd=tmp_path)
    assert rl.returncode == 0, rl.stderr


@pytest.mark.slow
def test_fields_a_command_does_not_read_are_refused(tmp_path):
    out = _cli("sft", "algo.kl_coef=0.1", cwd=tmp_path)
    assert out.returncode == 2 and "algo.kl_coef is set, but relayrl sft does not read it" in out.stderr
    out = _cli("train", "sft.epochs=2", cwd=tmp_path)
    assert out.returncode == 2 and "sft.epochs is set, but it only applies to relayrl sft" in out.stderr
    out = _cli("train", "data.min_reward=1", cwd=tmp_path)
    assert out.returncode == 2 and "data.min_reward is set, but it only applies to relayrl sft" in out.stderr


def test_a_follower_rank_resolves_sft_epochs_as_rank_0_does(tiny_path, tmp_path, monkeypatch):
    """relayrl sft under torchrun with sft.epochs: follower ranks built their learning-rate schedule from the
    unresolved run.steps (80), rank 0 from the epochs (here 3 steps): rank 0 decayed to 0 while the others stayed
    near the peak. A follower now counts the same examples."""
    from relayrl.config import load_config
    from relayrl.config.commands import sft_defaults
    from relayrl.run import sft as sft_module
    from relayrl.train import distributed

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"say {i}", "response": f"{i}"}) + "\n" for i in range(10)))
    cfg = load_config(None, [f"model.path={tiny_path}", f"data.path={data}", "data.eval_path=null", "sft.epochs=1",
                             "sft.batch_size=4", "trainer.schedule=linear", "trainer.warmup_steps=0"])
    got = {}
    monkeypatch.setattr(distributed, "is_follower", lambda tcfg: True)
    monkeypatch.setattr(distributed, "run_follower", lambda trainer: got.setdefault("trainer", trainer))
    monkeypatch.setattr(sft_module, "sft_trainer", lambda cfg, policy, steps: {"steps": steps})
    sft_module.sft(sft_defaults(cfg))
    assert got["trainer"] == {"steps": 3}  # ⌈1 epoch × 10 examples / 4⌉, as rank 0 resolves it (not run.steps 80)


def test_sft_counts_the_free_cores_as_relayrl_train_does(tiny_path, tmp_path, monkeypatch):
    """relayrl sft left torch's thread count at its default: beside a busy neighbour its steps took 14x longer."""
    import io

    from rich.console import Console

    from relayrl.config import load_config
    from relayrl.config.commands import sft_defaults
    from relayrl.run import sft as sft_module

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"say {i}", "response": f"{i}"}) + "\n" for i in range(8)))
    monkeypatch.setattr(sft_module, "free_cores", lambda: 1)  # (a neighbour keeps the other core busy)
    before, out = torch.get_num_threads(), io.StringIO()
    cfg = load_config(None, [f"model.path={tiny_path}", f"data.path={data}", "data.eval_path=null", "run.steps=1",
                             "sft.batch_size=4", f"run.output_dir={tmp_path}", "run.progress=false"])
    try:
        sft_module.sft(sft_defaults(cfg), console=Console(file=out, width=200))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert "threads: 1 (" in out.getvalue()


def test_a_conversation_opening_with_an_assistant_turn_is_a_data_error_naming_the_row(tok, tmp_path):
    """It crashed in the trainer with a tensor-shape error."""
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]})
                 + "\n" + json.dumps({"messages": [{"role": "assistant", "content": "hi"},
                                                   {"role": "user", "content": "x"},
                                                   {"role": "assistant", "content": "y"}]}) + "\n")
    with pytest.raises(DataError, match=rf"{f}: line 2: field 'messages': the conversation opens with an assistant "
                                        "turn"):
        load_examples(str(f), tok, "prompt", "response", "id", "chat", None, None, print)
