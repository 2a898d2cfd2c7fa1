"""The isolated worker pool (results, deadlines, process cleanup, limits, sandbox, parent
death), then RewardRunner on top of it: the problems users hit with the single-child runner."""

import asyncio
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from relayrl.rewards.verifiers import RewardRunner
from relayrl.workers import NOBODY, CallFailed, ImportFailed, PoolError, SandboxUnavailable, WorkerPool

F = "tests.workers_for_tests:"  # functions for the pool
T = "tests.rewards_for_tests:"  # verifiers for RewardRunner
REPO = Path(__file__).resolve().parent.parent
ROOT = os.geteuid() == 0
needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")


@pytest.fixture
def pool():
    with WorkerPool([F + "echo"], workers=2, timeout_s=1.0) as p:
        yield p


def marker() -> str:
    """A unique, valid `sleep` argument to find a process by in /proc."""
    return f"1000.{random.randrange(10**12):012d}"


def procs_with(m: str) -> list[int]:
    """Live `sleep <m>` processes."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes() == f"sleep\0{m}\0".encode():
                found.append(int(pid))
        except OSError:
            pass
    return found


def procs_in_group(pgid: int) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            found.append(int(pid))
    return found


def eventually(check, within_s: float = 3.0):
    """Poll ``check`` until it returns a falsy value; return the last value (SIGKILL is async)."""
    end = time.monotonic() + within_s
    while (value := check()) and time.monotonic() < end:
        time.sleep(0.02)
    return value


def test_map_in_order_submit_awaitable_and_failures_are_typed(pool):
    assert pool.map(F + "echo", [[i, "x"] for i in range(20)]) == [[i, "x"] for i in range(20)]

    async def main():
        return await asyncio.wrap_future(pool.submit(F + "echo", [{"a": 1}]))

    assert asyncio.run(main()) == [{"a": 1}]
    out = pool.map(F + "fail", [["boom"]], return_exceptions=True)
    assert isinstance(out[0], CallFailed) and out[0].kind == "error" and str(out[0]).startswith("ValueError: boom (at ") \
        and "workers_for_tests.py:" in str(out[0])  # (the user's own frame)
    with pytest.raises(CallFailed, match="not JSON"):
        pool.submit(F + "not_json").result()
    with pytest.raises(CallFailed, match="SystemExit: 2"):
        pool.submit(F + "call_sys_exit").result()
    with pytest.raises(CallFailed, match="exited with code 3") as e:
        pool.submit(F + "exit_with", [3]).result()
    assert e.value.kind == "crashed"
    assert pool.submit(F + "echo", [1]).result() == [1]  # a fresh worker took over


def test_unimportable_spec_fails_at_construction(tmp_path):
    with pytest.raises(ImportFailed, match=r"'no_such_module:f' cannot be imported: ModuleNotFoundError"):
        WorkerPool(["no_such_module:f"], cwd=str(tmp_path))
    (tmp_path / "m.py").write_text("x = 1\n")
    with pytest.raises(ImportFailed, match=r"'m.py:nope': m.py has no 'nope'; the functions it defines: none$"):
        WorkerPool(["m.py:nope"], cwd=str(tmp_path))


def test_hanging_calls_run_in_parallel_each_with_its_own_deadline(pool):
    t = time.perf_counter()
    out = pool.map(F + "sleep_then", [[30, 1]] * 4, timeout_s=0.5, return_exceptions=True)
    elapsed = time.perf_counter() - t
    assert all(isinstance(e, CallFailed) and e.kind == "timeout" for e in out)
    assert str(out[0]) == "timed out after 0.5s"
    # 4 calls on 2 workers: two rounds of 0.5 s (one after another would be >= 2 s)
    assert 0.95 < elapsed < 1.6, elapsed
    assert pool.map(F + "sleep_then", [[0.2, "a"], [0.2, "b"]], timeout_s=0.5) == ["a", "b"]


def test_output_on_fd1_and_fd2_never_reaches_the_protocol(tmp_path):
    log = tmp_path / "workers.log"
    with WorkerPool([F + "noisy"], workers=1, log_path=str(log)) as p:
        assert p.map(F + "noisy", [[]] * 3) == [1.0, 1.0, 1.0]
        assert p.submit(F + "echo", ["after"]).result() == ["after"]
    text = log.read_text()
    for line in ("print to stdout", "print to stderr", "from a shell", "from a subprocess", "raw fd 2",
                 "from C stdio", '"value": "forged"'):
        assert text.count(line) == 3, line


def test_a_timed_out_call_takes_its_child_processes_with_it(pool):
    kept, escaped = marker(), marker()
    with pytest.raises(CallFailed, match="timed out"):
        pool.submit(F + "spawn_and_hang", [kept], timeout_s=0.5).result()
    assert eventually(lambda: procs_with(kept)) == []
    # a child that left the process group (setsid) is found as an orphan and killed by pid
    with pytest.raises(CallFailed, match="timed out"):
        pool.submit(F + "spawn_escaped_and_hang", [escaped], timeout_s=0.5).result()
    assert eventually(lambda: procs_with(escaped)) == []


def test_processes_left_by_a_returning_call_are_killed(pool):
    m = marker()
    assert pool.submit(F + "spawn_in_background", [m]).result() == 1.0
    assert eventually(lambda: procs_with(m)) == []
    # a forked copy of the worker returning from the user's function must not answer
    assert pool.map(F + "fork_and_return", [[]] * 3) == ["worker"] * 3
    assert pool.map(F + "echo", [[1], [2], [3]]) == [[1], [2], [3]]


def test_memory_limit_fails_the_call_and_the_pool_goes_on():
    with WorkerPool([F + "allocate"], workers=1, memory_mb=256) as p:
        # the budget comes on top of what the worker maps already (Python, imports)
        assert p.submit(F + "allocate", [240]).result() == 240
        with pytest.raises(CallFailed, match=r"out of memory \(memory_mb=256\)") as e:
            p.submit(F + "allocate", [10 << 10]).result()
        assert e.value.kind == "oom"
        assert p.submit(F + "allocate", [1]).result() == 1


def test_fork_bomb_is_killed_with_its_group_at_the_deadline(pool, tmp_path):
    tmp_path.chmod(0o777)  # the worker may run as uid 65534
    pgid_file = tmp_path / "pgid"
    if ROOT:
        assert pool.submit(F + "identity").result()["uid"] == 65534  # RLIMIT_NPROC applies
    with pytest.raises(CallFailed, match="timed out after 1s"):
        pool.submit(F + "fork_bomb", [str(pgid_file)]).result()
    pgid = int(pgid_file.read_text())
    assert eventually(lambda: procs_in_group(pgid)) == []
    assert pool.map(F + "echo", [[1], [2]]) == [[1], [2]]


@needs_bwrap
def test_bwrap_sandbox_has_no_network_and_a_read_only_filesystem():
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    outside = f"/var/tmp/relayrl-probe-{os.getpid()}"  # world-writable on the host, outside /tmp
    in_cwd = str(REPO / f"relayrl-probe-{os.getpid()}")
    try:
        with WorkerPool([F + "try_connect"], workers=1) as p:  # the control: these work unsandboxed
            assert p.submit(F + "try_connect", [port]).result() == "connected"
            assert p.submit(F + "try_write", [outside]).result() == "ok"
        with WorkerPool([F + "try_connect"], workers=1, sandbox="bwrap") as p:
            assert p.submit(F + "try_connect", [port]).result() != "connected"
            assert p.submit(F + "try_write", [outside]).result() == "EROFS"
            assert p.submit(F + "try_write", [in_cwd]).result() == "EROFS"
            assert p.submit(F + "try_write", ["/tmp/relayrl-probe"]).result() == "ok"
            assert p.submit(F + "noisy").result() == 1.0
        assert not os.path.exists(outside) and not os.path.exists(in_cwd)
    finally:
        listener.close()


def test_bwrap_missing_or_broken_is_an_error_not_a_fallback(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SandboxUnavailable, match="bubblewrap is not installed: apt-get install bubblewrap"):
        WorkerPool([F + "echo"], sandbox="bwrap")
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to creating new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    with pytest.raises(SandboxUnavailable, match="cannot start a sandbox here .*No permissions"):
        WorkerPool([F + "echo"], sandbox="bwrap")


def _stat(pid: int) -> list[str]:
    """/proc/<pid>/stat fields after the command name: state, ppid, pgrp, ..."""
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if _stat(pid)[0] != "Z":
                alive.append(pid)
        except OSError:
            pass
    return alive


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            children.setdefault(int(_stat(int(pid))[1]), []).append(int(pid))
        except OSError:
            pass
    found, todo = [], [root]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


@pytest.mark.parametrize("sandbox", ["none", pytest.param("bwrap", marks=needs_bwrap)])
def test_killing_the_trainer_leaves_no_worker_behind(sandbox):
    m = marker()
    trainer = subprocess.Popen([sys.executable, "-c", f"from tests.workers_for_tests import trainer_main; "
                                f"trainer_main({m!r}, {sandbox!r})"], cwd=REPO)
    try:
        assert eventually(lambda: not procs_with(m), within_s=20) is False, "the verifier's child never started"
        left = _descendants(trainer.pid)  # the server, its workers, the verifier's `sleep`
        assert procs_with(m)[0] in left
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait()
        assert eventually(lambda: _alive(left)) == []
    finally:
        trainer.kill()
        trainer.wait()


def test_a_dead_server_fails_its_calls_and_restarts(pool):
    fut = pool.submit(F + "sleep_then", [30, 1], timeout_s=20)
    time.sleep(0.2)
    old = pool.server_pid
    os.kill(old, signal.SIGKILL)
    with pytest.raises(PoolError, match="server died"):
        fut.result(timeout=10)
    assert pool.map(F + "echo", [[1], [2]]) == [[1], [2]]
    assert pool.server_pid != old
    pool.close()
    with pytest.raises(PoolError, match="closed"):
        pool.submit(F + "echo", [1])



def test_a_stop_signal_to_the_whole_job_is_left_to_the_trainer(pool):
    """slurm's SIGTERM reaches every process of the job, Ctrl-C's SIGINT the trainer's process group: the
    server is in neither group, and a SIGTERM while its trainer lives does not end it (the trainer finishes
    its step with it, then closes it)."""
    fut = pool.submit(F + "sleep_then", [0.5, 7], timeout_s=20)
    old = pool.server_pid
    assert os.getpgid(old) != os.getpgrp()
    os.kill(old, signal.SIGTERM)
    assert fut.result(timeout=10) == 7
    assert pool.server_pid == old and pool.map(F + "echo", [[1]]) == [[1]]

# ---------------------------------------------------------------- RewardRunner on the pool


def _scored(out):
    """A verifier's results as values, "failed" where the call failed (a failure, never a score of 0)."""
    return ["failed" if failure else value for value, failure in out]


