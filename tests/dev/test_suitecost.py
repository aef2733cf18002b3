"""What the suite costs (shimdev.envs.suitecost, its hooks in tests/conftest.py): CPU seconds and sglang
server starts per test and per worker, servers started twice named, the ungrouped server tests
collected first."""
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

import conftest
from shimdev.envs import suitecost
from shimdev.server import models, process

REPO = Path(__file__).resolve().parents[2]


def test_a_test_s_cost_counts_its_children_and_its_servers_trees_and_the_servers_it_started(monkeypatch):
    monkeypatch.setattr(process, "STARTED", ["sglang 0.5.9 shim=on"])
    monkeypatch.setattr(process, "COST", {"server_cpu_s": 0.0, "reaped_cpu_s": 0.0})
    mark = suitecost.now()
    subprocess.run([sys.executable, "-c", "import time\nt = time.process_time()\n"
                    "while time.process_time() - t < 0.5: pass"], check=True)
    process.STARTED.append("sglang 0.5.11 shim=absent")
    process.COST["server_cpu_s"] += 7.0  # a server tree, read from /proc as it stopped ...
    process.COST["reaped_cpu_s"] += 2.0  # ... of which its launcher reached RUSAGE_CHILDREN too
    cost = suitecost.since(mark)
    assert 5.4 <= cost["cpu_s"] < 7.0, cost
    assert cost["server_starts"] == ["sglang 0.5.11 shim=absent"]


def test_a_session_s_tree_cpu_is_read_from_proc_every_process_of_it():
    """A server's launcher may leave its children to init (never reaped here): each process of the
    session counts."""
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass\n"
    leader = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time\n"
                               "subprocess.Popen([sys.executable, '-c', %r])\n" % (burn + "time.sleep(60)") +
                               burn + "time.sleep(60)"], start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while process.tree_cpu_seconds(leader.pid) < 0.75 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert 0.75 <= process.tree_cpu_seconds(leader.pid) < 5
        assert len(process.session_pids(leader.pid)) == 2
    finally:
        os.killpg(leader.pid, signal.SIGKILL)
        leader.wait()


def test_two_servers_started_alike_have_one_config_and_any_difference_shows():
    model = models.ensure_model("qwen2", "0.5.11")

    def config(**kw):
        options = dict(args=["--tp-size", "2", "--enable-metrics"], shim="on",
                       env={"SIMNPU_TOTAL_MIB": 512, "SIMNPU_JOURNAL_DIR": "/tmp/a",
                            "SGLANG_ZBAL_BOOTSTRAP_URL": "tcp://127.0.0.1:%d" % process.free_port()})
        options.update(kw)
        return process.Server("0.5.11", model, **options).config()

    one = config()
    assert one == config() == config(env={"SIMNPU_TOTAL_MIB": 512, "SIMNPU_JOURNAL_DIR": "/tmp/b",
                                          "SGLANG_ZBAL_BOOTSTRAP_URL": "tcp://127.0.0.1:20001"})
    assert one.startswith("sglang 0.5.11 shim=on --disable-cuda-graph ")
    assert "--tp-size 2 --enable-metrics" in one and "SIMNPU_TOTAL_MIB=512" in one
    assert "--port" not in one and "--nccl-port" not in one and "--device" not in one
    assert len({one, config(shim="absent"), config(graphs=True), config(args=["--tp-size", "1"]),
                config(env={"SIMNPU_TOTAL_MIB": 1024})}) == 5


def test_the_summary_sums_per_worker_and_names_servers_started_twice():
    a, b = "sglang 0.5.9 shim=on", "sglang 0.5.9 shim=absent"
    lines = suitecost.summary([("t1", "gw0", {"cpu_s": 30.0, "server_starts": [a, b]}),
                               ("t2", "gw1", {"cpu_s": 2.5, "server_starts": []}),
                               ("t3", "gw0", {"cpu_s": 40.0, "server_starts": [a]})], top=2)
    assert lines == ["gw0: 70 CPU s in 2 tests, 3 sglang server starts",
                     "gw1: 2 CPU s in 1 tests, 0 sglang server starts",
                     "3 sglang server starts of 2 configurations",
                     "started 2 times: %s (by t1, t3)" % a,
                     "   40.0 CPU s  1 starts  t3",
                     "   30.0 CPU s  2 starts  t1"]


