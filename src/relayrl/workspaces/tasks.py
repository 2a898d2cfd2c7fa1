"""Tasks in SWE-bench's instance format, read from a data file's rows.

A row with ``instance_id``, ``repo``, ``base_commit`` and ``problem_statement`` is a workspace task: its
prompt is the problem statement, its id the instance id, and its episodes (``env.name=workspace`` or an
agent program) each get a workspace of ``repo`` at ``base_commit`` and a reward from the tests
(``relayrl.workspaces.grading``). ``repo`` is a local git repository's path (relative to the data file, or
absolute); ``test_patch`` the diff that adds the tests (applied only where they run, never in the policy's
workspace); ``FAIL_TO_PASS`` and ``PASS_TO_PASS`` test ids (lists, or JSON strings of lists as SWE-bench's
datasets store them). Optional: ``test_cmd`` (a shell command run in the workspace, printing pytest's ``-rA``
summary; default: pytest on the test patch's files and the ids' files) and ``test_timeout_s`` (default 120).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

FIELDS = ("instance_id", "repo", "base_commit", "problem_statement")  # what makes a row a workspace task
KEY = "workspace_task"  # a Prompt's metadata key holding its Task's fields


@dataclass(frozen=True)
class Task:
    instance_id: str
    repo: str  # an absolute path
    base_commit: str
    problem_statement: str
    test_patch: str = ""
    fail_to_pass: list[str] = field(default_factory=list)
    pass_to_pass: list[str] = field(default_factory=list)
    test_cmd: str | None = None
    test_timeout_s: float = 120.0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def of(cls, prompt) -> Task | None:
        """The task of a ``Prompt`` (None when its row was not one)."""
        d = (prompt.metadata or {}).get(KEY)
        return cls(**d) if d else None


def is_task(row: dict) -> bool:
    return all(f in row for f in FIELDS)


def _ids(value, at: str) -> list[str]:
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else []
        except json.JSONDecodeError as e:
            raise ValueError(f"{at}: not a list of test ids nor a JSON string of one ({e})") from None
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(t, str) and t for t in value):
        raise ValueError(f"{at}: expected a list of test ids (strings)")
    return list(value)


def from_row(row: dict, data_path: str, where: str) -> Task:
    """The row's task, checked: its repository and commit exist and its test patch applies there (a broken
    task is an input error naming the row and field, never a 0 reward)."""
    from relayrl.workspaces.sandbox import check_patch, prepare

    for f in FIELDS:
        if not isinstance(row[f], str) or not row[f].strip():
            raise ValueError(f"{where}: field '{f}' must be a non-empty string")
    repo = Path(row["repo"]).expanduser()
    if not repo.is_absolute():
        repo = Path(data_path).resolve().parent / repo
    test_patch = row.get("test_patch") or ""
    if not isinstance(test_patch, str):
        raise ValueError(f"{where}: field 'test_patch' must be a string (a diff)")
    timeout = row.get("test_timeout_s", 120.0)
    if not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"{where}: field 'test_timeout_s' must be a positive number of seconds")
    task = Task(row["instance_id"].strip(), str(repo), row["base_commit"].strip(), row["problem_statement"], test_patch,
                _ids(row.get("FAIL_TO_PASS"), f"{where}: field 'FAIL_TO_PASS'"),
                _ids(row.get("PASS_TO_PASS"), f"{where}: field 'PASS_TO_PASS'"), row.get("test_cmd") or None,
                float(timeout))
    if not task.fail_to_pass:
        raise ValueError(f"{where}: field 'FAIL_TO_PASS' names no test: nothing would tell a fix from no fix")
    try:
        lower = prepare(task.repo, task.base_commit)
    except ValueError as e:
        raise ValueError(f"{where}: field 'repo'/'base_commit': {e}") from None
    why = check_patch(lower, test_patch)
    if why:
        raise ValueError(f"{where}: field 'test_patch' does not apply at {task.base_commit}: {why}")
    return task
