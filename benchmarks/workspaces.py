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
3. ``--episodes`` episodes of the workspace demo (``examples/swe_demo.yaml``: its warm-started model, the held-out
   repositories, env.name=workspace), played twice on the same engine: **one at a time** (an agent loop that
   waits for each tool, as a synchronous harness runs), then **all at once** (relayrl's episodes, whose tool calls
   overlap the others' generation). Per episode, the share of its wall time spent in environment calls (sandbox,
   tools, tests: OS-level work); from each play's timeline (``workspaces-timeline-*/timeline.png`` in the
   results folder), the time in which OS-level work stalled generation (the environment lane
   busy, no request in flight), against the one-at-a-time play's.
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


def episodes(n: int, out: Path) -> tuple[list, dict]:
    """Part 3 (the module doc): the demo's episodes one at a time, then all at once."""
    from relayrl.config import load_config
    from relayrl.records import Trajectory
    from relayrl.run.build import build, load_data
    from relayrl.run.checkpoint import RunState
    from relayrl.tracking.timeline import Timeline

    cfg = load_config(str(ROOT / "examples" / "swe_demo.yaml"), [f"eval.size={n}"])
    c = build(cfg, RunState(), None, load_data(cfg), log=lambda *a, **k: None)
    try:
        prompts, result = c.eval_prompts[:n], {}
        for how in ("one at a time", "all at once"):
            c.runner.timeline = tl = Timeline()
            trajs = [Trajectory(p, f"{how[0]}{i}", 0, []) for i, p in enumerate(prompts)]
            start = time.perf_counter()
            if how == "one at a time":
                for t in trajs:
                    c.runner.run(c.runner.episode(t, c.params, train=False))
            else:
                async def together():
                    await asyncio.gather(*(c.runner.episode(t, c.params, train=False) for t in trajs))
                c.runner.run(together())
            wall = time.perf_counter() - start
            c.runner.mark_engine()
            env_s, ep_s = sum(t.info["env_s"] for t in trajs), sum(t.info["episode_s"] for t in trajs)
            stalled = _lane_alone(tl, "environment", "engine")
            result[how] = {"wall_s": wall, "env_s": env_s, "episode_s": ep_s, "os_share": env_s / ep_s,
                           "stalled_s": stalled, "resolved": sum(t.reward for t in trajs) / n}
            folder = out / f"workspaces-timeline-{how.replace(' ', '-')}"
            folder.mkdir(parents=True, exist_ok=True)
            tl.save(folder)
        seq, conc = result["one at a time"], result["all at once"]
        return [[f"{n} demo episodes, one at a time", f"{seq['wall_s']:.1f} s", f"OS-level {seq['os_share']:.0%} of an "
                 f"episode's wall time", f"generation stalled on OS-level work {seq['stalled_s']:.1f} s "
                 f"({seq['stalled_s'] / seq['wall_s']:.0%} of the wall)"],
                [f"{n} demo episodes, all at once", f"{conc['wall_s']:.1f} s ({seq['wall_s'] / conc['wall_s']:.1f}x)",
                 f"OS-level {conc['os_share']:.0%} of an episode's wall time", f"generation stalled on OS-level work "
                 f"{conc['stalled_s']:.1f} s ({conc['stalled_s'] / conc['wall_s']:.0%} of the wall): "
                 f"{1 - conc['stalled_s'] / seq['stalled_s']:.0%} of the stall hidden"]], result
    finally:
        c.close()


def _lane_alone(tl, lane: str, other: str) -> float:
    """Seconds ``lane`` was busy while ``other`` was not."""
    edges = sorted([(s, 1 if ln == lane else 2) for ln, s, _ in tl.intervals if ln in (lane, other)] +
                   [(e, -1 if ln == lane else -2) for ln, _, e in tl.intervals if ln in (lane, other)])
    alone, depth, last = 0.0, {1: 0, 2: 0}, 0.0
    for at, kind in edges:
        if depth[1] > 0 and depth[2] == 0:
            alone += at - last
        depth[abs(kind)] += 1 if kind > 0 else -1
        last = at
    return alone


def leftovers() -> tuple[int, int]:
    keepers = subprocess.run(["pgrep", "-f", "workspaces/keeper.py"], capture_output=True, text=True).stdout.split()
    mounts = Path("/proc/self/mountinfo").read_text().count(" overlay ")
    return len(keepers), mounts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--many", type=int, default=64)
    p.add_argument("--episodes", type=int, default=32, help="demo episodes played each way (0: none)")
    p.add_argument("--check", action="store_true", help="a tiny scale: checks the script")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if a.check:
        a.files, a.repeats, a.many, a.episodes = 20, 2, 4, 2
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
    out = results_dir(a.out, a.check)
    if a.episodes:
        more, data["episodes"] = episodes(a.episodes, out)
        rows += more
    write_results(out, "workspaces", ["what", "time", "size / memory", "note"], rows, data)


if __name__ == "__main__":
    main()
