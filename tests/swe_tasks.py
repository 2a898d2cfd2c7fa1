"""A tiny task in SWE-bench's instance format, made in a test's folder: a git repository whose ``add`` is
wrong, a later commit that fixes it (the future a checkout must not show), a test patch adding the test
that catches it, and the fixes and hacks a policy might try."""

import json
import subprocess
from pathlib import Path

CALC = "def add(a, b):\n    return a - b\n\n\ndef zero():\n    return 0\n"
OLD_TESTS = "from calc import zero\n\n\ndef test_zero():\n    assert zero() == 0\n"
TEST_PATCH = """diff --git a/tests/test_add.py b/tests/test_add.py
new file mode 100644
--- /dev/null
+++ b/tests/test_add.py
@@ -0,0 +1,5 @@
+from calc import add
+
+
+def test_add():
+    assert add(2, 3) == 5
"""
FIX = "sed -i 's/a - b/a + b/' calc.py"  # the right fix, as a shell command
NOTHING = "true"
EDIT_TESTS = "mkdir -p tests && printf 'def test_add():\\n    pass\\n' > tests/test_add.py"  # writes the test itself
FORGE = ("printf '%s\\n' 'import pytest' '@pytest.hookimpl(hookwrapper=True)' 'def pytest_runtest_makereport(item, call):'"
         " '    out = yield' '    out.get_result().outcome = \"passed\"' > conftest.py")  # reports every test passed


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                          capture_output=True, text=True).stdout.strip()


def make_task(folder: Path, name: str = "calc-1") -> dict:
    """The repository under ``folder`` and the task's row (``repo`` relative to ``folder``)."""
    repo = folder / "repos" / "calc"
    (repo / "tests").mkdir(parents=True)
    (repo / "calc.py").write_text(CALC)
    (repo / "tests" / "test_zero.py").write_text(OLD_TESTS)
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "base")
    base = git(repo, "rev-parse", "HEAD")
    (repo / "calc.py").write_text(CALC.replace("a - b", "a + b"))
    git(repo, "commit", "-qam", "the fix (in the future of the task)")
    git(repo, "tag", "v2")
    return {"instance_id": name, "repo": "repos/calc", "base_commit": base,
            "problem_statement": "add(2, 3) returns -1 instead of 5.", "test_patch": TEST_PATCH,
            "FAIL_TO_PASS": json.dumps(["tests/test_add.py::test_add"]), "PASS_TO_PASS": ["tests/test_zero.py::test_zero"]}


def write_tasks(folder: Path, rows: list[dict]) -> Path:
    path = folder / "tasks.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
