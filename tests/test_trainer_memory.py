"""benchmarks/trainer_memory.py: every requested configuration a row, each cell measured in its own
process, a TrainerCfg field this version lacks read as such."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _module():
    sys.path.insert(0, str(BENCH))
    try:
        import trainer_memory

        return trainer_memory
    finally:
        sys.path.remove(str(BENCH))


def test_fields_this_version_lacks_are_told_apart_from_bad_values(monkeypatch):
    from pydantic import ConfigDict, create_model

    from relayrl.config import TrainerCfg

    tm = _module()
    takes, lacking, dropped = tm.plan({"share_prefix": False, "bf16": True, "no_such_feature": 3}, 1024)
    assert takes == {"share_prefix": False, "bf16": True} and dropped == ["no_such_feature"] and not lacking
    assert tm.plan({"pack": True}, 1024) == ({"pack": True}, [], [])  # this version has every feature

    # a version of relayrl before trainer.pack (the script runs against older checkouts): its TrainerCfg without it
    older = create_model("TrainerCfg", __config__=ConfigDict(extra="forbid"),
                         **{k: (f.annotation, f) for k, f in TrainerCfg.model_fields.items() if k != "pack"})
    monkeypatch.setattr("relayrl.config.TrainerCfg", older)
    assert tm.plan({"pack": True, "bf16": True}, 1024)[1] == ["pack"]  # an 'on' row that needs it cannot run
    assert tm.plan({"pack": False, "bf16": True}, 1024)[2] == ["pack"]  # off: left out, the row runs without it
    with pytest.raises(Exception, match="micro_batch_tokens"):
        tm.plan({"micro_batch_tokens": 0}, 1024)  # a known field's bad value is an error, not "unavailable"
    names = [n for n, _ in tm.configurations(1024, ["float32", "bf16"])]
    assert len(names) == 10 and "bf16 · logprob_chunk_tokens=1024" in names and "float32 · all on" in names


@pytest.mark.slow
def test_the_script_end_to_end_at_tiny_scale(tmp_path):
    configs = ["all off", "gradient_checkpointing=on"]
    p = subprocess.run([sys.executable, str(BENCH / "trainer_memory.py"), "--model-scale", "tiny",
                        "--lengths", "128", "160",
                        "--precisions", "float32", "--configs", *configs, "--steps", "1", "--longtail-rows", "4",
                        "--longtail-length", "192", "--out", str(tmp_path), "--name", "t"],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    data = json.loads((tmp_path / "t.json").read_text())
    rows = {r[0]: r[1:] for r in data["table"]["rows"]}
    assert [n for n in rows if "long tail" not in n] == [f"float32 · {c}" for c in configs]
    header = data["table"]["header"]
    assert header[1:3] == ["L=128 (2 rows)", "L=160 (2 rows)"] and header[3].startswith("peak GiB per 1k tokens")
    assert re.match(r"^-?[\d.]+$", rows["float32 · all off"][2]) and rows["float32 · all off"][3] in ("1.00x", ""), rows
    number = re.compile(r"^[\d.]+ GiB, [\d,]+ tok/s$")
    assert number.match(rows["float32 · all off"][1]), rows
    assert number.match(rows["float32 · gradient_checkpointing=on"][1]), rows  # (this version has the feature)
    r = data["results"]["float32 · all off/160"]
    assert r["tokens"] == 2 * 160 and r["rows"] == 2 and r["peak_gib"] > r["cpu_rss_before_model_gib"] > 0
    padded = [n for n in rows if "padded" in n]
    assert padded and "padding" in rows[padded[0]][0] and any("packed" in n for n in rows)


def test_a_check_of_a_benchmark_leaves_the_committed_results_alone(tmp_path, monkeypatch):
    """``--scale tiny`` and the like (a check of the script) wrote over benchmarks/results' tables: their folder
    is a new temporary one now; a measurement's is benchmarks/results beside the scripts, from any folder."""
    _module()
    import common

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    checked = common.results_dir(None, check=True)
    assert checked.parent == tmp_path and checked.is_dir() and not any(checked.iterdir())
    monkeypatch.chdir(tmp_path)
    assert common.results_dir(None) == BENCH / "results" and common.results_dir("x") == Path("x")
