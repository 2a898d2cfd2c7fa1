"""The cluster recipes in ``examples/cluster`` (SLURM, KubeRay, SkyPilot), checked as far as a machine without those
tools allows: the shell is valid, the YAML parses into the fields the tools define, and every ``relayrl train`` they
run is a configuration relayrl accepts (its overrides validated as the command line's are)."""

import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from relayrl.config import load_config

CLUSTER = Path(__file__).resolve().parent.parent / "examples" / "cluster"
CONFIG = CLUSTER.parent / "qwen2.5-0.5b-gsm8k.yaml"
# SkyPilot 0.14.1's task schema (sky/utils/schemas.py, get_task_schema) and the resources fields used here
SKY_TASK = {"name", "workdir", "event_callback", "num_nodes", "resources", "file_mounts", "service", "pool", "setup",
            "run", "envs", "secrets", "volumes", "config"}
SKY_RESOURCES = {"accelerators", "cpus", "memory", "disk_size", "infra", "cloud", "region", "use_spot", "image_id",
                 "ports", "instance_type"}
SBATCH = {"job-name", "nodes", "ntasks-per-node", "gpus-per-node", "cpus-per-task", "time", "output", "partition",
          "account", "exclusive", "mem"}


def _commands(text: str) -> list[list[str]]:
    """Each ``relayrl train`` / ``-m relayrl.cli train`` the text runs, its variables given stand-in values."""
    text = re.sub(r"\$\{?(config|CONFIG)\}?", str(CONFIG), text.replace("\\\n", " "))
    out = []
    for line in text.splitlines():
        m = re.search(r"(?:relayrl|-m relayrl\.cli) train (.*)", line)
        if m:
            words = shlex.split(re.sub(r'"?\$\{?@\}?"?', "", m.group(1)))
            out.append([re.sub(r"\$\(\(.*?\)\)|\$\{?\w+\}?(:\$\w+)?", "8", w) for w in words])
    return out


def _check_runs(text: str, where: str) -> int:
    commands = _commands(text)
    for words in commands:
        config, overrides = words[0], words[1:]
        assert config.endswith(".yaml"), (where, words)
        cfg = load_config(str(CONFIG), [o for o in overrides if o != "--resume"])
        if "run.backend=ray" in overrides:
            assert cfg.ray.engine_resources == {"rollout": 1.0}, where
    return len(commands)


@pytest.mark.parametrize("name", ["slurm_ray.sbatch", "slurm_torchrun.sbatch"])
def test_the_slurm_recipes_are_valid_shell_with_known_directives_and_runs_relayrl_accepts(name):
    text = (CLUSTER / name).read_text()
    assert subprocess.run(["bash", "-n", str(CLUSTER / name)], capture_output=True).returncode == 0
    directives = re.findall(r"^#SBATCH --([\w-]+)", text, re.MULTILINE)
    assert directives and set(directives) <= SBATCH, set(directives) - SBATCH
    assert _check_runs(text, name) == 1
    if "torchrun" in text:
        assert re.search(r"torchrun --nnodes=\S+ --nproc-per-node=\S+ .*--rdzv-backend=c10d", text.replace("\\\n", ""))


def test_the_kuberay_recipe_is_a_rayjob_whose_workers_offer_the_engines_resource():
    job = yaml.safe_load((CLUSTER / "kuberay_rayjob.yaml").read_text())
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob"
    spec = job["spec"]["rayClusterSpec"]
    assert set(job["spec"]) <= {"entrypoint", "shutdownAfterJobFinishes", "ttlSecondsAfterFinished", "rayClusterSpec"}
    assert {"headGroupSpec", "workerGroupSpecs"} <= set(spec)
    (workers,) = spec["workerGroupSpecs"]
    assert yaml.safe_load(workers["rayStartParams"]["resources"].strip('"').replace('\\"', '"')) == {"rollout": 8}
    assert workers["template"]["spec"]["containers"] and spec["headGroupSpec"]["template"]["spec"]["containers"]
    assert _check_runs("relayrl train " + job["spec"]["entrypoint"].split("relayrl train ", 1)[1], "kuberay") == 1


def test_the_skypilot_recipe_uses_skypilot_s_task_fields_and_runs_relayrl_it_accepts():
    task = yaml.safe_load((CLUSTER / "skypilot.yaml").read_text())
    assert set(task) <= SKY_TASK and set(task["resources"]) <= SKY_RESOURCES
    assert task["num_nodes"] == 2
    assert subprocess.run(["bash", "-n"], input=task["run"], text=True, capture_output=True).returncode == 0
    assert _check_runs(task["run"], "skypilot") == 1


def test_a_recipe_with_a_wrong_override_is_caught():
    """(The check above can fail: an override relayrl refuses is refused here too.)"""
    with pytest.raises(Exception, match="engine_resource"):
        _check_runs('relayrl train "$CONFIG" run.backend=ray "ray.engine_resource={rollout: 1}"', "x")
