"""What the suite costs, in quantities a busy machine does not change: each test's CPU seconds and
the sglang servers it started, summed per xdist worker (tests/conftest.py reports them after every
run; the suite's time budget is watched with them, wall-clock time being noise on shared cores).

* a test's CPU seconds: its worker process's (user + system), the children that process reaped
  (``RUSAGE_CHILDREN``), and the whole process tree of every sglang server it stopped, read from
  /proc as the server stops (``shimdev.server.process``; a server's processes that its launcher
  leaves to init never reach ``RUSAGE_CHILDREN``) -- what the launcher reaped while stopping is
  taken out of the children's, so nothing counts twice;
* its server starts: the configuration of each (``Server.config``); one started more than once
  in a run is named, with the tests that started it (a cache that missed, a pool that stopped a
  server a later test needed again, or a group split over both workers).

Servers kept for the session (a worker's pool) are counted in the test that stops them, usually
the worker's last: the per-worker sums are exact, a test's share is where its servers stopped.
"""
from __future__ import annotations

import resource
from collections import defaultdict

from shimdev.server import process

#: The name of the teardown report's user property that carries a test's cost to the controller.
PROPERTY = "npu_shim_cost"


def now() -> tuple[float, int]:
    """(CPU seconds so far of this process, its reaped children and its stopped servers' trees,
    the number of servers it started)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime
           - process.COST["reaped_cpu_s"] + process.COST["server_cpu_s"])
    return cpu, len(process.STARTED)


def since(mark: tuple[float, int]) -> dict:
    """The cost since ``mark`` (``now()``): ``{"cpu_s": seconds, "server_starts": [config, ...]}``."""
    cpu, starts = now()
    return {"cpu_s": round(cpu - mark[0], 2), "server_starts": list(process.STARTED[mark[1]:starts])}


def summary(costs, top: int = 15) -> list[str]:
    """The report's lines for ``costs``: ``[(nodeid, worker, cost), ...]`` (cost as ``since``
    gives it): per worker its CPU seconds and server starts, then the servers started more than
    once in the run, then the ``top`` tests by CPU seconds."""
    workers = defaultdict(lambda: [0.0, 0, 0])
    started = defaultdict(list)
    for nodeid, worker, cost in costs:
        workers[worker][0] += cost["cpu_s"]
        workers[worker][1] += len(cost["server_starts"])
        workers[worker][2] += 1
        for config in cost["server_starts"]:
            started[config].append(nodeid)
    total_starts = sum(len(tests) for tests in started.values())
    lines = ["%s: %.0f CPU s in %d tests, %d sglang server starts" % (worker, cpu, n, starts)
             for worker, (cpu, starts, n) in sorted(workers.items())]
    lines.append("%d sglang server starts of %d configurations" % (total_starts, len(started)))
    for config, tests in sorted(started.items()):
        if len(tests) > 1:
            lines.append("started %d times: %s (by %s)" % (len(tests), config, ", ".join(tests)))
    ranked = sorted(costs, key=lambda c: -c[2]["cpu_s"])[:top]
    lines += ["%7.1f CPU s %2d starts  %s" % (cost["cpu_s"], len(cost["server_starts"]), nodeid)
              for nodeid, _, cost in ranked]
    return lines
