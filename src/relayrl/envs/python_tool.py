"""A sandboxed Python code-execution tool for agents: model-written code runs in the isolated
worker pool (``relayrl.workers.WorkerPool``), under bubblewrap by default.

    tool = PythonTool(timeout_s=5.0, memory_mb=512, hide=[run_dir])
    tool("print(2**100)")                    # '1267650600228229401496703205376\\n'
    text = await asyncio.wrap_future(tool.submit(code))   # from asyncio code
    schemas = tool_schemas([tool.as_function()])          # relayrl.envs.tools; name "python"
    tool.close()

``python(code)`` is the same tool as a plain function on a default instance (made on first
use, closed at exit), for environments that need no settings of their own; one that does
binds ``PythonTool(...).as_function()`` instead.

What the model reads: stdout, then stderr (a traceback), each cut in the middle when the two
exceed ``max_output_chars`` (``[... N characters truncated ...]``), then one line when the run
did not end normally: ``[timed out after 2.0 s]``, ``[killed: out of memory (limit 512 MB)]``,
``[killed by signal SIGSEGV]``, ``[exit code 1]``; ``[no output]`` when there was nothing.
Failures of the sandbox itself come back as text too, so an episode goes on; a closed tool
raises ``PoolError``.

Design
------
A call is one pool call of ``python_exec._execute``, which starts a fresh interpreter,
``python -I -X utf8 -u -c CODE``, as a child of the worker: nothing of an earlier call (modules,
globals, the cwd) is there, and output is captured from pipes, so it comes from C code and
subprocesses too. The child runs:

- in its own session and process group, in a fresh 0700 directory under /tmp (also its HOME
  and TMPDIR), with a minimal environment (the trainer's variables, tokens included, are not
  passed), stdin /dev/null;
- with the worker's isolation (see ``relayrl.workers``): the sandbox's namespaces (no
  network, own pid namespace and /tmp, read-only host), uid 65534 when the trainer is root,
  no_new_privs, RLIMIT_NPROC (shared by the pool's calls), RLIMIT_FSIZE 64 MiB, no core
  dumps; on top, set before exec: RLIMIT_AS = ``memory_mb`` for its whole address space,
  RLIMIT_CPU = the timeout rounded up + 1 s, SIGKILL when the worker dies, and, under bwrap,
  no capabilities (the worker keeps CAP_DAC_READ_SEARCH, which would let code read any file).

The worker reads both pipes, keeping the first and the last ``max_output_chars`` bytes of
each (never more, however much is printed), until the child exits or the deadline passes;
then it SIGKILLs the child's group and every other descendant of the worker (one that left
the group with setsid stays one: a worker is a child subreaper), stopping them all first so a
fork bomb cannot outrun the kill, reaps them, and removes the call's directory. Under bwrap it also
removes what earlier calls left in the sandbox's /tmp (files older than every call still
running), so no state passes from one call to a later one through the filesystem either. The
pool's deadline (timeout + ``_GRACE_S``) is only the backstop for a worker that hangs.

Filesystem under bwrap: the folder the trainer runs in, the home folder and ``hide`` are
covered by empty read-only tmpfs mounts (``WorkerPool(hide_paths=...)``), except the Python
installation and the relayrl package, which stay readable beneath; the rest of the host is
read-only; /tmp is private and limited to ``tmp_mb``.

Limits: calls of one tool share the sandbox's /tmp and uid while they run at once, so
concurrent calls can see (and disturb) each other's files; a fork bomb in one call uses up
the process budget the others need meanwhile (they fail to start, with a message). Memory is
limited per process, not per call: a call may run up to RLIMIT_NPROC processes of
``memory_mb`` each until its deadline. ``sandbox="none"`` is resource control only: the code
can read what the trainer can (as root it also keeps the worker's CAP_DAC_READ_SEARCH, so that
a Python under a 0700 home still starts). As another user than root, code and workers share a
uid, so keep secrets out of the trainer's environment (a worker's /proc/PID/environ). A call
costs an interpreter start plus ~5 ms (measured on 2 busy cores: ~15 ms for ``python -I -S``,
~50 ms with this machine's site-packages, whose ``.pth`` files import certifi).
"""

from __future__ import annotations

import atexit
import math
import signal
import threading
from concurrent.futures import Future
from typing import Callable, Iterable

