"""run.mismatch_alarm: a run whose engine stops taking the trained weights stops at the first step after,
with one line naming the step and version; a correct run (float32 or a bfloat16 engine) never does."""

import dataclasses
import json

import pytest
import torch

from relayrl.cli import main
from relayrl.engine import hf
from relayrl.engine.base import PolicyMismatch
from relayrl.run.loop import check_sampling
from tests.test_e2e import EASY

ALARM = 0.05


def _m(mean=None, check=None, prev=None):
    return {"step": 3, "logprob_mismatch_mean": mean, "logprob_mismatch_max": None if mean is None else 2 * mean,
            "logprob_mismatch_tokens": 120, "logprob_mismatch_check": check, "logprob_mismatch_check_prev_weights": prev}


@pytest.mark.parametrize("m, fires", [
    (_m(3e-7, 3e-7, 3e-3), False),  # a float32 engine
    (_m(2e-3, 6e-3, 5e-3), False),  # a bfloat16 engine: its noise above a tenth of the alarm, but not closer to v-1
    (_m(2e-3, 2e-3, 2e-3), False),  # an update that moved nothing: as close to both
    (_m(0.06), True),  # (a) too far apart on average
    (_m(5e-3, 5.4e-3, 2.8e-7), True),  # (b) closer to the previous version's weights
    (_m(5e-3, 4e-3, 1e-4), False),  # (b) closer to v-1, but within a tenth of the alarm: numerics
    (_m(None), False),  # nothing checkable (every token stale, a step of failed episodes only)
])
def test_the_rule(m, fires):
    if fires:
        with pytest.raises(PolicyMismatch, match=r"^the engine is not sampling the trained policy: at step 3 \(policy "
                                                 r"version 2\)"):
            check_sampling(m, ALARM, 2)
    else:
        check_sampling(m, ALARM, 2)
    check_sampling({**m, "logprob_mismatch_mean": 1.0, "logprob_mismatch_check": 1.0}, 0.0, 2)  # 0: never


def _args(tiny_path, tmp_path, *extra):
    return ["train", *EASY, f"model.path={tiny_path}", f"run.output_dir={tmp_path}", "run.name=a", "run.steps=5",
            "trainer.warmup_steps=0", "run.progress=false", *extra]


@pytest.fixture()
def broken_sync(monkeypatch):
    """The engine keeps the version it is told but stops copying the weights from the 2nd update on."""
    real, calls = hf.copy_weights, [0]

    def skipping(model, state_dict):
        calls[0] += 1
        if calls[0] < 2:
            real(model, state_dict)

    monkeypatch.setattr(hf, "copy_weights", skipping)
    return calls


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["auto", "bfloat16"])
def test_a_broken_sync_stops_the_run_at_the_first_step_after(tiny_path, tmp_path, capsys, broken_sync, dtype):
    assert main(_args(tiny_path, tmp_path, f"rollout.dtype={dtype}")) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("relayrl: sampling error: the engine is not sampling the trained policy: at step 3 (policy "
                          "version 2)") and "\n" not in err, err
    rows = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]  # the step that showed it is written, no step after it
    assert broken_sync[0] == 3  # updates 1, 2 (ignored), 3 (ignored, published before the check)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["auto", "bfloat16"])
def test_a_correct_run_never_stops_and_records_the_check(tiny_path, tmp_path, dtype):
    assert main(_args(tiny_path, tmp_path, f"rollout.dtype={dtype}")) == 0
    rows = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    checked = [r for r in rows if "logprob_mismatch_check" in r]  # (versions 1-3, then every eighth)
    assert len(rows) == 5 and [r["step"] for r in checked] == [2, 3, 4]
    assert all(r["logprob_mismatch_check"] < r["logprob_mismatch_check_prev_weights"] for r in checked), \
        [(r["logprob_mismatch_check"], r["logprob_mismatch_check_prev_weights"]) for r in checked]


def test_sync_training_keeps_no_copy_of_the_weights_between_checks(tiny):
    """The check's cost is a copy of the trainable weights, kept only from the step before a check to it (sync
    mode has no stale tokens that would need it every step): none at versions 3-6, one at 7 (for 8)."""
    from relayrl.config import AlgoCfg, TrainerCfg
    from relayrl.train.trainer import Trainer
    from tests.test_shared_prefix import _groups

    model, tok = tiny
    tr = Trainer(model, TrainerCfg(), AlgoCfg(kl_coef=0), 1.0, 20, 16, check_rows=8)
    batch = _groups(tok)
    kept = []
    for v in range(10):
        tr.step(dataclasses.replace(batch, versions=torch.where(batch.loss_mask.bool(), v, -1)), version=v)
        kept.append(tr.versions.prev is not None)
    assert kept == [True, True, True, False, False, False, False, True, False, False], kept


@pytest.mark.slow
def test_an_adapter_not_applied_stops_a_lora_run_at_the_first_step_after(tiny_path, tmp_path, capsys, monkeypatch):
    """The failure peers report (verl #3516): the engine takes the update, keeps its version, but samples the base
    model; reward flat while the KL grows. Here the adapter's merge into the engine's weights does nothing."""
    from relayrl.engine import adapter

    monkeypatch.setattr(adapter.AdapterMerge, "apply", lambda self, tensors: None)
    over = [o for o in _args(tiny_path, tmp_path) if not o.startswith("trainer.lr")]  # (the adapter's own lr)
    assert main([*over, "model.lora.r=4"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("relayrl: sampling error: the engine is not sampling the trained policy: at step 2 (policy "
                          "version 1)"), err  # the first adapter came with update 1: step 2 sampled without it


def test_tokens_sampled_after_an_in_flight_update_are_not_read_as_that_versions():
    """A row whose engine took new weights mid-row (versions 2, 2, 3, 3) sampled its version-3 tokens over keys and
    values version 2 computed: only whole-context tokens count for either version; off-mask positions (-1, a tool's
    output) do not break a row."""
    from relayrl.train.mismatch import sampled_by

    versions = torch.tensor([[2, 2, 3, 3], [3, 3, 3, -1], [3, -1, 3, 3], [1, 2, 2, 3]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 0, 1, 1], [1, 1, 1, 1]], dtype=torch.float32)
    assert sampled_by(versions, mask, 3).tolist() == [[0, 0, 0, 0], [1, 1, 1, 0], [1, 0, 1, 1], [0, 0, 0, 0]]
    assert sampled_by(versions, mask, 2).tolist() == [[1, 1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    assert sampled_by(versions, mask, 1).tolist() == [[0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]]
