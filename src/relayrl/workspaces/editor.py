"""The file editor of ``env.name=workspace``, run inside the workspace's sandbox as the command user:
``python -I -S editor.py OP`` with the arguments as JSON on stdin; its answer on stdout, exit status 1 with
the error's text when the operation is refused. Standard library only.

    view         a file's lines start_line..end_line, numbered (a folder: its entries, two levels deep)
    create       a new file with content (refused when the path exists)
    str_replace  old_str -> new_str, where old_str occurs exactly once (refused when it is absent or repeated)
"""

import json
import os
import sys

_MAX_VIEW = 400  # lines shown at most by one view


def _lines(text: str, start: int) -> str:
    return "\n".join(f"{n:6}\t{line}" for n, line in enumerate(text.split("\n"), start))


def view(path: str, start_line: int = 1, end_line: int = -1) -> str:
    if os.path.isdir(path):
        out = []
        for root, dirs, files in os.walk(path):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            depth = root[len(path):].count(os.sep)
            if depth >= 2:
                dirs[:] = []
            out += [os.path.relpath(os.path.join(root, f), path) for f in sorted(files) if not f.startswith(".")]
        return "\n".join(out) or "(empty folder)"
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().split("\n")
    start = max(int(start_line), 1)
    end = len(lines) if int(end_line) == -1 else min(int(end_line), len(lines))
    if start > len(lines):
        raise ValueError(f"start_line {start} is past the end of {path} ({len(lines)} lines)")
    end = min(end, start + _MAX_VIEW - 1)
    return _lines("\n".join(lines[start - 1:end]), start)


def create(path: str, content: str) -> str:
    if os.path.lexists(path):
        raise ValueError(f"{path} exists already: change it with str_replace")
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    with open(path, "x", encoding="utf-8") as f:
        f.write(content)
    return f"created {path}"


def str_replace(path: str, old_str: str, new_str: str) -> str:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if not old_str:
        raise ValueError("old_str is empty")
    n = text.count(old_str)
    if n == 0:
        raise ValueError(f"old_str was not found in {path} (it must match exactly, whitespace included)")
    if n > 1:
        at = [text[:i].count("\n") + 1 for i in _find_all(text, old_str)]
        raise ValueError(f"old_str is not unique in {path}: {n} occurrences (lines {', '.join(map(str, at))}); "
                         "include more lines around it")
    i = text.index(old_str)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text.replace(old_str, new_str, 1))
    first = text[:i].count("\n") + 1
    snippet = (text[:i] + new_str + text[i + len(old_str):]).split("\n")
    lo, hi = max(first - 3, 1), min(first + new_str.count("\n") + 3, len(snippet))
    return f"edited {path}:\n" + _lines("\n".join(snippet[lo - 1:hi]), lo)


def _find_all(text: str, sub: str):
    i = text.find(sub)
    while i != -1:
        yield i
        i = text.find(sub, i + 1)


def main() -> int:
    ops = {"view": view, "create": create, "str_replace": str_replace}
    try:
        args = json.loads(sys.stdin.read())
        print(ops[sys.argv[1]](**args))
        return 0
    except (OSError, ValueError, TypeError, KeyError, UnicodeDecodeError) as e:
        print(e if isinstance(e, ValueError) else f"{type(e).__name__}: {e}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
