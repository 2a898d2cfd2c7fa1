"""The fuzz suite at scale: the strategies and checks of ``tests/test_fuzz_*.py``, driven by hypothesis with a
random seed for many more cases than CI runs (which runs a fixed, derandomized budget of each), counting
tried / passed / distinct failures per family. The promise checked: every bad input one line, exit 2, naming
the key, file or row, before any work; user code that fails counted and never a reward; every endpoint answer
200 or a 4xx in OpenAI's shape. Target: 0 tracebacks, 0 hangs, 0 silent rewards, 0 HTTP 500s.

    python benchmarks/fuzz.py                       # ~10,500 cases (the default counts below)
    python benchmarks/fuzz.py --scale 0.1 --seed 7  # a tenth of them

Writes benchmarks/results/fuzz.json and fuzz.md: per family the cases tried and passed, and each distinct
failure with a count and its first case.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # (tests/ holds the strategies and checks)

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402

from benchmarks.common import machine_info, write_results  # noqa: E402

COUNTS = {"config overrides": 3000, "config files": 2000, "data files": 2000, "reasoning_gym specs": 300,
          "verifier calls": 700, "endpoint requests": 2500}


def families(stack: contextlib.ExitStack) -> dict:
    """family -> (strategy, check(case) -> (problem or None, what it showed)); fixtures built once here."""
    import tests.test_fuzz_config as fc
    import tests.test_fuzz_data as fd
    import tests.test_fuzz_endpoint as fe
    import tests.test_fuzz_verifiers as fv
    from relayrl.rewards.verifiers import RewardRunner

    def in_tmp(check):
        def run(*args):
            with tempfile.TemporaryDirectory() as root:
                return check(*args, root)
        return run

    runner = stack.enter_context(contextlib.closing(RewardRunner(fv.SPEC, timeout_s=fv.TIMEOUT_S, workers=2,
                                                                 memory_mb=fv.MEMORY_MB)))
    endpoint = stack.enter_context(_endpoint(fe))
    return {
        "config overrides": (fc.st.tuples(fc.OVERRIDES, fc.COMMANDS),
                             in_tmp(lambda case, root: fc.override_problem(case[0], root, cmd=case[1])[0])),
        "config files": (fc.yaml_texts(), in_tmp(lambda text, root: fc.yaml_problem(text, root)[0])),
        "data files": (fd.data_files(), in_tmp(lambda case, root: fd.data_problem(*case, root)[0])),
        "reasoning_gym specs": (fd.SPECS, in_tmp(lambda spec, root: fd.spec_problem(spec, root)[0])),
        "verifier calls": (fv.st.lists(fv.CALLS, min_size=1, max_size=6), lambda calls: fv.score_problem(runner, calls)),
        "endpoint requests": (fe.REQUESTS, lambda req: fe.request_problem(endpoint, *req)),
    }


@contextlib.contextmanager
def _endpoint(fe):
    """The endpoint test's server: a tiny model's tokenizer with a chat template, a scripted engine."""
    import torch

    from relayrl.demo import model as demo_model
    from tests.conftest import TINY

    with tempfile.TemporaryDirectory() as path:
        torch.manual_seed(0)
        recipe = {**demo_model.RECIPE, **TINY}
        tok = demo_model.build_tokenizer(recipe["seed"], recipe["vocab_size"])
        demo_model.build_model(tok, recipe).save_pretrained(path)
        tok.save_pretrained(path)
        with fe.open_endpoint(path) as served:
            yield served


def drive(name: str, strategy, check, n: int, seed: int) -> dict:
    """``n`` cases of one family; never stops at a failure (each is counted, by kind)."""
    tried, passed, kinds, first = 0, 0, Counter(), {}

    @settings(max_examples=n, deadline=None, database=None, derandomize=False, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def one(case):
        nonlocal tried, passed
        tried += 1
        try:
            problem = check(case)
        except BaseException as e:  # noqa: BLE001 - the harness must go on; the escape is the finding
            problem = f"the check itself failed: {type(e).__name__}: {e}"
        if problem is None:
            passed += 1
            return
        kind = " ".join(str(problem).split()[:6])[:120]
        kinds[kind] += 1
        first.setdefault(kind, f"{case!r:.300}")

    t0 = time.perf_counter()
    seeded(one, seed)()
    seconds = time.perf_counter() - t0
    print(f"{name}: {tried} tried, {passed} passed, {len(kinds)} distinct failures ({seconds:.0f}s)", flush=True)
    return {"tried": tried, "passed": passed, "failures": dict(kinds), "first": first, "seconds": round(seconds, 1)}


def seeded(test, seed: int):
    from hypothesis import seed as hypothesis_seed

    return hypothesis_seed(seed)(test)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=float, default=1.0, help="times the default counts")
    ap.add_argument("--seed", type=int, default=int(time.time()))
    ap.add_argument("--only", nargs="*", help="families to run (default: all)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    results = {}
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory() as cwd, contextlib.chdir(cwd):
        for name, (strategy, check) in families(stack).items():  # (in a scratch folder: nothing lands in yours)
            if args.only and name not in args.only:
                continue
            results[name] = drive(name, strategy, check, max(1, round(COUNTS[name] * args.scale)), args.seed)
    rows = [[name, r["tried"], r["passed"], len(r["failures"]), r["seconds"]] for name, r in results.items()]
    total = [sum(r["tried"] for r in results.values()), sum(r["passed"] for r in results.values()),
             sum(len(r["failures"]) for r in results.values())]
    rows.append(["all", *total, round(sum(r["seconds"] for r in results.values()), 1)])
    write_results(Path(args.out), "fuzz", ["family", "tried", "passed", "distinct failures", "seconds"], rows,
                  {"machine": machine_info(), "seed": args.seed, "results": results})
    for name, r in results.items():
        for kind, n in r["failures"].items():
            print(f"  {name}: {n}× {kind}\n      first: {r['first'][kind]}")


if __name__ == "__main__":
    main()
