"""The sandboxed Python tool (relayrl.envs.python_tool): normal use, then escape attempts.

Every attack asserts two things: it failed, and the tool still works for the next call. The
attacks run under bubblewrap (skipped only when ``bwrap`` is not installed); a tool without
the sandbox runs the same reads and connections as controls, so a test that passes under
bwrap shows the sandbox stopped the attack, not that the attack was broken."""

import asyncio
import json
import os
import shutil
import socket
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from relayrl.envs.python_tool import PythonTool, python
from relayrl.workers import WorkerPool

REPO = Path(__file__).resolve().parent.parent
ROOT = os.geteuid() == 0
SECRET_VAR, SECRET = "RELAYRL_TEST_SECRET", "hunter2-" + uuid.uuid4().hex
HAVE_BWRAP = shutil.which("bwrap") is not None
needs_bwrap = pytest.mark.skipif(not HAVE_BWRAP, reason="bubblewrap (bwrap) is not installed")


@pytest.fixture(scope="module")
def run_dirs():
    """A "run directory" to hide and a folder that stays visible, both outside /tmp (the
    sandbox has its own /tmp, so a folder there would be invisible anyway)."""
    if not os.access("/var/tmp", os.W_OK):
        pytest.skip("/var/tmp is not writable: no place outside /tmp for a run directory")
    hidden = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="relayrl-test-run-"))
    shown = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="relayrl-test-shown-"))
    (hidden / "secret.txt").write_text(SECRET)
    (shown / "public.txt").write_text("public data")
    for folder in (hidden, shown):
        folder.chmod(0o755)
        (folder / (("secret" if folder == hidden else "public") + ".txt")).chmod(0o644)
    yield hidden, shown
    shutil.rmtree(hidden, ignore_errors=True)
    shutil.rmtree(shown, ignore_errors=True)


def _tool(**kw) -> PythonTool:
    os.environ[SECRET_VAR] = SECRET  # the trainer's environment holds a secret
    try:
        return PythonTool(**kw)
    finally:
        del os.environ[SECRET_VAR]


@pytest.fixture(scope="module")
def tool(run_dirs):
    if not HAVE_BWRAP:
        pytest.skip("bubblewrap (bwrap) is not installed")
    t = _tool(timeout_s=5.0, memory_mb=256, workers=2, max_output_chars=2000, hide=[str(run_dirs[0])])
    yield t
    t.close()


@pytest.fixture(scope="module")
def unsandboxed():
    t = _tool(timeout_s=5.0, memory_mb=256, workers=1, max_output_chars=2000, sandbox="none")
    yield t
    t.close()


def works(t: PythonTool) -> None:
    assert t("print(6 * 7)") == "42\n"


def mark() -> str:
    return f"MARK{uuid.uuid4().hex}"


