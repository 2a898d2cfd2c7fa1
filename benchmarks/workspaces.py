"""Workspaces (relayrl.workspaces), measured: creating and removing one against a copy of the repository, and many
at once running a task's tests.

    python benchmarks/workspaces.py                 # a 2,000-file repository; 64 workspaces at once
    python benchmarks/workspaces.py --check         # a tiny scale, to check the script (results to a temp folder)

1. Start + close of a workspace (the sandbox, the overlay on the shared checkout, its removal), median of
   ``--repeats``: the overlay (relayrl's default), a copy of the checkout made inside the same sandbox (what a
   kernel refusing the overlay gets), and a plain ``shutil.copytree`` + ``rmtree`` on the host (no sandbox).
2. ``--many`` workspaces started at once, each running the task's tests (pytest on the tiny task of
   tests/swe_tasks.py) and closed: the wall time, the peak memory the machine used above its idle level
   (MemTotal - MemAvailable, sampled every 20 ms; tmpfs pages included) and the processes and mounts left
   after (none may be).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import machine_info, results_dir, write_results  # noqa: E402

from relayrl.workspaces.sandbox import Limits, Workspace, prepare  # noqa: E402
from tests.swe_tasks import git, make_task  # noqa: E402


def big_repo(folder: Path, files: int) -> Path:
    """A repository of ``files`` Python files of ~15 KB (a mid-sized project's tree)."""
    repo = folder / "big"
    for i in range(files):
        d = repo / f"pkg{i // 100}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"m{i}.py").write_text("".join(f"def f{j}(x):\n    return x + {i * 1000 + j}\n\n\n" for j in range(400)))
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "base")
    return repo


def used_mib() -> float:
    info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return (int(info["MemTotal"].split()[0]) - int(info["MemAvailable"].split()[0])) / 1024


async def start_close(lower: Path, copy: bool) -> float:
    t = time.perf_counter()
    ws = await Workspace.start(lower, copy=copy)
    await ws.close()
    return time.perf_counter() - t


def host_copy(lower: Path, scratch: Path) -> float:
    t = time.perf_counter()
    dest = scratch / "copy"
    shutil.copytree(lower, dest, symlinks=True)
    shutil.rmtree(dest)
    return time.perf_counter() - t


async def many(lower: Path, n: int, task_cmd: list[str]) -> dict:
    async def one() -> int | None:
        async with await Workspace.start(lower, Limits(memory_mb=1024, disk_mb=64)) as ws:
            r = await ws.run(task_cmd, timeout=600)
            return r.exit_code

    t = time.perf_counter()
    codes = await asyncio.gather(*(one() for _ in range(n)))
    return {"seconds": time.perf_counter() - t, "exit_codes": sorted(set(c for c in codes if c is not None)),
            "timed_out": sum(c is None for c in codes)}


def leftovers() -> tuple[int, int]:
    keepers = subprocess.run(["pgrep", "-f", "workspaces/keeper.py"], capture_output=True, text=True).stdout.split()
    mounts = Path("/proc/self/mountinfo").read_text().count(" overlay ")
    return len(keepers), mounts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--many", type=int, default=64)
    p.add_argument("--check", action="store_true", help="a tiny scale: checks the script")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if a.check:
        a.files, a.repeats, a.many = 20, 2, 4
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        repo = big_repo(tmp, a.files)
        lower = prepare(repo, "HEAD", cache=tmp / "cache")
        size = sum(f.stat().st_size for f in lower.rglob("*") if f.is_file()) / 2**20
        rows, data = [], {"machine": machine_info(), "files": a.files, "repo_mib": round(size, 1)}
        for name, fn in (("overlay in the sandbox (default)", lambda: asyncio.run(start_close(lower, False))),
                         ("copy in the sandbox", lambda: asyncio.run(start_close(lower, True))),
                         ("shutil.copytree + rmtree on the host", lambda: host_copy(lower, tmp))):
            times = [fn() for _ in range(a.repeats)]
            data[name] = times
            rows.append([f"start + close: {name}", f"{statistics.median(times) * 1000:.0f} ms", f"{a.files} files, "
                         f"{size:.0f} MiB", f"median of {a.repeats}"])
        task = make_task(tmp / "task")
        small = prepare(tmp / "task" / "repos" / "calc", task["base_commit"], cache=tmp / "cache")
        cmd = ["python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"]
        idle, peak, stop = used_mib(), [0.0], threading.Event()

        def sample():
            while not stop.is_set():
                peak[0] = max(peak[0], used_mib())
                time.sleep(0.02)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        out = asyncio.run(many(small, a.many, cmd))
        stop.set()
        sampler.join()
        time.sleep(0.5)
        keepers, mounts = leftovers()
        data["many"] = {**out, "idle_mib": idle, "peak_mib": peak[0], "keepers_left": keepers, "overlay_mounts_left": mounts}
        rows.append([f"{a.many} workspaces at once, each running pytest", f"{out['seconds']:.1f} s",
                     f"peak +{peak[0] - idle:.0f} MiB ({(peak[0] - idle) / a.many:.0f} MiB each)",
                     f"exit codes {out['exit_codes']}, {out['timed_out']} timed out; left after: {keepers} keepers, "
                     f"{mounts} overlay mounts"])
    write_results(results_dir(a.out, a.check), "workspaces", ["what", "time", "size / memory", "note"], rows, data)


if __name__ == "__main__":
    main()
