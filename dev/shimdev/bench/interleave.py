"""Benchmark arms in persistent worker processes, timed in alternating rounds.

Two processes that must not share an interpreter (two sglang releases, two builds of wrapt) are
compared on a shared, loaded machine only if the load hits both alike: each arm is a ``Worker``
that sets itself up once, then answers requests on its stdin; ``alternate`` asks them in turn,
round after round, the order reversed every other round (``turns``), so only one arm runs at a time
and a burst of load lands on both.  Used by scripts/bench_hot_path.py (dev/shimdev/bench/hot_path_bench.py);
``turns`` also orders the server benchmarks' starts and loads (scripts/bench_*_server.py).

A worker is ``argv + ["-c", script]`` where the script is the given setup ``code``, which defines
``serve(request) -> JSON-able`` (and may set ``SETUP_INFO``), followed by a loop: one JSON request
per stdin line (``null`` ends it), one reply per request on stdout, on a line of its own that
starts with ``MARK`` (whatever else the process prints is skipped).  Its stderr goes to a file,
whose tail a failure carries.
"""
from __future__ import annotations

import json
import os
import queue
import subprocess
import tempfile
import threading

MARK = "@@interleave "

_LOOP = r'''
import json as _ijson, sys as _isys, traceback as _itb
def _ireply(obj):
    _isys.stdout.write("\n" + {mark!r} + _ijson.dumps(obj, default=repr) + "\n")
    _isys.stdout.flush()
_ireply({{"ready": globals().get("SETUP_INFO")}})
for _iline in _isys.stdin:
    _ireq = _ijson.loads(_iline)
    if _ireq is None:
        break
    try:
        _ireply({{"ok": serve(_ireq)}})
    except BaseException:
        _ireply({{"error": _itb.format_exc()[-3000:]}})
'''


class WorkerError(RuntimeError):
    """A worker failed to start, answered with an error, died or did not answer in time."""


class Worker:
    """One arm in a process of its own; ``with Worker(...) as w: w.info; w.ask(request)``."""

    def __init__(self, name, argv, env, code, cwd=None, timeout=900):
        self.name, self.timeout = name, timeout
        self._err = tempfile.NamedTemporaryFile(prefix="npu-shim-worker-", suffix=".err", delete=False)
        self._cwd = tempfile.mkdtemp(prefix="npu-shim-worker-") if cwd is None else None
        script = code + "\n" + _LOOP.format(mark=MARK)
        self.proc = subprocess.Popen(list(argv) + ["-c", script], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._err, text=True, env=env,
                                     cwd=cwd or self._cwd, bufsize=1)
        self._lines = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.info = self._reply()["ready"]

    def _read(self):
        for line in self.proc.stdout:
            if line.startswith(MARK):
                self._lines.put(line[len(MARK):])
        self._lines.put(None)  # end of output: the process exited

    def stderr_tail(self, lines=40):
        try:
            with open(self._err.name, encoding="utf-8", errors="replace") as handle:
                return "\n".join(handle.read().splitlines()[-lines:])
        except OSError:
            return ""

    def _reply(self):
        try:
            line = self._lines.get(timeout=self.timeout)
        except queue.Empty:
            raise WorkerError("%s: no answer in %d s\n%s" % (self.name, self.timeout, self.stderr_tail())) from None
        if line is None:
            raise WorkerError("%s: exited %s without answering\n%s"
                              % (self.name, self.proc.wait(), self.stderr_tail()))
        reply = json.loads(line)
        if "error" in reply:
            raise WorkerError("%s: %s" % (self.name, reply["error"]))
        return reply

    def ask(self, request):
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._reply()["ok"]

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("null\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        for path in (self._err.name,):
            try:
                os.unlink(path)
            except OSError:
                pass
        if self._cwd:
            try:
                os.rmdir(self._cwd)
            except OSError:
                pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def turns(rounds, arms):
    """``[(round, arm), ...]``: each arm once per round, the order reversed every other round -- the
    one order every side-by-side measurement here runs its arms in (workers, servers, loads)."""
    return [(index, arm) for index in range(rounds) for arm in (arms if index % 2 == 0 else arms[::-1])]


def alternate(workers, rounds, request=None):
    """Ask each worker ``request`` (with ``"round"`` set) once per round, in ``turns`` order;
    {worker name: [its answers in round order]}."""
    answers = {w.name: [] for w in workers}
    for index, worker in turns(rounds, list(workers)):
        answers[worker.name].append(worker.ask(dict(request or {}, round=index)))
    return answers


def start_all(specs):
    """Start workers from ``[(name, argv, env, code), ...]``; on a failure close the ones started."""
    started = []
    try:
        for name, argv, env, code in specs:
            started.append(Worker(name, argv, env, code))
    except BaseException:
        for worker in started:
            worker.close()
        raise
    return started