def procs_with(m: str) -> list[int]:
    """Live processes whose command line holds ``m`` (the code is in it: python -c CODE)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if m.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
                if state != "Z":
                    found.append(int(pid))
        except OSError:
            pass
    return found


def none_left(m: str, within_s: float = 5.0) -> bool:
    end = time.monotonic() + within_s
    while procs_with(m):
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


def run_json(t: PythonTool, code: str, **kw) -> dict:
    out = t(code, **kw)
    assert out.startswith("{"), out
    return json.loads(out.splitlines()[0])


# ---------------------------------------------------------------- normal use


@needs_bwrap
def test_prints_big_integers(tool):
    assert tool("print(2**100)") == f"{2**100}\n"


@needs_bwrap
def test_a_traceback_comes_back_as_text(tool):
    out = tool("def f(x):\n    return x / 0\nprint('before')\nf(1)")
    assert out.startswith("before\nTraceback (most recent call last):")
    assert "ZeroDivisionError: division by zero" in out and out.endswith("[exit code 1]")


@needs_bwrap
def test_stdout_then_stderr_then_exit_code(tool):
    out = tool("import sys\nprint('to stderr', file=sys.stderr)\nprint('to stdout')\nsys.exit(3)")
    assert out == "to stdout\nto stderr\n[exit code 3]"
    assert tool("pass") == "[no output]"
    assert tool("import os; os.system('echo from a subprocess')") == "from a subprocess\n"  # fd-level capture


@needs_bwrap
def test_long_output_is_cut_with_a_marker_and_keeps_the_traceback(tool):
    out = tool("print('a' * 50000)")
    assert out.startswith("a" * 900) and out.rstrip().endswith("a" * 900)
    assert "[... 48001 characters truncated ...]" in out and len(out) < 2100
    out = tool("print('b' * 100000)\nraise ValueError('the end')")
    assert "characters truncated" in out and "ValueError: the end" in out and out.endswith("[exit code 1]")
    assert len(out) < 2200


@needs_bwrap
def test_an_output_flood_is_bounded_and_times_out(tool):
    t0 = time.monotonic()
    out = tool("while True: print('y' * 1000)", timeout_s=1.0)
    assert time.monotonic() - t0 < 3.0
    assert "characters truncated" in out and out.endswith("[timed out after 1.0 s]") and len(out) < 2200
    works(tool)


@needs_bwrap
def test_each_call_starts_fresh(tool):
    """No state passes between calls: not in the interpreter, the cwd, nor /tmp."""
    first = tool("import builtins, os\nbuiltins.LEAK = 1\nopen('/tmp/leak.txt', 'w').write('x')\n"
                 "os.mkdir('/tmp/leak.d')\nopen('here.txt', 'w').write('x')\nprint(os.getcwd())").strip()
    assert first.startswith("/tmp/")
    for _ in range(4):  # both workers
        out = tool(f"import builtins, os\nprint(hasattr(builtins, 'LEAK'), os.path.exists('/tmp/leak.txt'), "
                   f"os.path.exists('/tmp/leak.d'), os.path.exists({first!r}), os.listdir('.'))")
        assert out == "False False False False []\n"


@needs_bwrap
def test_the_workers_limits_apply_to_the_code(tool):
    code = """import json, os, resource
r = {n: resource.getrlimit(getattr(resource, n)) for n in ("RLIMIT_AS", "RLIMIT_CPU", "RLIMIT_FSIZE", "RLIMIT_NPROC")}
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
r["uid"], r["caps"] = os.getuid(), [int(status[k], 16) for k in ("CapInh", "CapPrm", "CapEff", "CapAmb")]
r["no_new_privs"] = int(status["NoNewPrivs"])
try:
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY,) * 2)
    r["raise_as"] = "allowed"
except (ValueError, OSError):
    r["raise_as"] = "refused"
try:
    open("big", "wb").write(b"x" * (65 << 20))
    r["big_file"] = "written"
except OSError as e:
    r["big_file"] = e.strerror
print(json.dumps(r))"""
    r = run_json(tool, code)
    assert r["RLIMIT_AS"] == [256 << 20] * 2 and r["raise_as"] == "refused"
    assert r["RLIMIT_CPU"] == [6, 6]  # timeout 5 s rounded up + 1
    assert r["RLIMIT_FSIZE"] == [64 << 20] * 2 and r["big_file"] == "File too large"
    assert r["caps"] == [0, 0, 0, 0] and r["no_new_privs"] == 1
    if ROOT:
        assert r["uid"] == 65534 and r["RLIMIT_NPROC"][0] < 10000


@needs_bwrap
def test_calls_run_in_parallel_and_from_asyncio(tool):
    async def main():
        t0 = time.monotonic()
        futs = [asyncio.wrap_future(tool.submit(f"import time; time.sleep(0.4); print({i})")) for i in range(2)]
        results = await asyncio.gather(*futs)
        return results, time.monotonic() - t0

    results, took = asyncio.run(main())
    assert results == ["0\n", "1\n"] and took < 0.75  # two workers: together, not one after the other


def test_the_tool_as_a_function_has_an_openai_schema():
    from relayrl.envs.tools import tool_schemas

    (schema,) = tool_schemas([python])
    fn = schema["function"]
    assert fn["name"] == "python" and "fresh interpreter" in fn["description"]
    assert fn["parameters"]["properties"]["code"]["type"] == "string"
    assert fn["parameters"]["required"] == ["code"]
    t = PythonTool.__new__(PythonTool)  # the schema needs no running tool
    assert tool_schemas([t.as_function("run_python")])[0]["function"]["name"] == "run_python"


@needs_bwrap
def test_the_default_python_function_runs_code():
    assert python("print(sum(range(10)))") == "45\n"


def test_without_the_sandbox_it_runs_and_limits_too(unsandboxed):
    assert unsandboxed("print(2**100)") == f"{2**100}\n"
    assert unsandboxed("while True: pass", timeout_s=0.5) == "[timed out after 0.5 s]"
    assert unsandboxed("x = bytearray(1 << 40)").endswith("[killed: out of memory (limit 256 MB)]")
    works(unsandboxed)


def test_hide_paths_needs_bwrap_and_existing_folders(tmp_path):
    with pytest.raises(ValueError, match="bwrap"):
        WorkerPool(hide_paths=[str(tmp_path)], sandbox="none")
    if HAVE_BWRAP:
        with pytest.raises(ValueError, match="not an existing folder"):
            WorkerPool(hide_paths=[str(tmp_path / "missing")], sandbox="bwrap")


# ---------------------------------------------------------------- escape attempts


@pytest.fixture
def listener():
    """A server on the host's loopback that the sandboxed code tries to reach."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.setblocking(False)
    yield srv
    srv.close()


