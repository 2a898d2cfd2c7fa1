"""Shared by the benchmark scripts: machine description and result tables (Markdown + JSON)."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

# Every prompt its group_size responses, every group trained: the work these benchmarks compare (and
# the default until 2026-11-24, when their README tables were measured); relayrl's default now adapts
# budgets and filters groups (README, Adaptive sampling), which changes the work done per step.
FIXED_GROUPS = ["rollout.budget=fixed", "rollout.dynamic_sampling=false"]


def machine_info() -> dict:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = None
    try:
        mem = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": mem, "gpu": gpu, "torch": torch.__version__,
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d")}


def results_dir(out: str | None, check: bool = False) -> Path:
    """Where a script writes its tables: ``--out``, else a new temporary folder for a run that only checks the
    script (its tiny scale: the committed results in benchmarks/results are not overwritten by it), else
    benchmarks/results (beside this file, from whatever folder the script runs)."""
    if out is not None:
        return Path(out)
    if check:
        import tempfile

        path = Path(tempfile.mkdtemp(prefix="relayrl-benchmark-check-"))
        print(f"a check of the script: its tables go to {path} (benchmarks/results is left as it is)", flush=True)
        return path
    return Path(__file__).resolve().parent / "results"


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def write_results(out: Path, name: str, header: list[str], rows: list[list[str]], data: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if (out / f"{name}.md").exists() and not os.environ.get("RELAYRL_BENCH_REPLACE"):
        # (a reader running a guide's command keeps the committed results: theirs go beside them, dated;
        # RELAYRL_BENCH_REPLACE=1 replaces them, as a developer recording new numbers does)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        print(f"{out / (name + '.md')} exists (committed results): writing {name}-{stamp} beside it "
              "(RELAYRL_BENCH_REPLACE=1 replaces it)")
        name = f"{name}-{stamp}"
    m = data["machine"]
    table = markdown_table(header, rows)
    gpu = f", GPU {m['gpu']}" if m.get("gpu") else ""
    note = f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB{gpu}, torch {m['torch']}, {m['date']}."
    (out / f"{name}.md").write_text(f"{table}\n\n{note}\n")
    (out / f"{name}.json").write_text(json.dumps({**data, "table": {"header": header, "rows": rows}}, indent=1))
    print(table)
    print(note)
    print(f"written: {out / (name + '.md')}, {out / (name + '.json')}")
