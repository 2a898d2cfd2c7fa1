"""Tasks in SWE-bench's instance format that nobody here wrote: bug fixes of a real project, taken from its
releases on PyPI. The code, the bug, its fix and the tests that catch it are the project's authors'; the problem
statement is its changelog's line.

    python examples/pypi_swe_tasks.py OUT_DIR        # OUT_DIR/tasks.jsonl and OUT_DIR/repos/, then:
    relayrl train env.name=workspace data.path=OUT_DIR/tasks.jsonl ...

For each (package, old release, new release): the old release's source distribution, committed to a fresh git
repository, is the task's ``base_commit``; the test files the new release changed make its ``test_patch``; the
rest of the new release's change to the package's Python source is the gold ``patch`` (kept in the row, never
shown to a policy). FAIL_TO_PASS and PASS_TO_PASS are found as SWE-bench validates its tasks: the new tests run
on the old code and on the new (PASSED on the new and not on the old; PASSED on both).

Needs ``pip download`` to reach PyPI (the releases are cached in OUT_DIR/sdists). MIT-licensed: parse (Richard
Jones and contributors).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

# (package, old release, new release, the new release's changelog line as the problem statement)
RELEASES = [
    ("parse", "1.20.0", "1.20.1", "The `%f` directive must accept 1 to 6 digits of a fraction of a second, as "
     "`datetime.strptime` does; it accepts exactly 6. Also give `Parser` a `format` property returning the format "
     "string it was made from."),
    ("parse", "1.20.1", "1.20.2", "Template field names cannot contain a `-`: `parse('{user-id}', 'x')` fails. "
     "Field names with hyphens must work, also when two names differ only by `-` and `_`."),
]


def sdist(name: str, version: str, cache: Path) -> Path:
    """The release's source tree, unpacked under ``cache`` (downloaded once)."""
    tree = cache / f"{name}-{version}"
    if not tree.is_dir():
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        f"{name}=={version}", "-d", str(cache)], check=True)
        archive = next(cache.glob(f"{name}-{version}.tar.gz"))
        with tarfile.open(archive) as tar:
            tar.extractall(cache, filter="data")
    return tree


def _git(repo: Path, *args: str, stdin: str | None = None) -> str:
    return subprocess.run(["git", "-c", "user.name=relayrl", "-c", "user.email=tasks@relayrl", *args], cwd=repo,
                          check=True, capture_output=True, text=True, input=stdin).stdout


def _files(tree: Path) -> dict[str, bytes]:
    return {str(p.relative_to(tree)): p.read_bytes() for p in sorted(tree.rglob("*"))
            if p.is_file() and ".egg-info" not in str(p) and p.name != "PKG-INFO"}


def _statuses(old: dict, new_tests: dict) -> dict[str, str]:
    """Each test's status, the tests of ``new_tests`` run on the files of ``old`` (pytest -rA)."""
    from relayrl.workspaces.grading import parse_statuses

    with tempfile.TemporaryDirectory() as tmp:
        for path, data in {**old, **new_tests}.items():
            (Path(tmp) / path).parent.mkdir(parents=True, exist_ok=True)
            (Path(tmp) / path).write_bytes(data)
        r = subprocess.run([sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", *sorted(new_tests)],
                           cwd=tmp, capture_output=True, text=True, env={"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
                                                                           "PATH": "/usr/bin:/bin"})
        return parse_statuses(r.stdout)


def build(out: Path) -> Path:
    """``out/tasks.jsonl`` (and the repositories under ``out/repos``); returns its path."""
    rows = []
    for name, old_v, new_v, statement in RELEASES:
        old, new = _files(sdist(name, old_v, out / "sdists")), _files(sdist(name, new_v, out / "sdists"))
        tests = {p: d for p, d in new.items() if p.startswith("tests/") and old.get(p) != d}
        code = {p: d for p, d in new.items() if p.endswith(".py") and not p.startswith("tests/") and old.get(p) != d}
        repo = out / "repos" / f"{name}-{old_v}"
        if repo.exists():
            shutil.rmtree(repo)
        for path, data in old.items():
            (repo / path).parent.mkdir(parents=True, exist_ok=True)
            (repo / path).write_bytes(data)
        _git(repo, "init", "-q", "-b", "main")
        _git(repo, "add", "-A")
        _git(repo, "commit", "-qm", f"{name} {old_v}")
        base = _git(repo, "rev-parse", "HEAD").strip()
        patches = {}
        for which, files in (("test_patch", tests), ("patch", code)):
            for path, data in files.items():
                (repo / path).parent.mkdir(parents=True, exist_ok=True)
                (repo / path).write_bytes(data)
            _git(repo, "add", "-A")
            patches[which] = _git(repo, "diff", "--cached", "HEAD")
            _git(repo, "reset", "-q", "--hard", base)
        before, after = _statuses(old, tests), _statuses({**old, **code}, tests)
        rows.append({"instance_id": f"{name}-{new_v}", "repo": str(repo.relative_to(out)), "base_commit": base,
                     "problem_statement": statement, **patches,
                     "FAIL_TO_PASS": sorted(t for t, s in after.items() if s == "PASSED" and before.get(t) != "PASSED"),
                     "PASS_TO_PASS": sorted(t for t, s in after.items() if s == "PASSED" and before.get(t) == "PASSED")})
    path = out / "tasks.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python examples/pypi_swe_tasks.py OUT_DIR")
    print(build(Path(sys.argv[1]).resolve()))
