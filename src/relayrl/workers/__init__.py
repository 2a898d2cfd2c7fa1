"""An isolated worker pool for user code (reward verifiers now, agent tools later).

``WorkerPool`` runs functions named by a spec (``"module:function"``, importable from the
current directory, or ``"path/to/file.py:function"``) in other processes, with a deadline,
resource limits and, optionally, a bubblewrap sandbox::

    pool = WorkerPool(preload=["my_reward:score"], workers=4, timeout_s=2.0)
    fut = pool.submit("my_reward:score", ["text", "42", {}])   # a concurrent.futures.Future
    value = fut.result()                  # or, in asyncio: await asyncio.wrap_future(fut)
    values = pool.map("my_reward:score", [[...], [...]], return_exceptions=True)
    pool.close()

A call that raises, exceeds its deadline, runs out of memory or dies fails its future with
``CallFailed`` (``.kind``: ``error`` | ``timeout`` | ``oom`` | ``crashed``); the pool goes on.
Futures cannot be cancelled (the deadline bounds every call).

Design
------
One *server* process per pool, started with ``subprocess.Popen([sys.executable, "-c", ...])``
rather than multiprocessing (which would re-import the trainer's ``__main__``), inside
bubblewrap when ``sandbox="bwrap"``. The server imports the preloaded functions once and runs
the optional warm-up calls, so everything it forks starts warm. It keeps ``workers`` *worker*
processes forked from itself, each the leader of its own process group, and runs calls on them
from a poll loop that also enforces every call's deadline. The trainer talks to the server
over two pipes of JSON lines tagged by call id; a reader thread resolves the futures. JSON,
never pickle, in every direction that carries data made by user code: unpickling a worker's
output in the trainer would hand the trainer to that code.

Why a worker runs several calls, one after another, instead of one fork per call (measured
on 2 cores with math_verify imported): a fork costs ~3.5 ms here and a fresh child's first
math_verify call ~20 ms (cold caches, copy-on-write faults) against ~0.6 ms warm; fork per
call scored 64 completions in 1.3 s, a warm worker pair in 18-33 ms (64 no-op calls: ~6 ms,
~0.1 ms a call). So a worker is reused until a call of it times out, crashes, runs out of
memory, or leaves a process or thread behind, or after ``calls_per_worker`` calls; then its
whole process group is killed and a fresh worker forked. Up to ``prefetch`` calls are queued
in a worker so that it goes on without a round trip through the server (each pipe write that
wakes another process costs ~0.1 ms on busy cores, as much as a warm call); only the first is
running and its deadline starts when it does; if the worker is killed, the calls queued
behind the failed one are moved to another worker (a call queued behind a slow one waits for
it, so latency-sensitive callers use ``prefetch=1``).

Isolation, per worker (and so per call):

- Deadline: wall clock, enforced by the server: at expiry the worker's process group is
  SIGKILLed. ``workers`` calls run at once, so N hanging calls cost ~ceil(N/workers) deadlines.
- Processes a call leaves behind are killed: a worker is a child subreaper, so whatever a call
  starts stays its descendant even when orphaned; if a child process (or a thread) is left
  after a call that returned, the worker's group is killed. A process that left the group
  (setsid) is orphaned to the server, a subreaper too, which kills it by pid.
- Limits (setrlimit): address space = what the worker already maps + ``memory_mb`` (RLIMIT_AS
  counts virtual memory, so the imports do not eat the budget); CPU time = the call's timeout
  rounded up + 1 s (a backstop; the wall deadline is what is enforced); file size 64 MiB; no
  core dumps.
- Output: fd 0 is /dev/null and fd 1/2 go to /dev/null or ``log_path``, so ``print``,
  ``os.system`` or a C library writing to fd 1 cannot touch the protocol, which uses its own
  close-on-exec pipes. Every other inherited fd is closed.
- Fork bombs: as root, RLIMIT_NPROC is not enforced, so a worker switches to uid/gid 65534
  with RLIMIT_NPROC set and no_new_privs, keeping CAP_DAC_READ_SEARCH and, without a sandbox,
  CAP_DAC_OVERRIDE (ambient, so programs it runs keep them): user code reads and writes where
  the user can — a verifier appending to a file in the working directory works — and what it
  creates belongs to uid 65534. Neither capability lifts RLIMIT_NPROC. Under bwrap the
  filesystem stays read-only (a read-only mount, whatever the capabilities) but its private /tmp.
  Not root: the kernel already enforces the user's own process limit. (Alternatives weighed: a
  pids cgroup guarantees a hard limit without the uid switch, but needs a writable cgroup
  hierarchy, which most containers lack; a worker counting and killing its descendants races a
  fast fork bomb. The uid switch holds wherever the pool runs as root.)
- Parent death: the server gets SIGTERM when the trainer thread that spawned it dies
  (PR_SET_PDEATHSIG; the pool spawns from one long-lived thread so that is the pool's life)
  and kills every worker group; EOF on its request pipe does the same. Workers get SIGKILL
  when the server dies. Under bwrap, ``--die-with-parent`` and the pid namespace add that
  nothing of the sandbox outlives bwrap.
- ``sandbox="bwrap"``: the server and workers run under bubblewrap: no network
  (``--unshare-net``), the host filesystem read-only, a private writable /tmp, own /dev,
  /proc, pid and IPC namespaces, a new session; as root only the capabilities the server
  needs to set workers up are kept. Asked for and unavailable is an error, never a fallback.
  ``hide_paths=[...]`` covers folders (the project, a run directory) with empty read-only
  tmpfs mounts so sandboxed code cannot read them; the Python installation, the relayrl
  package and the preloaded functions' own modules stay visible beneath (``RewardRunner`` hides
  the working folder and the home folder, as the ``python`` tool does). ``tmp_size_mb`` caps
  the private /tmp (it is memory).

Limits of the guarantees: ``sandbox="none"`` is resource control, not a security boundary
(the code can read and write what the trainer can, and signal what uid 65534 owns). Calls of one worker share a process, so module state
one call leaves is seen by the next call of that worker. The RLIMIT_NPROC budget is shared
by every process of uid 65534 on the machine. Under ``none``, a grandchild process of an
in-flight call can outlive a server that is SIGKILLed itself (not the trainer: that path
cleans up); bwrap's pid namespace closes that.

Modules: ``pool`` (the trainer's side: ``WorkerPool``, its futures and reader thread, spawning
the server), ``server`` (the server's poll loop and the workers' call loop), ``isolation``
(prctl, fds, limits, privilege drop, leftover processes, bubblewrap) and ``common`` (the
exceptions, loading functions by spec, ``_poll``).
"""

from relayrl.workers.common import CallFailed, ImportFailed, PoolError, SandboxUnavailable, load
from relayrl.workers.isolation import FILE_SIZE_LIMIT, NOBODY, die_with_parent
from relayrl.workers.pool import WorkerPool
from relayrl.workers.server import MAX_REPLY_BYTES, SWEEP_FOR_S

__all__ = ["WorkerPool", "CallFailed", "PoolError", "ImportFailed", "SandboxUnavailable", "load", "die_with_parent",
           "NOBODY", "FILE_SIZE_LIMIT", "MAX_REPLY_BYTES", "SWEEP_FOR_S"]
