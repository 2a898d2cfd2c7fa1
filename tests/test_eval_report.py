"""``relayrl eval`` writes eval.json and every response (eval_samples.jsonl) beside the checkpoint,
with pass@k for --samples K; pass@k is Chen et al.'s unbiased estimator."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from relayrl.cli import main
from relayrl.run.evaluation import pass_at_k
from relayrl.records import Prompt, Trajectory


def test_pass_at_k_by_hand():
    def group(gid: str, rewards: list[float]) -> list[Trajectory]:
        p = Prompt(gid, [{"role": "user", "content": "x"}])
        return [Trajectory(p, gid, i, [1], reward=r) for i, r in enumerate(rewards)]

    # prompt a: 1 of 4 right; b: 2 of 4; c: 0.5 is partial credit, not a pass
    got = pass_at_k(group("a", [1, 0, 0, 0]) + group("b", [0, 1, 1, 0]) + group("c", [0.5] * 4), 4)
    assert got == pytest.approx({"pass_at_1": (1 / 4 + 2 / 4 + 0) / 3,
                                 "pass_at_2": ((1 - 3 / 6) + (1 - 1 / 6) + 0) / 3,  # 1 - C(n-c,2)/C(4,2)
                                 "pass_at_4": (1 + 1 + 0) / 3})
    assert set(pass_at_k(group("a", [1, 0, 1, 0, 0]), 5)) == {"pass_at_1", "pass_at_2", "pass_at_4", "pass_at_5"}


@pytest.mark.slow
def test_relayrl_eval_writes_its_report_beside_the_checkpoint(tiny_path, tmp_path, capsys):
    ckpt = tmp_path / "step_000010"
    shutil.copytree(tiny_path, ckpt)
    args = ["data.eval_path=builtin:demo-eval", "eval.size=4", "reward.fn=tests.rewards_for_tests:digit_fraction",
            "rollout.max_new_tokens=8", f"run.output_dir={tmp_path / 'runs'}"]
    assert main(["eval", "--checkpoint", str(ckpt), "--samples", "3", *args]) == 0
    printed = json.loads(capsys.readouterr().out)
    report = json.loads((ckpt / "eval.json").read_text())
    assert report["result"] == printed and report["model"] == str(ckpt) and report["samples"] == 3
    assert {"pass_at_1", "pass_at_2", "pass_at_3"} <= set(printed)
    lines = [json.loads(x) for x in (ckpt / "eval_samples.jsonl").read_text().splitlines()]
    sampled = [x for x in lines if x["kind"] == "sampled"]
    assert len(sampled) == 4 * 3 and len(lines) == 4 * 3 + 4  # and one greedy response a prompt
    assert sum(x["reward"] for x in sampled) / 12 == pytest.approx(printed["reward_mean"])  # (partial credit)
    assert sum(x["reward"] >= 1 for x in sampled) / 12 == pytest.approx(printed["accuracy"])  # (successes)
    for x in lines:
        assert x["prompt"][0]["role"] == "user" and isinstance(x["completion"], str)
        assert x["finish_reason"] in ("stop", "length") and x["response_tokens"] <= 8
    assert not (tmp_path / "runs").exists()
    out = tmp_path / "elsewhere"
    assert main(["eval", "--checkpoint", str(ckpt), "-o", str(out), *args]) == 0
    assert json.loads((out / "eval.json").read_text())["samples"] == 1 and (out / "eval_samples.jsonl").is_file()


def test_model_card_names_a_hub_base_model_and_says_which_checkpoint_it_is(tmp_path):
    from huggingface_hub import ModelCard

    from relayrl.config import load_config, resolved_tree
    from relayrl.run.model_card import render

    tree = resolved_tree(load_config(None, ["model.path=Qwen/Qwen2.5-0.5B-Instruct", "run.steps=10"]))
    before = {"accuracy": 0.25, "accuracy_greedy": 0.5, "temperature": 1.0}
    early = ModelCard(render(tree, 4, 256, before, None))
    assert early.data.base_model == "Qwen/Qwen2.5-0.5B-Instruct" and "step 4 of 10 (an intermediate" in early.text
    assert [r.metric_value for r in early.data.eval_results] == [0.25, 0.5]
    stopped = ModelCard(render(tree, 4, 256, before, {**before, "accuracy": 0.75}, final=True))  # (eval.stop_at)
    assert "intermediate" not in stopped.text and "25.0% before → 75.0% after" in stopped.text
    local = ModelCard(render(resolved_tree(load_config(None, [f"model.path={tmp_path}"])), 1, 8, None, None))
    assert local.data.base_model is None and local.data.eval_results is None and f"`{tmp_path}`" in local.text


def test_model_card_of_an_adapter_says_so():
    from huggingface_hub import ModelCard

    from relayrl.config import load_config, resolved_tree
    from relayrl.run.model_card import render

    tree = resolved_tree(load_config(None, ["model.path=Qwen/Qwen2.5-0.5B-Instruct", "model.lora.r=8"]))
    card = ModelCard(render(tree, 4, 256, None, None))
    assert card.data.library_name == "peft" and card.data.base_model == "Qwen/Qwen2.5-0.5B-Instruct"
    assert "LoRA, rank 8, alpha 32.0" in card.text
    full = ModelCard(render(resolved_tree(load_config(None, [])), 4, 256, None, None))
    assert full.data.library_name == "transformers" and "LoRA" not in full.text
    # a base that is no hub id: the card says where it comes from (an adapter is nothing without it)
    demo = ModelCard(render(resolved_tree(load_config(None, ["model.lora.r=8"])), 4, 256, None, None))
    assert demo.data.base_model is None and "rebuilt by `relayrl build-demo-model OUT`" in demo.text
    assert "finds the base again from state.json" in demo.text and "state.json" not in full.text


@pytest.mark.parametrize("fails_at", ["load_weights", "make_runner"])
def test_evaluate_only_closes_its_engine_when_the_adapter_or_the_runner_fails(tiny_path, fails_at, monkeypatch):
    """An engine (a vLLM core, an engine process) opened for ``relayrl eval`` is closed whatever fails after it."""
    import relayrl.run.build as build
    from relayrl.config import load_config
    from relayrl.train import lora

    closed = []

    class Engine:
        def load_weights(self, adapter, version):
            raise RuntimeError("the adapter does not load")

        def close(self):
            closed.append(True)

    def no_runner(*a, **k):
        raise RuntimeError("the runner cannot start")

    monkeypatch.setattr(build, "open_engine", lambda *a, **k: Engine())
    if fails_at == "load_weights":  # (a LoRA checkpoint: its base in the engine, then the adapter)
        monkeypatch.setattr(lora, "read_adapter", lambda path: (None, path, {"weights": 1}))
    else:
        monkeypatch.setattr(build, "make_runner", no_runner)
    data = Path(__file__).parent / "data_small.jsonl"
    cfg = load_config(overrides=[f"model.path={tiny_path}", f"data.eval_path={data}", "eval.size=2",
                                 "reward.fn=exact"])
    with pytest.raises(RuntimeError, match="does not load" if fails_at == "load_weights" else "cannot start"):
        build.evaluate_only(cfg)
    assert closed == [True]


def test_the_model_cards_numbers_carry_no_float_noise():
    from relayrl.config import load_config, resolved_tree
    from relayrl.run.model_card import render

    e = {"accuracy": 0.33999999999999997, "accuracy_greedy": 0.1 + 0.2, "temperature": 1.0}
    card = render(resolved_tree(load_config(None, [])), 3, 96, e, e, final=True)
    assert "value: 0.34\n" in card and "value: 0.3\n" in card
    assert "0.33999999999999997" not in card and "0.30000000000000004" not in card


def test_partial_credit_is_called_mean_reward_and_accuracy_counts_successes():
    """A verifier giving partial credit: eval.json said "accuracy 0.336" beside pass@1 0.2625 — the mean reward
    under accuracy's name. Now accuracy counts rewards ≥ 1 (pass@k's threshold) and the mean reward is named."""
    from huggingface_hub import ModelCard

    from relayrl.config import load_config, resolved_tree
    from relayrl.run.evaluation import fmt_change, fmt_eval
    from relayrl.run.model_card import render

    binary = {"accuracy": 0.25, "accuracy_greedy": 0.5, "reward_mean": 0.25, "reward_mean_greedy": 0.5,
              "temperature": 1.0}
    partial = {"accuracy": 0.2625, "accuracy_greedy": 0.3, "reward_mean": 0.336, "reward_mean_greedy": 0.41,
               "temperature": 1.0}
    assert fmt_eval(binary) == "accuracy 25.0% (sampled, T=1.0), greedy 50.0%"
    assert fmt_eval(partial) == "accuracy 26.2% (sampled, T=1.0), greedy 30.0%; mean reward 0.336, greedy 0.410"
    assert fmt_change(binary, partial) == ("held-out accuracy: 25.0% → 26.2% (greedy 50.0% → 30.0%); mean reward "
                                           "0.250 → 0.336 (greedy 0.500 → 0.410)")
    card = ModelCard(render(resolved_tree(load_config(None, [])), 3, 96, binary, partial, final=True))
    assert [(r.metric_type, r.metric_value) for r in card.data.eval_results] == [
        ("accuracy", 0.25), ("accuracy", 0.5),  # before: 0/1 rewards, the mean is the accuracy (not repeated)
        ("accuracy", 0.2625), ("mean_reward", 0.336), ("accuracy", 0.3), ("mean_reward", 0.41)]
