"""The CPU trainer's allocator setting (train/host_memory.py): freed blocks of a few MB leave the process."""

import subprocess
import sys

import pytest

from relayrl.train import host_memory

# In a fresh process: free one large block (glibc raises its mmap threshold to its size), then hold 40 blocks
# of 8 MB, each under a small live block, and free them; print the resident MB they left behind.
SCRIPT = """
import os, sys, torch
from relayrl.train import host_memory
if sys.argv[1] == "on":
    assert host_memory.release_large_blocks()
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
x = torch.ones(2 << 20); del x
before = rss()
blocks, keep = [], []
for _ in range(40):  # 8 MB blocks, each under a small block that lives on
    blocks.append(torch.ones(2 << 20))
    keep.append(torch.ones(16 << 10))
del blocks
print(rss() - before)
"""


def _left_mb(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_freed_blocks_of_a_few_mb_leave_the_process():
    assert _left_mb("off") > 200  # (the 320 MB stay in the heap, under the live block)
    assert _left_mb("on") < 50


def test_the_users_own_setting_is_left_alone(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert host_memory.release_large_blocks() is False


def test_the_cpu_trainer_sets_it(tiny, monkeypatch):
    """The trainer on a CPU calls ``release_large_blocks`` (deleting the call must not keep the suite green)."""
    from relayrl.config import AlgoCfg, TrainerCfg
    from relayrl.train.trainer import Trainer

    calls = []
    monkeypatch.setattr(host_memory, "release_large_blocks", lambda *a, **k: calls.append(a) or True)
    model, _ = tiny
    Trainer(model, TrainerCfg(device="cpu"), AlgoCfg(kl_coef=0.0), 1.0, 10, 16)
    assert calls == [()]
