"""Past one machine, on this one: a Ray cluster of two nodes (``ray start --head`` and a second ``ray start
--address=...`` with a resource of its own, ``ray.engine_resources`` placing the engines there, the trainer in the
driver) and FSDP2 under ``torchrun --nnodes 2`` (two single-process "nodes" on loopback, gloo)."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from tests.test_distributed import E2E

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow
# (the cluster's control store notices a node gone after 2 missed checks a second apart, not Ray's 5 × 3 s)
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "RAY_health_check_period_ms": "1000",
           "RAY_health_check_failure_threshold": "2"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    return {**os.environ, **RAY_ENV, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
            "OMP_NUM_THREADS": "1"}


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line), from /proc."""
    out = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                args = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            out[int(d.name)] = (ppid, args)
    return out


def _tree(roots: set[int]) -> set[int]:
    procs, found = _processes(), set(roots)
    while True:
        more = {p for p, (ppid, _) in procs.items() if ppid in found} - found
        if not more:
            return found
        found |= more


def _kill(pids: set[int]) -> None:
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Node:
    """A Ray node started by ``ray start``; ``kill()`` takes it out of the cluster (its raylet and what runs under it)."""

    def __init__(self, port: int, resource: str | None, temp_dir: str | None = None):
        # (the head's own temp dir: its address file there, not in /tmp/ray where a plain ray.init() would find it)
        args = ([f"--address=127.0.0.1:{port}"] if temp_dir is None else
                ["--head", f"--port={port}", "--include-dashboard=false", f"--temp-dir={temp_dir}"])
        if resource:
            args.append(f"--resources={json.dumps({resource: 2})}")
        before = {p for p, (_, a) in _processes().items() if "raylet/raylet" in a}
        proc = subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "start", *args, "--num-cpus=1",
                               "--object-store-memory=100000000", "--disable-usage-stats"],
                              env=_env(), capture_output=True, text=True, timeout=120, check=False)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        (self.raylet,) = {p for p, (_, a) in _processes().items() if "raylet/raylet" in a} - before
        self.id = re.search(r"--node_id=(\w+)", _processes()[self.raylet][1]).group(1)

    def engines(self, kind: str = "EngineActor") -> set[int]:
        """The pids of the engine actors (or the actors of another class) this node runs."""
        procs = _processes()
        return {p for p in _tree({self.raylet}) if p in procs and procs[p][1].startswith(f"ray::{kind}")}

    def kill(self) -> None:
        _kill(_tree({self.raylet}))


