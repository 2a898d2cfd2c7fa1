"""`relayrl push CHECKPOINT REPO_ID`: a checkpoint's model files to the hub through huggingface_hub's own client,
tested against a stand-in of the hub's HTTP API on loopback (``tests/hub_server.py``): the model, tokenizer and
card arrive, the run's own state (state.json, the optimiser's trainer.pt) does not, and the pushed folder loads."""

from relayrl.cli import main
from tests.hub_server import HubServer


def test_a_checkpoint_is_pushed_without_the_runs_own_state(tiny_path, tmp_path, monkeypatch, capsys):
    import shutil

    ckpt = tmp_path / "runs" / "demo" / "checkpoints" / "step_000002"
    shutil.copytree(tiny_path, ckpt)
    (ckpt / "state.json").write_text('{"step": 2}')
    (ckpt / "trainer.pt").write_bytes(b"optimiser state")
    (ckpt / "README.md").write_text("---\nlibrary_name: transformers\n---\n# a card\n")
    with HubServer() as url:
        server = HubServer.last
        monkeypatch.setenv("HF_TOKEN", "hf_test_token")
        import huggingface_hub.constants as constants

        monkeypatch.setattr(constants, "ENDPOINT", url)
        monkeypatch.setenv("HF_ENDPOINT", url)
        assert main(["push", str(tmp_path / "runs" / "demo"), "me/tiny", "--private"]) == 0  # (a run: its newest)
    out = capsys.readouterr().out
    assert out.strip().startswith(f"{url}/me/tiny/commit/")
    repo = server.repos["me/tiny"]
    assert repo["private"] and repo["commits"] == ["relayrl: step_000002 of demo"]
    assert {"config.json", "model.safetensors", "README.md", "tokenizer.json"} <= set(repo["files"])
    assert not {"state.json", "trainer.pt"} & set(repo["files"])
    assert repo["files"]["model.safetensors"] == (ckpt / "model.safetensors").read_bytes()
    assert all(t == "Bearer hf_test_token" for t in server.tokens)
    pulled = tmp_path / "pulled"
    pulled.mkdir()
    for name, data in repo["files"].items():
        (pulled / name).write_bytes(data)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(pulled)


def test_a_folder_without_weights_is_refused(tmp_path, capsys):
    (tmp_path / "x").mkdir()
    assert main(["push", str(tmp_path / "x"), "me/x"]) == 2
    assert "no model weights (*.safetensors) to push" in capsys.readouterr().err
