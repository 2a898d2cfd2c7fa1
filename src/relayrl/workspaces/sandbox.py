"""A workspace per episode: the task's repository at its commit, writable, in a fail-closed sandbox.

    lower = prepare(repo, commit)                    # once per (repository, commit): a time-safe checkout
    ws = await Workspace.start(lower, Limits())      # ~60 ms: an overlay on the shared checkout
    r = await ws.run("python -m pytest -q", timeout=30)   # r.exit_code, r.output (bounded), r.timed_out
    await ws.close()                                 # nothing of it is left

``prepare`` fetches the commit and its ancestors only into a fresh repository (no remote, no later
commit, branch or tag: ``git log --all`` shows no future), checks that nothing else came with it, and
caches it read-only by (repository, commit) under ``cache_dir()``; as root its files belong to uid 65534,
the uid commands run as.

``Workspace.start`` runs ``keeper.py`` under bubblewrap: no network, own pid, IPC and mount namespaces,
the host read-only, the home and working folders hidden (``relayrl.workers.private_folders``), a private
/tmp of ``Limits.disk_mb`` (tmpfs: its pages are memory) holding the overlay's upper layer, the workspace at
``/tmp/workspace`` (``Workspace.path``), and the checkout bound read-only beneath it. The keeper needs
CAP_SYS_ADMIN to mount the overlay (and DAC_OVERRIDE, FOWNER, CHOWN for overlayfs's work folder); as another
user than root bwrap gives it none, the mount is refused and the workspace is a copy (``Workspace.mode``
says which; small repositories copy in milliseconds too). Commands never hold a capability.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from relayrl.workers import NOBODY
from relayrl.workers.common import SandboxUnavailable
from relayrl.workers.isolation import _bwrap_prefix, _count_tasks, _python_paths, private_folders

PATH = "/tmp/workspace"  # where commands see the workspace
_LOWER, _SCRATCH = "/tmp/.lower", "/tmp/.scratch"
_KEEPER = str(Path(__file__).with_name("keeper.py"))
_KEEPER_CAPS = ("CAP_SYS_ADMIN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_CHOWN")


class WorkspaceError(RuntimeError):
    """The workspace itself failed (its sandbox, its mount, its keeper): infrastructure, never a 0 reward."""


@dataclass(frozen=True)
class Limits:
    """Per workspace: each command's address space and processes (uid 65534's, on the whole machine),
    the largest file a command writes, and the private /tmp holding every change (RAM: a tmpfs)."""

    memory_mb: int = 1024
    disk_mb: int = 256
    file_mb: int = 64
    procs: int = 256
    output_chars: int = 10000  # kept of a command's output: the first and the last this many, the rest cut


@dataclass(frozen=True)
class Result:
    """What a command did: its exit status (None when its deadline passed), its output (stdout and stderr
    as one stream, cut in the middle past the limit, with a note), whether it timed out."""

    exit_code: int | None
    output: str
    timed_out: bool = False


def cache_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"relayrl-{os.getuid()}" / "workspace-checkouts"


def _git(*args: str, cwd: str | Path | None = None, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "GIT_CONFIG_NOSYSTEM": "1", "GIT_TERMINAL_PROMPT": "0"}
    return subprocess.run(["git", *args], cwd=cwd, input=stdin, capture_output=True, text=True, env=env, timeout=600)


def prepare(repo: str | Path, commit: str, cache: Path | None = None) -> Path:
    """The checkout of ``repo`` at ``commit`` that workspaces share (made once; ValueError naming what is
    missing)."""
    repo = os.path.realpath(repo)
    if not os.path.isdir(repo) or _git("rev-parse", "--git-dir", cwd=repo).returncode != 0:
        raise ValueError(f"repo {repo!r} is not a git repository")
    found = _git("rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}", cwd=repo)
    if found.returncode != 0:
        raise ValueError(f"repo {repo!r} has no commit {commit!r}")
    sha = found.stdout.strip()
    cache = cache or cache_dir()
    dest = cache / hashlib.sha256(f"{repo}\0{sha}".encode()).hexdigest()[:20]
    if (dest / "ready").exists():
        return dest / "tree"
    cache.mkdir(parents=True, exist_ok=True)
    os.chmod(cache.parent, 0o700)  # (the checkouts are uid 65534's as root: no one else reaches them from outside)
    tmp = Path(tempfile.mkdtemp(dir=cache, prefix=".new-"))
    try:
        tree = tmp / "tree"
        for args in (("init", "-q", "-b", "main", str(tree)), ("-C", str(tree), "fetch", "-q", "--no-tags", repo, sha),
                     ("-C", str(tree), "checkout", "-q", "--detach", sha), ("-C", str(tree), "branch", "-f", "main", sha),
                     ("-C", str(tree), "checkout", "-q", "main"), ("-C", str(tree), "config", "user.name", "agent"),
                     ("-C", str(tree), "config", "user.email", "agent@workspace")):
            r = _git(*args)
            if r.returncode != 0:
                raise ValueError(f"repo {repo!r} at {commit!r}: git {' '.join(args[2:4])} failed: {r.stderr.strip()[:300]}")
        (tree / ".git" / "FETCH_HEAD").unlink(missing_ok=True)
        _git("-C", str(tree), "reflog", "expire", "--expire=now", "--all")
        later = _git("-C", str(tree), "rev-list", "--all", "--not", sha).stdout.split()
        if later:  # (by construction none: checked, as SWE-bench checks its images)
            raise ValueError(f"repo {repo!r}: the checkout at {commit!r} holds {len(later)} later commits")
        if os.geteuid() == 0:
            for root, dirs, files in os.walk(tree):
                for name in [*dirs, *files]:
                    os.lchown(os.path.join(root, name), NOBODY, NOBODY)
            os.chown(tree, NOBODY, NOBODY)
        (tmp / "ready").touch()
        try:
            os.rename(tmp, dest)
        except OSError:  # another process made it first
            shutil.rmtree(tmp, ignore_errors=True)
        tmp = None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return dest / "tree"


def check_patch(lower: Path, patch: str) -> str | None:
    """Why ``patch`` does not apply to the checkout (None when it does); nothing is changed."""
    if not patch.strip():
        return None
    r = _git("apply", "--check", "-", cwd=lower, stdin=patch)
    return None if r.returncode == 0 else (r.stderr.strip() or "git apply --check failed")[:500]


def _prefix(lower: Path, limits: Limits) -> list[str]:
    from relayrl.workers.pool import _package_root

    keep = [*_python_paths(), os.path.join(_package_root(), "relayrl")]
    under_tmp = sorted(os.path.realpath(f) for f in keep if f.startswith("/tmp/"))
    binds = [f for f in under_tmp if not any(f.startswith(g + "/") for g in under_tmp)]
    cmd = _bwrap_prefix(binds, private_folders(), keep, limits.disk_mb)[:-1]
    cmd += ["--ro-bind", str(lower), _LOWER]
    if os.geteuid() == 0:
        cmd += [a for cap in _KEEPER_CAPS for a in ("--cap-add", cap)]
    return cmd + ["--"]


class Workspace:
    """One episode's workspace (see the module doc); ``run`` and ``close`` from the event loop that
    started it."""

    path = PATH

    def __init__(self, proc: asyncio.subprocess.Process, mode: str, limits: Limits):
        self.proc, self.mode, self.limits = proc, mode, limits
        self._lock = asyncio.Lock()
        self.closed = False

    @classmethod
    async def start(cls, lower: Path, limits: Limits = Limits(), timeout_s: float = 60.0, copy: bool = False) -> Workspace:
        """``copy``: a copy of the checkout, never the overlay (what a kernel refusing it gets; measured against)."""
        root = os.geteuid() == 0
        settings = {"lower": _LOWER, "path": PATH, "scratch": _SCRATCH, "uid": NOBODY if root else None,
                    "nproc": _count_tasks(NOBODY) + limits.procs if root else None, "memory_mb": limits.memory_mb,
                    "file_mb": limits.file_mb, "copy": copy,
                    "bin_path": f"{os.path.dirname(sys.executable)}:/usr/local/bin:/usr/bin:/bin"}
        cmd = _prefix(lower, limits) + [sys.executable, "-I", "-S", _KEEPER, json.dumps(settings)]
        try:
            proc = await asyncio.create_subprocess_exec(
                *cmd, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                start_new_session=True, limit=1 << 26)
        except OSError as e:
            raise SandboxUnavailable(f"a workspace's sandbox cannot start: {e}") from None
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), timeout_s)
        except asyncio.TimeoutError:
            line = b""
        ready = json.loads(line) if line.strip() else {}
        if not ready.get("ready"):
            proc.kill()
            err = (await proc.stderr.read()).decode(errors="replace").strip()
            await proc.wait()
            raise WorkspaceError(f"a workspace did not start: {ready.get('error') or err[:500] or 'no reply'}")
        return cls(proc, ready["mode"], limits)

    async def run(self, command: str | list[str], timeout: float = 30.0, stdin: str | None = None,
                  keep: int | None = None) -> Result:
        """``command`` (a string: run by ``bash -c``) in the workspace folder; its ``Result``."""
        argv = ["bash", "-c", command] if isinstance(command, str) else list(command)
        req = {"argv": argv, "stdin": stdin, "timeout": float(timeout), "keep": keep or self.limits.output_chars}
        async with self._lock:
            if self.closed:
                raise WorkspaceError("the workspace is closed")
            try:
                self.proc.stdin.write(json.dumps(req).encode() + b"\n")
                await self.proc.stdin.drain()
                line = await asyncio.wait_for(self.proc.stdout.readline(), timeout + 30)
            except (OSError, asyncio.TimeoutError) as e:
                line = b""
                why = f"{type(e).__name__}: {e}"
            else:
                why = "its sandbox ended" if not line else ""
            if not line:
                await self._kill()
                raise WorkspaceError(f"the workspace's keeper did not answer ({why})")
        reply = json.loads(line)
        if reply["error"]:
            raise WorkspaceError(f"a command could not start in the workspace: {reply['error']}")
        return Result(reply["exit_code"], reply["output"], reply["timed_out"])

    async def close(self) -> None:
        """Ends the sandbox; its processes, mounts and files go with it."""
        if self.closed:
            return
        self.closed = True
        try:
            self.proc.stdin.close()
            await asyncio.wait_for(self.proc.wait(), 10)
        except (OSError, asyncio.TimeoutError):
            await self._kill()

    async def _kill(self) -> None:
        self.closed = True
        if self.proc.returncode is None:
            try:
                os.killpg(self.proc.pid, 9)
            except OSError:
                pass
            await self.proc.wait()

    async def __aenter__(self) -> Workspace:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
