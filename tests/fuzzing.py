"""What the fuzz tests (``tests/test_fuzz_*.py``) and ``benchmarks/fuzz.py`` share: running one case of the
command line in-process, with a deadline, and the promise it is checked against.

The promise (README, "bad input"): every bad input is refused before any work as one line on stderr,
``relayrl: <kind> error: ...``, exit status 2, naming what was wrong (the key, the file, the row); an input
that is not bad is accepted. Never a traceback, a hang, or an exit status other than 0 and 2.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import signal
import time
from dataclasses import dataclass
from unittest import mock

import yaml

ACCEPTED = "accepted"


class Hang(BaseException):
    """A case past its deadline (BaseException: no ``except Exception`` in relayrl may swallow it)."""


@contextlib.contextmanager
def deadline(seconds: float):
    """``Hang`` in this (main) thread after ``seconds``."""
    def ring(signum, frame):
        raise Hang(f"no answer within {seconds:g}s")

    old = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


class Accepted(Exception):
    """The input passed every check and reached the run itself (stubbed: no model is loaded)."""


def _accept(cfg, *args, **kw):
    """Stands in for the run: an accepted config must also dump as JSON and as the run's config.yaml, and that
    file must load back to the same config (a value that loads but cannot be written would fail mid-run)."""
    import tempfile

    from relayrl.config import load_config, resolved_tree

    json.dumps(cfg.model_dump(mode="json"))  # (what a checkpoint's state.json records)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        f.write(yaml.safe_dump(resolved_tree(cfg), sort_keys=False))
        f.flush()
        again = resolved_tree(load_config(f.name))
    same = json.dumps(again, sort_keys=True) == json.dumps(resolved_tree(cfg), sort_keys=True)  # (NaN == NaN here)
    assert same, "the run's config.yaml does not load back to the same config"
    raise Accepted()


@dataclass
class Outcome:
    code: int | str  # the exit status, ACCEPTED, or what escaped ("RecursionError: ...", "hang")
    err: str
    out: str
    seconds: float


@functools.cache
def parser():
    """``relayrl.cli._parser``, built once: building it (every field's --help text, three times) is most of what a
    refused case costs (~40 of ~50 ms); argparse parses with the same parser any number of times."""
    from relayrl.cli import _parser

    built = _parser()
    return lambda: built


def _built(*args, **kw):
    raise Accepted()


def run_cli(argv: list[str], timeout_s: float = 30.0, at: str = "run") -> Outcome:
    """``relayrl <argv>`` in-process; ``at="run"``: the run itself replaced by ``_accept`` (the config's checks);
    ``at="build"``: the run goes as far as building its components (data, trackers, resume checks), no further."""
    from relayrl.cli import main

    err, out = io.StringIO(), io.StringIO()
    t0 = time.perf_counter()
    stubs = ([mock.patch("relayrl.run.loop.train", _accept), mock.patch("relayrl.run.sft.sft", _accept),
              mock.patch("relayrl.run.build.evaluate_only", _accept)]
             if at == "run" else [mock.patch("relayrl.run.loop.build", _built)])
    stubs.append(mock.patch("relayrl.cli._parser", parser()))
    with contextlib.ExitStack() as stack:
        for s in stubs:
            stack.enter_context(s)
        stack.enter_context(contextlib.redirect_stderr(err))
        stack.enter_context(contextlib.redirect_stdout(out))
        try:
            with deadline(timeout_s):
                code: int | str = main(argv)
        except Accepted:
            code = ACCEPTED
        except Hang:
            code = "hang"
        except BaseException as e:  # noqa: BLE001 - what escaped main is the finding
            code = f"{type(e).__name__}: {str(e)[:200]}"
    return Outcome(code, err.getvalue(), out.getvalue(), time.perf_counter() - t0)


def refusal_problem(o: Outcome, names: list[str] = ()) -> str | None:
    """What is wrong with how a bad input was refused (None: one line, exit 2, naming one of ``names``)."""
    if o.code != 2:
        return f"exit {o.code}"
    lines = o.err.splitlines()
    if len(lines) != 1 or not o.err.endswith("\n"):
        return f"{len(lines)} lines on stderr"
    if not o.err.startswith("relayrl: ") or " error: " not in o.err:
        return "not 'relayrl: <kind> error: ...'"
    if "Traceback" in o.err + o.out:
        return "a traceback"
    if names and not any(n[:40] in o.err or _shown(n)[:40] in o.err for n in names):
        return f"names none of {list(names)[:4]}"
    return None


def _shown(text: str) -> str:
    """``text`` as ``relayrl.cli.error_line`` shows it (control characters and lone surrogates escaped)."""
    from relayrl.cli import error_line

    return error_line("x", ValueError(text)).removeprefix("relayrl: x error: ")


def handled_problem(o: Outcome, names: list[str] = ()) -> str | None:
    """For an input that may be good or bad: accepted, or refused as ``refusal_problem`` wants."""
    return None if o.code == ACCEPTED else refusal_problem(o, names)


def signature(problem: str, o: Outcome) -> str:
    """A failure's kind, to count distinct failures: the problem and the message with its values left out."""
    import re

    text = o.code if isinstance(o.code, str) and o.code not in (ACCEPTED,) else o.err
    return problem.split(" ")[0] + " | " + re.sub(r"'[^']*'|\"[^\"]*\"|\d+|/\S+", "_", str(text))[:100]
