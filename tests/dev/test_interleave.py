"""shimdev.bench.interleave, the benchmarks' worker processes (scripts/bench_hot_path.py): the plumbing,
not any timing -- set-up facts come back, requests are answered in alternating order, a failure in
a worker is an error with its traceback, a worker that dies says so with its stderr."""
import sys

import pytest

from shimdev.bench import interleave

ECHO = r'''
import os
SETUP_INFO = {"pid": os.getpid()}
print("noise on stdout is skipped")
def serve(request):
    with open(request["log"], "a") as handle:
        handle.write(NAME + "\n")
    if request.get("fail"):
        raise ValueError("asked to fail")
    if request.get("die"):
        import sys
        sys.stderr.write("dying on purpose\n")
        os._exit(3)
    return {"name": NAME, "round": request["round"]}
'''


def worker(name):
    return interleave.Worker(name, [sys.executable], None, "NAME = %r\n" % name + ECHO, timeout=60)


def test_alternate_asks_each_worker_once_a_round_the_order_reversed_every_other_round(tmp_path):
    log = tmp_path / "order"
    workers = interleave.start_all([(n, [sys.executable], None, "NAME = %r\n" % n + ECHO) for n in ("a", "b")])
    try:
        assert workers[0].info["pid"] != workers[1].info["pid"]
        answers = interleave.alternate(workers, 4, {"log": str(log)})
    finally:
        for w in workers:
            w.close()
    assert log.read_text().split() == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert answers == {name: [{"name": name, "round": r} for r in range(4)] for name in ("a", "b")}
    assert all(w.proc.returncode == 0 for w in workers)


def test_an_error_in_serve_comes_back_with_its_traceback_and_the_worker_goes_on(tmp_path):
    with worker("a") as w:
        with pytest.raises(interleave.WorkerError, match=r"(?s)a: Traceback.*ValueError: asked to fail"):
            w.ask({"log": str(tmp_path / "log"), "fail": True})
        assert w.ask({"log": str(tmp_path / "log"), "round": 7}) == {"name": "a", "round": 7}


def test_a_worker_that_dies_is_an_error_with_its_stderr(tmp_path):
    with worker("a") as w:
        with pytest.raises(interleave.WorkerError, match=r"(?s)exited 3 without answering.*dying on purpose"):
            w.ask({"log": str(tmp_path / "log"), "die": True})


def test_a_set_up_that_fails_is_an_error_and_start_all_closes_the_workers_it_started():
    ok = (("a", [sys.executable], None, "NAME = 'a'\n" + ECHO),
          ("b", [sys.executable], None, "raise SystemExit('no set-up here')"))
    with pytest.raises(interleave.WorkerError, match="(?s)b: exited 1 without answering.*no set-up here"):
        interleave.start_all(ok)


def test_turns_reverse_the_order_every_other_round():
    assert interleave.turns(3, ("off", "on")) == [(0, "off"), (0, "on"), (1, "on"), (1, "off"), (2, "off"), (2, "on")]
    assert interleave.turns(0, ("a", "b")) == []
