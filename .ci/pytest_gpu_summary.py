"""pytest plugin: say at the very end how many tests marked ``gpu`` ran and were skipped.

``make test`` loads it (``-p pytest_gpu_summary`` with ``.ci`` on ``PYTHONPATH``) so that a
run on a machine without a GPU states plainly how much of the suite it did not exercise.
It only observes reports; it never skips or deselects anything itself.
"""

import sys

# nodeid -> "passed" | "failed" | "skipped" | "xfailed" | "xpassed"
_outcomes: dict[str, str] = {}


def pytest_runtest_logreport(report):
    if "gpu" not in report.keywords:
        return
    xfail = hasattr(report, "wasxfail")
    if report.failed:
        _outcomes[report.nodeid] = "failed"
    elif report.skipped:
        _outcomes.setdefault(report.nodeid, "xfailed" if xfail else "skipped")
    elif report.when == "call":
        _outcomes.setdefault(report.nodeid, "xpassed" if xfail else "passed")


def pytest_unconfigure(config):
    # Runs after pytest's own final line, so this is the last thing the run prints.
    if config.option.collectonly or getattr(config, "workerinput", None) is not None:
        return
    counts: dict[str, int] = {}
    for outcome in _outcomes.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    torch = sys.modules.get("torch")
    if torch is None:  # under pytest-xdist the controller never imported it
        try:
            import torch
        except ImportError:
            torch = None
    gpu = "unknown" if torch is None else str(torch.cuda.is_available())
    if not _outcomes:
        print(f"GPU tests (marked gpu): none ran (torch.cuda.is_available(): {gpu})", flush=True)
        return
    detail = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
    print(
        f"GPU tests (marked gpu): {counts.get('skipped', 0)} of {len(_outcomes)} skipped "
        f"({detail}; torch.cuda.is_available(): {gpu})",
        flush=True,
    )