NETWORK = """import socket
for addr in [("127.0.0.1", {port}), ("1.1.1.1", 53), ("8.8.8.8", 443)]:
    try:
        socket.create_connection(addr, timeout=2).close()
        print("connected", addr)
    except OSError as e:
        print("refused", addr, e.strerror)
try:
    socket.getaddrinfo("example.com", 80)
    print("resolved")
except OSError:
    print("no name resolution")"""


@needs_bwrap
def test_escape_network(tool, unsandboxed, listener):
    port = listener.getsockname()[1]
    out = tool(NETWORK.format(port=port))
    assert "connected" not in out and "resolved" not in out, out
    assert out.count("refused (") == 3 and "no name resolution" in out
    with pytest.raises(BlockingIOError):
        listener.accept()  # nothing came in
    # control: without the sandbox the same code reaches the listener
    assert f"connected ('127.0.0.1', {port})" in unsandboxed(NETWORK.format(port=port), timeout_s=5.0)
    listener.accept()[0].close()
    works(tool)


@needs_bwrap
def test_escape_writing_outside_tmp(tool, run_dirs):
    name = f"pwned-{uuid.uuid4().hex}"
    targets = [REPO / name, Path("/etc") / name, Path("/var/tmp") / name, run_dirs[0] / name,
               run_dirs[1] / name, Path.home() / name, Path("/dev/shm") / name]
    code = ("for path in %r:\n    try:\n        open(path, 'w').write('x')\n        print('WROTE', path)\n"
            "    except OSError as e:\n        print('refused', path, e.strerror)") % [str(p) for p in targets]
    out = tool(code)
    assert "WROTE" not in out and out.count("refused /") == len(targets), out
    assert not any(p.exists() for p in targets)
    works(tool)


READ = """import json, os
def read(path):
    try:
        return open(path).read()[:200]
    except OSError as e:
        return "refused: " + e.strerror
def listdir(path):
    try:
        return sorted(os.listdir(path))
    except OSError as e:
        return "refused: " + e.strerror
found = []
for pid in os.listdir("/proc"):
    try:
        if {secret!r} in open(f"/proc/{{pid}}/environ", errors="replace").read():
            found.append(pid)
    except OSError:
        pass
print(json.dumps({{"secret": read({hidden!r} + "/secret.txt"), "run_dir": listdir({hidden!r}),
                  "readme": read({repo!r} + "/README.md"), "repo": listdir({repo!r}),
                  "public": read({shown!r} + "/public.txt"), "env": {secret!r} in str(os.environ),
                  "environ_of": found}}))"""


@needs_bwrap
def test_escape_reading_the_run_dir_and_the_project(tool, unsandboxed, run_dirs):
    hidden, shown = run_dirs
    code = READ.format(secret=SECRET, hidden=str(hidden), repo=str(REPO), shown=str(shown))
    r = run_json(tool, code)
    assert r["secret"].startswith("refused") and r["run_dir"] == []  # an empty folder where the run dir is
    # only the way to relayrl, and to the Python installation when it lives in the checkout (a .venv)
    python_home = {Path(sys.prefix).resolve().relative_to(REPO.resolve()).parts[0]} \
        if Path(sys.prefix).resolve().is_relative_to(REPO.resolve()) else set()
    assert r["readme"].startswith("refused") and set(r["repo"]) <= {"src"} | python_home
    assert r["public"] == "public data"  # the rest of the host is readable: it is the hiding that works
    assert r["env"] is False and r["environ_of"] == []  # the trainer's environment does not reach the code
    # control: without the sandbox the same code reads it all
    r = run_json(unsandboxed, code)
    assert r["secret"] == SECRET and "README.md" in r["repo"] and not r["readme"].startswith("refused")
    works(tool)