def test_user_verifier_from_the_current_folder_or_a_file_path(tmp_path, monkeypatch):
    (tmp_path / "my_reward.py").write_text("def score(c, a, m):\n    return float(c == a)\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "helper.py").write_text("BONUS = 0.5\n")
    (tmp_path / "sub" / "other.py").write_text("from helper import BONUS\n\n"
                                               "def score(c, a, m):\n    return BONUS + len(m)\n")
    monkeypatch.chdir(tmp_path)
    for spec, want in [("my_reward:score", [(1.0, None), (0.0, None)]),
                       ("sub/other.py:score", [(0.5, None), (1.5, None)]),
                       (f"{tmp_path}/sub/other.py:score", [(0.5, None), (1.5, None)])]:
        r = RewardRunner(spec, timeout_s=5)
        try:
            assert r.score([("7", "7", {}), ("7", "8", {"k": 1})]) == want, spec
        finally:
            r.close()
    with pytest.raises(ValueError, match=r"reward function 'my_reward:nope': my_reward has no 'nope'; the functions "
                                         r"it defines: score$"):
        RewardRunner("my_reward:nope")
    with pytest.raises(ValueError, match=r"reward function 'missing.py:score' cannot be imported"):
        RewardRunner("missing.py:score")


def test_math_reward_in_workers_and_bad_values_fail():
    r = RewardRunner("math", timeout_s=5)
    try:
        items = [(r"so \boxed{\frac{1}{2}}", "0.5", {}), (r"\boxed{13}", "13", {}), (r"\boxed{12}", "13", {}),
                 ("no answer field", None, {})]
        assert _scored(r.score(items)) == [1.0, 1.0, 0.0, "failed"]
        assert r.stats.failures == 1 and "needs an answer" in r.stats.last_error
    finally:
        r.close()
    r = RewardRunner(T + "not_a_number", timeout_s=5)
    try:
        assert _scored(r.score([("nan", None, {}), ("str", None, {}), ("inf", None, {})])) == ["failed"] * 3
        assert r.stats.failures == 3 and "non-finite reward inf" in r.stats.last_error
    finally:
        r.close()


def test_hanging_verifiers_cost_one_deadline_per_round_of_workers():
    r = RewardRunner(T + "hang_on", timeout_s=0.5, workers=2)
    try:
        t = time.perf_counter()
        out = r.score([("hang", None, {})] * 4 + [("ok", None, {})] * 2)
        elapsed = time.perf_counter() - t
        assert _scored(out) == ["failed"] * 4 + [1.0] * 2
        assert r.stats.timeouts == 4 and r.stats.last_error == "timed out after 0.5s (reward.timeout_s=0.5)"
        assert elapsed < 1.6, elapsed  # 2 rounds of 0.5 s; one after another: >= 2 s + restarts
    finally:
        r.close()


def test_verifier_writing_to_stdout_does_not_break_scoring():
    r = RewardRunner(T + "shell_out", timeout_s=5)
    try:
        assert _scored(r.score([("a", None, {}), ("b", None, {})])) == [1.0, 1.0]
        assert r.stats.failures == 0
    finally:
        r.close()


def test_timed_out_verifier_leaves_no_child_process():
    m = marker()
    r = RewardRunner(T + "spawn_and_hang", timeout_s=0.5)
    try:
        assert _scored(r.score([(m, None, {})])) == ["failed"]
        assert eventually(lambda: procs_with(m)) == []
    finally:
        r.close()


def test_memory_hungry_verifier_fails_its_call_and_the_runner_goes_on():
    r = RewardRunner(T + "allocate_10gb", timeout_s=5)
    try:
        assert _scored(r.score([("big", None, {}), ("small", None, {})])) == ["failed", 1.0]
        assert r.stats.last_error == "killed: out of memory (reward.memory_mb=4096)"
    finally:
        r.close()


@needs_bwrap
def test_math_reward_under_bwrap():
    r = RewardRunner("math", timeout_s=5, sandbox="bwrap")
    try:
        assert _scored(r.score([(r"\boxed{\frac{1}{2}}", "0.5", {}), (r"\boxed{3}", "4", {})])) == [1.0, 0.0]
    finally:
        r.close()


def test_bwrap_asked_for_but_missing_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(RuntimeError, match="reward.sandbox=bwrap but bubblewrap is not installed: apt-get install"):
        RewardRunner("exact", sandbox="bwrap")


WRITES = ("import subprocess\n\n"
          "def score(completion, answer, metadata):\n"
          "    with open('calls.txt', 'a') as f:\n"
          "        f.write(completion + '\\n')\n"
          "    subprocess.run(['sh', '-c', 'echo ' + completion + ' >> shell.txt'], check=True)\n"
          "    return 1.0\n")


def test_a_verifier_writes_where_the_user_can_and_the_fork_bomb_guard_stays(tmp_path, monkeypatch):
    """As root the workers run as uid 65534 (RLIMIT_NPROC, which root ignores); the working
    directory is root's (0755), yet the verifier and the programs it runs append to files there."""
    work = tmp_path / "work"
    work.mkdir(mode=0o755)
    (work / "writes.py").write_text(WRITES)
    monkeypatch.chdir(work)
    r = RewardRunner("writes.py:score", timeout_s=10, workers=2)
    try:
        assert _scored(r.score([("a", None, {}), ("b", None, {})])) == [1.0, 1.0]
    finally:
        r.close()
    assert sorted((work / "calls.txt").read_text().split()) == ["a", "b"]
    assert sorted((work / "shell.txt").read_text().split()) == ["a", "b"]
    if os.geteuid() == 0:  # the uid switch that keeps the fork-bomb guard still happens
        assert (work / "calls.txt").stat().st_uid == NOBODY


@needs_bwrap
def test_under_bwrap_the_filesystem_stays_read_only(tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir(mode=0o755)
    (work / "writes.py").write_text(WRITES)
    monkeypatch.chdir(work)
    r = RewardRunner("writes.py:score", timeout_s=10, workers=1, sandbox="bwrap")
    try:
        out = r.score([("a", None, {})])
    finally:
        r.close()
    assert _scored(out) == ["failed"] and "Read-only file system" in out[0][1]["error"]
    assert not (work / "calls.txt").exists()


PEEK = ("def score(completion, answer, metadata):\n"
        "    try:\n"
        "        with open(completion) as f:\n"
        "            f.read()\n"
        "    except OSError:\n"
        "        return 0.0\n"
        "    return 1.0\n")


@pytest.fixture
def home_and_work(monkeypatch):
    """A home folder holding a token and a working folder holding a secret and the verifier,
    outside /tmp (the sandbox's /tmp is private, so a folder there would be invisible anyway)."""
    if not os.access("/var/tmp", os.W_OK):
        pytest.skip("/var/tmp is not writable: no place outside /tmp for a home folder")
    top = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="relayrl-test-verifier-"))
    home, work = top / "home", top / "work"
    (home / ".cache" / "huggingface").mkdir(parents=True)
    (home / ".cache" / "huggingface" / "token").write_text("hf_secret")
    (work / "pkg").mkdir(parents=True)
    (work / "secret.txt").write_text("secret")
    (work / "peek.py").write_text(PEEK)
    (work / "pkg" / "__init__.py").write_text("")
    (work / "pkg" / "peek.py").write_text(PEEK)
    for folder in (top, home, work):
        folder.chmod(0o755)  # as root the workers are uid 65534: hidden by the sandbox, not by modes
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    yield home, work
    shutil.rmtree(top, ignore_errors=True)


@needs_bwrap
@pytest.mark.parametrize("spec", ["peek:score", "peek.py:score", "pkg.peek:score"])
def test_under_bwrap_a_verifier_cannot_read_the_home_or_working_folder(home_and_work, spec):
    """As the python tool's sandbox does, the verifier's hides the home folder (tokens) and the
    working folder; the verifier's own module, which lies in the latter, still loads and scores."""
    home, work = home_and_work
    own = work / spec.partition(":")[0].replace(".py", "").replace(".", "/")
    r = RewardRunner(spec, timeout_s=10, workers=1, sandbox="bwrap")
    try:
        out = r.score([(str(home / ".cache" / "huggingface" / "token"), None, {}), (str(work / "secret.txt"), None, {}),
                       (f"{own}.py", None, {}), ("/etc/hostname", None, {})])
    finally:
        r.close()
    assert _scored(out) == [0.0, 0.0, 1.0, float(os.path.exists("/etc/hostname"))]