from relayrl.workers import CallFailed, PoolError, WorkerPool
from relayrl.workers.isolation import private_folders

_SPEC = "relayrl.envs.python_exec:_execute"
_GRACE_S = 5.0  # the pool's deadline is the tool's + this: time to kill, drain and clean up
_WORKER_MEMORY_MB = 64  # what a worker may add to its address space besides the child's budget
_PROCS_PER_WORKER = 32  # RLIMIT_NPROC budget per worker (as root): bounds a fork bomb



class PythonTool:
    """Runs model-written Python, one fresh interpreter per call, in an isolated worker pool.

    ``timeout_s``: wall-clock limit per call (interpreter start included). ``memory_mb``: the
    address space of the process that runs the code. ``sandbox``: "bwrap" (default) or "none"
    (resource limits only, no security boundary). ``workers``: calls at once (0: one per core).
    ``max_output_chars``: stdout and stderr together are cut to this (plus the marker and the
    note). ``hide``: folders the code must not read, besides the trainer's folder and the home
    folder, which are always hidden (bwrap only; each must exist). ``tmp_mb``: size of the
    sandbox's private /tmp (bwrap only)."""

    def __init__(self, timeout_s: float = 10.0, memory_mb: int = 1024, sandbox: str = "bwrap", workers: int = 0,
                 max_output_chars: int = 4000, hide: Iterable[str] = (), tmp_mb: int = 256):
        self.timeout_s = _check_timeout(timeout_s)
        self.memory_mb, self.max_output_chars, self.sandbox = int(memory_mb), int(max_output_chars), sandbox
        if self.memory_mb < 32 or self.max_output_chars < 100:
            raise ValueError("memory_mb must be >= 32 and max_output_chars >= 100")
        hidden = list(hide)
        if sandbox == "bwrap":  # the trainer's folder and the home folder, where they can be hidden
            hidden += private_folders()
        self._pool = WorkerPool([_SPEC], workers=workers, timeout_s=self.timeout_s + _GRACE_S,
                                memory_mb=self.memory_mb + _WORKER_MEMORY_MB, sandbox=sandbox, prefetch=1,
                                procs_per_worker=_PROCS_PER_WORKER, hide_paths=hidden,
                                tmp_size_mb=tmp_mb if sandbox == "bwrap" else None)
        self.hidden = self._pool.hide_paths

    def __call__(self, code: str, timeout_s: float | None = None) -> str:
        """Run ``code``; what it printed, its traceback and how it ended, as text."""
        return self.submit(code, timeout_s).result()

    def submit(self, code: str, timeout_s: float | None = None) -> Future:
        """Like calling the tool, but returns at once: a ``concurrent.futures.Future`` of the
        text (``await asyncio.wrap_future(tool.submit(code))`` in asyncio code)."""
        if not isinstance(code, str):
            raise TypeError(f"code must be a str, not {type(code).__name__}")
        timeout = self.timeout_s if timeout_s is None else _check_timeout(timeout_s)
        inner = self._pool.submit(_SPEC, [code, timeout, self.memory_mb, self.max_output_chars,
                                          self.sandbox == "bwrap"], timeout_s=timeout + _GRACE_S)
        outer: Future = Future()
        outer.set_running_or_notify_cancel()

        def resolve(fut: Future) -> None:
            try:
                text = _render(fut.result(), timeout, self.memory_mb, self.max_output_chars)
            except CallFailed as e:  # the worker itself failed: the code killed it, or it hung
                text = _failure_note(e, timeout, self.memory_mb)
            except PoolError as e:
                text = f"[the sandbox failed: {e}]"
            except BaseException as e:  # a bug here must reach the caller, not hang its future
                outer.set_exception(e)
                return
            outer.set_result(text)

        inner.add_done_callback(resolve)
        return outer

    def as_function(self, name: str = "python"):
        """This tool as a plain function ``name(code: str) -> str`` with a docstring, for
        ``relayrl.envs.tools.tool_schemas`` and for calling."""

        def python(code: str) -> str:
            return self(code)

        python.__doc__ = _python_doc
        python.__name__ = python.__qualname__ = name
        return python

    def close(self) -> None:
        self._pool.close()

    def __enter__(self) -> PythonTool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_default: PythonTool | None = None