def _item(name, group=None, fixtures=(), params=None):
    """A collected test of file ``tests/<name>`` (as much of one as conftest's hooks read):
    ``fixtures``: (name, scope, where it is defined)."""
    marks = [group] if group else []
    item = types.SimpleNamespace(
        path=Path("/x") / name, nodeid="tests/%s::test_x" % name, name=name + (group or ""),
        get_closest_marker=lambda marker: (marks or [None])[0] if marker == "xdist_group" else None,
        add_marker=marks.append,
        _fixtureinfo=types.SimpleNamespace(name2fixturedefs={
            fixture: [types.SimpleNamespace(scope=scope, baseid=baseid)] for fixture, scope, baseid in fixtures}))
    if params is not None:
        item.callspec = types.SimpleNamespace(params=params)
    return item


def test_the_tests_that_share_a_module_fixture_of_their_module_run_in_one_group():
    own = ("scenarios", "module", "tests/test_m.py")
    assert conftest.module_group(_item("test_m.py", fixtures=[own])) == "module:tests/test_m.py"
    # one group per parameter of that fixture (the releases of one file may go to both workers)
    assert conftest.module_group(_item("test_m.py", fixtures=[own, ("tmp_path", "function", "")],
                                       params={"scenarios": "0.5.9", "other": 1})) == (
        "module:tests/test_m.py:scenarios=0.5.9")
    # none: no module fixture, one of conftest's (a session's), or a group of its own already
    assert conftest.module_group(_item("test_m.py", fixtures=[("tmp_path", "function", "")])) is None
    assert conftest.module_group(_item("test_m.py", fixtures=[("servers", "module", "tests")])) is None
    assert conftest.module_group(_item("test_m.py", "server-0.5.9", fixtures=[own])) is None
    items = [_item("test_m.py", fixtures=[own], params={"scenarios": "a b]@c"}), _item("test_n.py")]
    conftest.pytest_collection_modifyitems(types.SimpleNamespace(option=types.SimpleNamespace()), items)
    assert items[0].get_closest_marker("xdist_group").args == ("module:tests/test_m.py:scenarios=a_b__c",)
    assert items[1].get_closest_marker("xdist_group") is None


def test_the_server_tests_outside_any_group_are_collected_first_the_rest_in_order():
    items = [_item("test_a.py"), _item("test_real_server.py", "@server-0.5.9"), _item("test_b.py"),
             _item("test_real_server.py"), _item("test_real_server_moe.py", "@server-moe"),
             _item("test_real_server_mla.py")]
    order = list(items)
    conftest.pytest_collection_modifyitems(types.SimpleNamespace(option=types.SimpleNamespace()), items)
    assert items == [order[3], order[5], order[0], order[1], order[2], order[4]]


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one process", "two xdist workers"])
def test_every_run_ends_with_its_cost(workers):
    chosen = ["tests/test_layout.py::test_no_init_py_makes_a_packaging_folder_of_the_tooling",
              "tests/test_layout.py::test_the_repository_root_exposes_only_the_shim"]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *workers, *chosen],
                          cwd=str(REPO), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = proc.stdout[proc.stdout.index("cost: CPU seconds and sglang server starts"):]
    names = ["main"] if not workers else ["gw0", "gw1"]
    tests = sum(int(line.split(" in ")[1].split()[0]) for line in report.splitlines()
                if line.split(":")[0] in names)
    assert tests == 2, report
    assert "0 sglang server starts of 0 configurations" in report
    assert chosen[0] in report and chosen[1] in report


def test_under_loadgroup_a_group_s_tests_run_on_one_worker():
    """xdist 3.8 writes the group to ``_nodeid``, which pytest 9 does not read: conftest puts it in
    the test's id, where the scheduler reads it (here: test_status.py's tests that take its module
    fixture, one group; the others single)."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-n", "2", "--dist",
                           "loadgroup", "tests/cli/test_status.py"], cwd=str(REPO), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ran = [(line.split()[0], line.split(" PASSED ")[1].strip()) for line in proc.stdout.splitlines()
           if " PASSED " in line and line.startswith("[gw")]
    grouped = {worker for worker, nodeid in ran if nodeid.endswith("@module:tests/cli/test_status.py")}
    assert len(grouped) == 1, ran
    assert len([n for _, n in ran if "@" in n]) >= 5 and len(ran) > len([n for _, n in ran if "@" in n]), ran


def test_an_mla_decode_server_with_graphs_is_named_apart_from_its_eager_twin(tmp_path):
    from shimdev.server import mla

    eager = mla.decode_server("0.5.11", 2, "on", tmp_path, "eager")
    graphs = mla.decode_server("0.5.11", 2, "on", tmp_path, "on", graphs=True)
    assert "--disable-cuda-graph" in eager.config() and "--disable-cuda-graph" not in graphs.config()
    flag = " ".join([mla.graph_bs_flag("0.5.11"), *map(str, mla.GRAPH_BATCH_SIZES)])
    assert flag in graphs.config() and flag not in eager.config()
    assert graphs.argv[graphs.argv.index("sglang.launch_server") + 1:] == graphs.args
