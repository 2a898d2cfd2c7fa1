"""The environment guide's "Your own environment in 20 lines" (docs/guides/environments.md), run as written: its Python and YAML blocks
saved under the names their first lines give, then its shell block run in that folder."""

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

GUIDE = Path(__file__).parent.parent / "docs" / "guides" / "environments.md"


def section_blocks() -> list[tuple[str, str]]:
    text = GUIDE.read_text()
    start = text.index("## Your own environment in 20 lines")
    end = text.find("\n## ", start + 3)
    end = len(text) if end < 0 else end
    return re.findall(r"```(\w+)\n(.*?)```", text[start:end], re.DOTALL)


@pytest.mark.slow
def test_the_guides_environment_trains_as_written(tmp_path):
    blocks = section_blocks()
    assert [lang for lang, _ in blocks] == ["python", "yaml", "bash"]
    for lang, body in blocks[:2]:
        name = body.splitlines()[0].removeprefix("# ").strip()
        (tmp_path / name).write_text(body)
    python_lines = [x for x in blocks[0][1].splitlines() if x.strip()]
    assert len(python_lines) <= 25, len(python_lines)  # the promise in the heading, give or take the docstring
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(["bash", "-e", "-c", blocks[2][1]], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "runs" / "weather"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 5 and 5 * 3 * 2 <= summary["samples"] <= 5 * 3 * 8  # adaptive budgets: 2 to 8 each
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert all("tool_call_rate" in r and "turns_mean" in r for r in rows)
    # the example's environment does what the README says (the demo model, trained on products,
    # rarely thinks of asking for the weather)
    sys.path.insert(0, str(tmp_path))
    try:
        from weather_env import WeatherEnv
    finally:
        sys.path.remove(str(tmp_path))
    from relayrl.records import Prompt

    env = WeatherEnv(timeout_s=1.0)
    asyncio.run(env.reset(Prompt("paris", [{"role": "user", "content": "How warm?"}], answer="18")))
    call = asyncio.run(env.step('<tool_call>{"name": "temperature", "arguments": {"city": "Paris"}}</tool_call>'))
    assert call.messages == [{"role": "tool", "name": "temperature", "content": "18"}] and not call.done
    assert asyncio.run(env.step("It is 18 degrees.")).reward == 1.0
    assert asyncio.run(env.step("It is 20 degrees.")).reward == 0.0