_default_lock = threading.Lock()
_factory: Callable[[], PythonTool] = PythonTool


def use_default(factory: Callable[[], PythonTool] | None = None) -> None:
    """Where ``python`` runs its code from now on: in the tool ``factory()`` makes at the next call
    (``run.backend=ray``: a ``RayPythonTool``), or, with None, in a local ``PythonTool``. The tool
    made before is closed."""
    global _default, _factory
    with _default_lock:
        old, _default, _factory = _default, None, factory or PythonTool
    if old is not None:
        old.close()


atexit.register(use_default)  # (closes the shared tool's workers)


def python(code: str) -> str:
    """Run Python code in a fresh interpreter and return what it printed.

    Nothing carries over between calls: no variables, imports or files. There is no network,
    and time and memory are limited. Print the values you need; if the code fails, the
    traceback is returned.

    Args:
        code: The Python source to run, for example "print(123456789 * 987654321)".
    """
    global _default
    with _default_lock:
        if _default is None:
            _default = _factory()
        tool = _default
    return tool(code)


_python_doc = python.__doc__


def _check_timeout(timeout_s: float) -> float:
    t = float(timeout_s)
    if not (t > 0 and math.isfinite(t)):
        raise ValueError(f"timeout_s must be a positive number, not {timeout_s!r}")
    return t


# ---------------------------------------------------------------- the text the model reads


def _render(result: dict, timeout_s: float, memory_mb: int, max_chars: int) -> str:
    if result.get("error"):
        return f"[could not run the code: {result['error']}]"
    out, err = result["stdout"], result["stderr"]
    n_out, n_err = _length(out), _length(err)
    if n_out + n_err <= max_chars:
        out_budget, err_budget = n_out, n_err
    else:  # stderr (a traceback) keeps at least half when both are long
        err_budget = min(n_err, max(max_chars // 2, max_chars - n_out))
        out_budget = max_chars - err_budget
    text = _join(_fit(out, out_budget), _fit(err, err_budget))
    return _join(text, _note(result, _tail_line(err), timeout_s, memory_mb)) or "[no output]"


def _length(stream: list) -> int:
    head, tail, cut = stream
    return len(head) + cut + len(tail)


def _fit(stream: list, budget: int) -> str:
    """The stream, cut in the middle to ``budget`` characters (plus the marker)."""
    head, tail, cut = stream
    if not cut and len(head) + len(tail) <= budget:
        return head + tail
    first, last = budget - budget // 2, budget // 2
    if cut:
        start, end = head[:first], tail[len(tail) - last:] if last else ""
    else:
        joined = head + tail
        start, end = joined[:first], joined[len(joined) - last:] if last else ""
    omitted = _length(stream) - len(start) - len(end)
    return f"{start}\n[... {omitted} characters truncated ...]\n{end}"


def _join(a: str, b: str) -> str:
    if not a or not b:
        return a or b
    return a + ("" if a.endswith("\n") else "\n") + b


def _tail_line(stream: list) -> str:
    head, tail, _ = stream
    lines = (head + tail).strip().splitlines() if not tail else tail.strip().splitlines()
    return lines[-1] if lines else ""


def _note(result: dict, last_err_line: str, timeout_s: float, memory_mb: int) -> str:
    code = result["returncode"]
    if result["timed_out"]:
        return f"[timed out after {float(timeout_s)} s]"
    if code == 1 and last_err_line.startswith("MemoryError"):
        return f"[killed: out of memory (limit {memory_mb} MB)]"
    if code is not None and code < 0:
        if -code == signal.SIGXCPU:
            return "[killed: CPU time limit exceeded]"
        try:
            return f"[killed by signal {signal.Signals(-code).name}]"
        except ValueError:
            return f"[killed by signal {-code}]"
    return f"[exit code {code}]" if code else ""


def _failure_note(e: CallFailed, timeout_s: float, memory_mb: int) -> str:
    if e.kind == "timeout":
        return f"[timed out after {float(timeout_s)} s]"
    if e.kind == "oom":
        return f"[killed: out of memory (limit {memory_mb} MB)]"
    if e.kind == "crashed":
        return f"[killed: the process running the code was lost ({e})]"
    return f"[the sandbox failed: {e}]"
