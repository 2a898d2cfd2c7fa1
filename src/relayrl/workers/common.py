"""What the trainer's side, the server and the workers share: the exceptions, loading
functions by spec, and ``_poll``. See ``relayrl.workers`` for the design."""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import math
import os
import select
import sys
from typing import Callable


class CallFailed(Exception):
    """A call that returned no value. ``kind``: error | timeout | oom | crashed."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class PoolError(RuntimeError):
    """The pool itself failed: its server could not start or died, or the pool is closed."""


class ImportFailed(ValueError):
    """A preloaded function spec cannot be imported (raised by the constructor)."""


class SandboxUnavailable(RuntimeError):
    """``sandbox="bwrap"`` was asked for but bubblewrap is missing or cannot run here."""


# ---------------------------------------------------------------- loading functions by spec

_loaded: dict[str, Callable] = {}


def load(spec: str, cwd: str | None = None) -> Callable:
    """The function named by ``"module:function"`` (importable from ``cwd``, like ``python -c``)
    or ``"path/to/file.py:function"`` (relative to ``cwd``, or absolute). Cached per process, so
    what the server loads before forking is free in its workers."""
    fn = _loaded.get(spec)
    if fn is None:
        fn = _loaded[spec] = _import(spec, os.path.abspath(cwd or os.getcwd()))
    return fn


def _import(spec: str, cwd: str) -> Callable:
    target, sep, name = spec.rpartition(":")
    if not (sep and target and name):
        raise ImportFailed(f"{spec!r} is not 'module:function' or 'path/to/file.py:function'")
    try:
        if target.endswith(".py") or "/" in target:
            module = _import_file(os.path.join(cwd, os.path.expanduser(target)))
        else:
            if cwd not in sys.path:
                sys.path.insert(0, cwd)
            module = importlib.import_module(target)
    except BaseException as e:  # any failure of the user's module, sys.exit and KeyboardInterrupt at import too
        raise ImportFailed(f"{spec!r} cannot be imported: {_describe(e)}{where(e)}") from None
    fn = getattr(module, name, None)
    if fn is None:  # (a misspelled name: said with the file's own names, not the private module's)
        names = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_")
                       and getattr(v, "__module__", None) == module.__name__)
        raise ImportFailed(f"{spec!r}: {target} has no {name!r}; the functions it defines: "
                           f"{', '.join(names) or 'none'}")
    if not callable(fn):
        raise ImportFailed(f"{spec!r} is not callable")
    return fn


def _import_file(path: str):
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no file {path}")
    folder, stem = os.path.split(os.path.splitext(path)[0])
    if folder not in sys.path:
        sys.path.insert(0, folder)  # so the file can import its neighbours
    # a private module name: a user's math.py must not replace the stdlib's math
    name = f"relayrl_user_{stem}_{abs(hash(path)):x}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickle look the module up by name
    spec.loader.exec_module(module)
    return module


def locate(spec: str, cwd: str) -> list[str]:
    """Where ``load(spec, cwd)`` would find the function's module, found without running it (a
    user's module must not run in the trainer): the file of a file spec or of a top-level
    module, the folder(s) of the top-level package of a dotted one (its submodules import one
    another); [] for a module that is not a file (built-in) or not found (``load`` says so)."""
    target = spec.rpartition(":")[0]
    if not target:
        return []
    if target.endswith(".py") or "/" in target:
        path = os.path.join(cwd, os.path.expanduser(target))
        return [os.path.realpath(path)] if os.path.isfile(path) else []
    try:
        found = importlib.machinery.PathFinder.find_spec(target.partition(".")[0], [cwd, *sys.path])
    except (ImportError, ValueError):  # a malformed name: load() reports it
        found = None
    if found is None:
        return []
    places = list(found.submodule_search_locations or []) or ([found.origin] if found.has_location else [])
    return [os.path.realpath(p) for p in places if p and os.path.exists(p)]


def _describe(e: BaseException) -> str:
    try:
        text = str(e)
    except Exception:
        text = "<unprintable>"
    return f"{type(e).__name__}: {text}"[:2000] if text else type(e).__name__


_OURS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # relayrl's own source


def where(e: BaseException, frames: int = 2) -> str:
    """`` (at my_reward.py:12 in score: return metadata['b'])``: the innermost of the traceback's frames in the
    user's code (not relayrl's, not the standard library's or an installed package's), the file relative to
    the working folder where it is in it; '' when there is none."""
    import traceback

    skip = (_OURS, os.path.dirname(os.__file__))
    mine = [f for f in traceback.extract_tb(e.__traceback__)
            if not f.filename.startswith(skip) and "site-packages" not in f.filename and not f.filename.startswith("<")]
    if not mine:
        return ""
    shown = []
    for f in mine[-frames:]:
        path = os.path.relpath(f.filename) if f.filename.startswith(os.getcwd() + os.sep) else f.filename
        shown.append(f"{path}:{f.lineno} in {f.name}" + (f": {f.line.strip()[:120]}" if f.line else ""))
    return f" (at {' < '.join(reversed(shown))})"


# ---------------------------------------------------------------- pipes


def _poll(reads: list[int], writes: list[int], timeout: float | None) -> tuple[set[int], set[int]]:
    """select() for any fd number (select.select fails on fds >= 1024, which a busy trainer
    may well hand us). An fd that hung up or failed counts as readable: the read says how."""
    poller = select.poll()
    for fd in reads:
        poller.register(fd, select.POLLIN)
    for fd in writes:
        poller.register(fd, select.POLLOUT | (select.POLLIN if fd in reads else 0))
    events = poller.poll(None if timeout is None else math.ceil(timeout * 1000))
    readable = {fd for fd, ev in events if ev & (select.POLLIN | select.POLLHUP | select.POLLERR) and fd in reads}
    writable = {fd for fd, ev in events if ev & (select.POLLOUT | select.POLLERR | select.POLLHUP) and fd in writes}
    return readable, writable
