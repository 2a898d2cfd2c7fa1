"""The suite's two tiers and the fast tier's time budget (pytest hooks; conftest.py imports them).

- ``python -m pytest`` runs the **fast tier**: every test not marked ``slow``. Each of its tests has a budget
  (``--budget``: 20 s for the test's call by default, the environment's ``RELAYRL_TEST_BUDGET_S`` where a slower
  machine needs more, 0 for none): a test over it fails with its name and time, so the tier cannot drift slow
  unseen. A session fixture shared by several tests (a run trained once) is charged to the set-up of its first
  test, against ``--setup-budget`` (60 s).
- ``python -m pytest --tier slow`` runs the rest, ``--tier all`` everything (what `.ci/run` runs is both, one
  after the other). A ``-m`` expression, or a test named by its id (``file.py::test``), picks the tests itself.

Both print their slowest tests (``--durations``) and the order's seed (pytest-randomly shuffles the order: a
failure is replayed with ``-p randomly --randomly-seed=<seed>``)."""

from __future__ import annotations

import os

import pytest

BUDGET_S = 20.0
SETUP_BUDGET_S = 60.0


def pytest_addoption(parser):
    group = parser.getgroup("relayrl tiers")
    group.addoption("--tier", choices=("fast", "slow", "all"), default=None,
                    help="fast (the default): tests not marked slow; slow: the marked ones; all: both")
    group.addoption("--budget", type=float, default=None,
                    help=f"seconds a fast-tier test may take (default {BUDGET_S:g}, or $RELAYRL_TEST_BUDGET_S; 0: none)")
    group.addoption("--setup-budget", type=float, default=SETUP_BUDGET_S,
                    help="seconds a fast-tier test's set-up may take when it builds a shared session fixture")


def tier(config) -> str:
    """The tier this run selects: --tier, else 'all' where -m or test ids choose the tests, else 'fast'."""
    chosen = config.getoption("--tier")
    if chosen:
        return chosen
    if config.getoption("-m") or any("::" in str(a) for a in config.args):
        return "all"
    return "fast"


def budget(config) -> float:
    given = config.getoption("--budget")
    if given is None:
        given = float(os.environ.get("RELAYRL_TEST_BUDGET_S", BUDGET_S))
    return given if tier(config) == "fast" else 0.0


def pytest_collection_modifyitems(config, items):
    which = tier(config)
    if which == "all":
        return
    keep, dropped = [], []
    for item in items:
        (keep if (item.get_closest_marker("slow") is not None) == (which == "slow") else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    limit = budget(item.config)
    if not limit or not report.passed or report.when == "teardown":
        return
    # a set-up that builds a session fixture has a budget of its own; a test's call has the test's
    cap = item.config.getoption("--setup-budget") if report.when == "setup" else limit
    if report.duration > cap:
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid}: its {report.when} took {report.duration:.1f} s, over the fast tier's "
                           f"budget of {cap:g} s: make it faster (share a fixture, smaller inputs) or mark it slow")


def pytest_terminal_summary(terminalreporter, config):
    seed = getattr(config.option, "randomly_seed", None)
    if config.pluginmanager.hasplugin("randomly") and seed is not None:
        terminalreporter.write_line(f"tier {tier(config)}, test order shuffled with --randomly-seed={seed} "
                                    f"(replay: python -m pytest -p randomly --randomly-seed={seed} ...)")
    else:
        terminalreporter.write_line(f"tier {tier(config)}, tests in file order")