FORK_BOMB = """import os, time  # {mark}
told = False
while True:
    try:
        if os.fork() == 0 and {setsid}:
            os.setsid()  # leave the process group, to outlive a kill of the group
    except OSError as e:
        if not told:
            print("fork refused:", e.strerror, flush=True)
            told = True
        time.sleep(0.01)"""


@needs_bwrap
@pytest.mark.parametrize("setsid", [False, True], ids=["plain", "setsid"])
def test_escape_fork_bomb(tool, setsid):
    m = mark()
    out = tool(FORK_BOMB.format(mark=m, setsid=setsid), timeout_s=1.0)
    assert out.endswith("[timed out after 1.0 s]"), out
    if ROOT:  # RLIMIT_NPROC holds it (as another user, the user's own process limit does)
        assert "fork refused: Resource temporarily unavailable" in out
    assert none_left(m), f"processes of the fork bomb left: {procs_with(m)}"
    works(tool)


@needs_bwrap
def test_escape_memory_bomb(tool):
    t0 = time.monotonic()
    out = tool("chunks = []\nwhile True:\n    chunks.append(bytearray(10 << 20))")
    assert out.endswith("[killed: out of memory (limit 256 MB)]") and "MemoryError" in out
    assert time.monotonic() - t0 < 4.0  # killed at the limit, not at the deadline
    assert tool("x = bytearray(1 << 40)").endswith("[killed: out of memory (limit 256 MB)]")
    works(tool)


@needs_bwrap
def test_escape_infinite_loop(tool):
    m = mark()
    t0 = time.monotonic()
    busy = tool.submit(f"print('started')  # {m}\nwhile True:\n    pass", timeout_s=1.0)
    asleep = tool.submit(f"import time  # {m}\ntime.sleep(1000)", timeout_s=1.0)
    out = busy.result()
    assert out == "started\n[timed out after 1.0 s]"  # the output so far comes back too
    assert asleep.result() == "[timed out after 1.0 s]"
    assert 1.0 <= time.monotonic() - t0 < 2.5
    assert none_left(m)
    works(tool)


@needs_bwrap
@pytest.mark.parametrize("attack", [
    "os.kill(os.getppid(), signal.SIGKILL)",  # the worker
    "os.killpg(0, signal.SIGKILL)",  # its own process group
    "os.killpg(os.getpgid(os.getppid()), signal.SIGKILL)",  # the worker's group
    "os.kill(-1, signal.SIGKILL)",  # everything it may signal
    "os.kill(1, signal.SIGKILL)",  # pid 1 of the namespace
    "os.kill(TRAINER, signal.SIGKILL)",  # the trainer, by its pid outside
    "ancestors()",  # every ancestor, from the top
])
def test_escape_killing_the_parent(tool, attack):
    m = mark()
    server = tool._pool.server_pid
    code = f"""import os, signal  # {m}
TRAINER = {os.getpid()}
def ancestors():
    chain, pid = [], os.getppid()
    while pid > 0:
        chain.append(pid)
        pid = int(open(f"/proc/{{pid}}/stat").read().rpartition(")")[2].split()[1])
    for pid in reversed(chain):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError as e:
            print("refused", pid, e.strerror, flush=True)
try:
    {attack}
except OSError as e:
    print("refused:", e.strerror)
print("still here")"""
    out = tool(code)
    if attack.startswith("os.kill(1,") or attack.startswith("os.kill(TRAINER"):
        assert out.startswith("refused:") and out.endswith("still here\n"), out
    else:
        assert "[killed" in out, out
    assert tool._pool.server_pid == server  # the pool's server survived (and the trainer: we are here)
    assert none_left(m)
    works(tool)
    works(tool)
