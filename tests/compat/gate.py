"""pytest hooks for the compatibility tests (marked ``lmcache`` or ``vllm``; tests/conftest.py
imports them).

* A skipped compatibility test is counted under its reason on pytest's summary line
  (``12 skipped (KVLOOKUP_LMCACHE_PYTHON is not set (scripts/real-peers.sh))``), not among
  the other skips, and a closing section says how to run them.
* With ``KVLOOKUP_REAL_PEERS=1`` (``scripts/test.sh`` and CI, after scripts/real-peers.sh) a
  skip is a failure: the run that promises the real peers cannot pass without them.
"""

from __future__ import annotations

import os

import pytest

MARKS = ("lmcache", "vllm")


def compat(keywords) -> bool:
    return any(mark in keywords for mark in MARKS)


def skip_reason(report) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason.removeprefix("Skipped: ")


def required() -> bool:
    return os.environ.get("KVLOOKUP_REAL_PEERS") == "1"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and compat(item.keywords) and not hasattr(report, "wasxfail") and required():
        report.outcome = "failed"
        report.longrepr = (f"compatibility test skipped although KVLOOKUP_REAL_PEERS=1 "
                           f"(scripts/real-peers.sh ran?): {skip_reason(report)}")


def pytest_report_teststatus(report, config):
    if report.skipped and compat(report.keywords) and not hasattr(report, "wasxfail"):
        return f"skipped ({skip_reason(report)})", "s", "SKIPPED (compatibility)"
    return None


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    skipped = {key: len(reports) for key, reports in terminalreporter.stats.items()
               if key.startswith("skipped (") and reports}
    if not skipped:
        return
    terminalreporter.section("compatibility tests not run")
    for key, count in sorted(skipped.items()):
        terminalreporter.line(f"{count} {key}")
    terminalreporter.line("to build the real LMCache and vLLM peers and run them: "
                          "KVLOOKUP_REAL_PEERS=1 bash scripts/test.sh")
