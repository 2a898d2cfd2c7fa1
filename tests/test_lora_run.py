"""LoRA runs end to end (``model.lora.r``): the engines sample the trained adapter at every step (the
trainer's and the engine's log-probs agree), checkpoints hold the adapter in PEFT's files, ``relayrl
export --merge`` writes a plain model, ``relayrl eval --checkpoint`` takes an adapter checkpoint."""

import json
from pathlib import Path

import pytest
import torch

from relayrl.cli import main
from relayrl.config import load_config
from relayrl.run.loop import train
from tests.test_e2e import EASY


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "periodic"], ids=["sync", "periodic-two-engine-processes"])
def test_a_lora_run_samples_the_trained_adapter_and_saves_it_for_the_ecosystem(tiny_path, tmp_path, mode, capsys):
    """sync: the engine in-process; periodic: two engine processes behind the router, each taking the adapter."""
    over = [o for o in EASY if not o.startswith("trainer.lr")]  # (the adapter's own default lr)
    cfg = load_config(None, [*over, f"model.path={tiny_path}", f"run.output_dir={tmp_path}", "run.steps=4",
                             "run.save_every=2", "model.lora.r=4", "algo.kl_coef=0.05", f"run.mode={mode}",
                             *(["rollout.engines=2"] if mode == "periodic" else [])])
    assert cfg.trainer.lr == pytest.approx(1e-3)
    train(cfg)
    m = _metrics(cfg.run_dir)
    assert all(x["grad_norm"] > 0 for x in m) and m[-1]["kl"] > 0  # the adapter moved off the base
    # the engine samples the policy the trainer has: its log-probs are the trainer's at every step (an adapter
    # not applied, or applied twice, would part them from the second step on)
    checked = [x["logprob_mismatch_mean"] for x in m if x["logprob_mismatch_mean"] is not None]  # (None: no token
    assert len(checked) >= 3 and all(v < 1e-3 for v in checked), checked  # of a version it still has: periodic's 1st)
    ckpt = cfg.run_dir / "checkpoints" / "step_000004"
    names = {p.name for p in ckpt.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md", "trainer.pt", "tokenizer.json"} <= names
    assert "model.safetensors" not in names and "config.json" not in names  # the adapter only
    # eval --checkpoint: the base in the engine(s), the adapter loaded into it, as the run's config says
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(ckpt), "data.eval_path=builtin:demo-eval", "eval.size=8"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert 0 <= result["accuracy"] <= 1
    if mode == "periodic":
        return
    # export --merge: a plain model whose logits are the base's with the adapter on
    out = tmp_path / "merged"
    assert main(["export", str(ckpt), "--merge", str(out)]) == 0
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(out)
    assert not any("lora" in k for k in merged.state_dict())
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_path), str(ckpt)).eval()
    ids = torch.tensor([[1, 5, 9, 20, 33, 7]])
    with torch.no_grad():
        want, got = peft(input_ids=ids).logits, merged(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(tiny_path)(input_ids=ids).logits
    assert torch.allclose(want, got, atol=1e-5) and not torch.allclose(base, got, atol=1e-4)


def test_export_of_a_folder_without_an_adapter_is_a_model_error(tiny_path, tmp_path, capsys):
    assert main(["export", tiny_path, "--merge", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "relayrl: model error:" in err and "no LoRA adapter there (adapter_config.json)" in err


def test_resume_refuses_another_adapter(tiny_path):
    from relayrl.run.resume import ResumeError, check_compatible

    saved = load_config(None, [f"model.path={tiny_path}", "model.lora.r=4"]).model_dump(mode="json")
    for change in (["model.lora.r=8"], ["model.lora.r=0", "trainer.lr=1e-3"], ["model.lora.r=4", "model.lora.alpha=8"]):
        with pytest.raises(ResumeError, match="model.lora was .* the checkpoint holds that adapter"):
            check_compatible(saved, load_config(None, [f"model.path={tiny_path}", *change]), "", "", Path("ckpt"))
    check_compatible(saved, load_config(None, [f"model.path={tiny_path}", "model.lora.r=4"]), "", "", Path("ckpt"))


def test_eval_takes_an_adapter_peft_saved_itself(tiny_path, tmp_path, capsys):
    """An adapter from elsewhere (``PeftModel.save_pretrained``: no tokenizer, PEFT's full adapter_config.json):
    ``relayrl eval model.path=ADAPTER`` loads its base, the base's tokenizer, and the adapter into the engine."""
    from relayrl.config.sections import LoraCfg
    from relayrl.models import load_policy
    from relayrl.train import lora

    model, _ = lora.wrap(load_policy(tiny_path), LoraCfg(r=2, targets=["q_proj", "v_proj"]))
    model.save_pretrained(tmp_path / "adapter")
    assert not (tmp_path / "adapter" / "tokenizer.json").exists()
    capsys.readouterr()
    assert main(["eval", f"model.path={tmp_path / 'adapter'}", "data.eval_path=builtin:demo-eval", "eval.size=4",
                 f"run.output_dir={tmp_path}"]) == 0
    assert 0 <= json.loads(capsys.readouterr().out)["accuracy"] <= 1