@pytest.fixture(scope="module")
def cluster():
    """A head node (nothing of its own) and a second node offering ``rollout`` (2): the engines' node."""
    pytest.importorskip("ray", reason="Ray is part of the dev extra")
    port, temp = _free_port(), tempfile.mkdtemp(prefix="rlmn", dir="/tmp")  # (short: Ray's socket paths)
    try:
        head = Node(port, None, temp_dir=temp)
        second = Node(port, "rollout")
        yield port, head, second
    finally:  # every process of this cluster (never `ray stop`: it stops every cluster of the machine)
        _kill(_tree({p for p, (_, a) in _processes().items() if re.search(rf"(:|port=){port}\b", a)}))
        shutil.rmtree(temp, ignore_errors=True)


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _train(args: list[str], **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "relayrl.cli", "train", *args], env=_env(), cwd=kw.get("cwd"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _run_args(tiny_path, tmp_path, port: int, resource: str, engines: int, steps: int) -> list[str]:
    return [*E2E, f"model.path={tiny_path}", f"run.output_dir={tmp_path}", "run.name=nodes", f"run.steps={steps}",
            "run.backend=ray", f"ray.address=127.0.0.1:{port}", f"ray.engine_resources={{{resource}: 1}}",
            f"rollout.engines={engines}", "rollout.max_new_tokens=16"]


def _when(check, proc: subprocess.Popen, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        if proc.poll() is not None or time.monotonic() > deadline:
            out, err = proc.communicate(timeout=60) if proc.poll() is not None else ("", "")
            pytest.fail(f"{what}: not seen (exit {proc.poll()}): {err[-3000:]}")
        time.sleep(0.05)


def test_engines_on_the_second_node_train_and_survive_being_killed(cluster, tiny_path, tmp_path):
    """The engines run on the second node (the log names it), the policy's updates reach them there, and when both
    are killed mid-run they are started on that node again: the run completes, every prompt trained once."""
    port, head, second = cluster
    p = _train(_run_args(tiny_path, tmp_path, port, "rollout", engines=2, steps=4))
    metrics = tmp_path / "nodes" / "metrics.jsonl"
    try:
        _when(lambda: len(_lines(metrics)) >= 1 and len(second.engines()) == 2, p, 300, "a step, and two engines")
        assert not head.engines()
        assert head.engines("RewardActor") and not second.engines("RewardActor")  # (the verifier's pool: the driver's)
        killed = second.engines()
        _kill(killed)
        out, err = p.communicate(timeout=400)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 0, err[-3000:]
    assert re.search(rf"engines on Ray nodes: [0-9.]+:\d+ \(id {second.id[:8]}\) ×2", out + err), out + err
    assert "weight updates: collective (gloo, 2 ranks" in out + err  # (across the nodes, to each actor)
    rows = _lines(metrics)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[-1]["engine_restarts_total"] == 2, rows[-1]
    assert len(second.engines()) == 0  # (closed with the run)
    trained = _lines(tmp_path / "nodes" / "trained_prompts.jsonl")
    ids = [i for t in trained for i in t["prompt_ids"]]
    assert len(ids) == len(set(ids)) == 4 * 4  # nothing lost, nothing trained twice


def test_a_node_that_leaves_mid_run_is_named_by_its_address(cluster, tiny_path, tmp_path):
    """A third node holds the engine; it leaves the cluster (its raylet and everything under it killed): the run stops
    in one line naming that node's address, not a wait for a node that will not come back."""
    port, _, _ = cluster
    third = Node(port, "doomed")
    p = _train(_run_args(tiny_path, tmp_path, port, "doomed", engines=1, steps=50))
    try:
        _when(lambda: len(_lines(tmp_path / "nodes" / "metrics.jsonl")) >= 1, p, 300, "a step")
        assert not third.engines("RewardActor")  # (a pool placed there would fail with it, read as the user's code)
        third.kill()
        t0 = time.monotonic()
        out, err = p.communicate(timeout=300)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode != 0, out[-2000:]
    line = err.strip().splitlines()[-1]
    assert re.search(rf"its node [0-9.]+:\d+ \(id {third.id[:8]}\) left the Ray cluster", line), err[-3000:]
    assert "no such" not in line and took < 240, (took, line)


def _torchrun_node(rank: int, port: int, args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                             f"--node-rank={rank}", "--master-addr=127.0.0.1", f"--master-port={port}",
                             "-m", "relayrl.cli", "train", *args], env=_env(), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _two_nodes(args: list[str]) -> None:
    port = _free_port()
    procs = [_torchrun_node(r, port, args) for r in (0, 1)]
    try:
        results = [q.communicate(timeout=400) for q in procs]
    finally:
        for q in procs:
            if q.poll() is None:
                os.killpg(q.pid, signal.SIGKILL)
    for q, (_, err) in zip(procs, results):
        assert q.returncode == 0, err[-3000:]


def test_torchrun_two_nodes_train_checkpoint_and_resume_as_one_uninterrupted_run(tiny_path, tmp_path):
    """``torchrun --nnodes 2 --nproc-per-node 1`` twice (a rendezvous on loopback, gloo) with ``trainer.fsdp=true``:
    2 steps and a checkpoint, resumed to 3, end with the weights and metrics of 3 uninterrupted steps."""
    from safetensors.torch import load_file

    base = [*E2E, f"model.path={tiny_path}", f"run.output_dir={tmp_path}", "trainer.fsdp=true"]
    _two_nodes([*base, "run.name=part", "run.steps=2"])
    _two_nodes([*base, "run.name=part", "run.steps=3", "--resume"])
    _two_nodes([*base, "run.name=whole", "run.steps=3"])

    def trained(name):
        rows = _lines(tmp_path / name / "metrics.jsonl")
        ckpt = tmp_path / name / "checkpoints" / "step_000003"
        assert torch.load(ckpt / "trainer.pt", weights_only=False)["fsdp"]
        return [(r["step"], r["reward_mean"], r["loss"]) for r in rows], load_file(ckpt / "model.safetensors")

    (mp, wp), (mw, ww) = trained("part"), trained("whole")
    assert [r[0] for r in mp] == [1, 2, 3] and mp == mw
    initial = load_file(Path(tiny_path) / "model.safetensors")
    assert any(not torch.equal(ww[k], initial[k]) for k in initial)  # it trained
    assert all(torch.equal(wp[k], ww[k]) for k in ww)
