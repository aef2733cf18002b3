"""npu_shim/cli/check.py where the shim never started: what the check child reports, and what
``print_report`` makes of it (the command itself, against bundles and bare venvs:
tests/test_drop_in.py)."""

import contextlib
import json
import os
import subprocess
import sys

import pytest

from test_bootstrap import REPO, last_json, run, tree  # noqa: F401 - ``tree`` is a fixture

NOT_STARTED = """
    import contextlib, io, json
    from npu_shim import _bootstrap
    from npu_shim.cli import check
    from npu_shim.runtime import activation
    before = {"wrapped": check.wrapped_targets([]), "records": activation.RUNTIME.records}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        check.child_main(_bootstrap.WATCHER)
    report = json.loads(out.getvalue().strip().splitlines()[-1][len("npu-shim-check:"):])
    report["bundle"] = check.bundle_facts()  # the parent's part of the report (``run_check``)
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        check.print_report(report)
    print(json.dumps({"before": before, "report": report, "text": text.getvalue()}))
"""


def test_check_in_a_process_where_the_shim_never_started(tree):
    """npu-shim's sitecustomize shadowed by the image's (``shim=False``): importing sglang's target
    modules changes nothing, and the report says the shim was not active without raising."""
    out = last_json(run(tree, NOT_STARTED, shim=False))
    assert out["before"] == {"wrapped": {}, "records": None}
    report = out["report"]
    assert report["shim_active"] is False and report["states"] == {} and report["wrapped"] == {}
    assert report["imports"] == {"sglang.srt.utils.common": "ok"}
    assert report["sglang"]["version"] == "0.5.9"
    assert report["wrapt"]["source"] == "image"  # where it would come from: nothing loaded it
    text = out["text"]
    assert "shim active at start-up: NO: npu-shim's sitecustomize did not arm it" in text
    assert "(no patch was decided: sglang's target modules were not imported with the shim on)" in text
    assert report["graphs"]["text"] in text and "  graphs: " in text


# -- the command under hostile output and the interpreter's flags ----------------------------------

# Written by a module the check child imports: bytes that are no UTF-8, a line that looks like the
# report's start but is not JSON, and one that is JSON but no report.
STRAY_OUTPUT = '''
import sys
sys.stdout.buffer.write(b"\\xff\\xfe stray bytes\\n"); sys.stdout.flush()
sys.stderr.buffer.write(b"\\xc3 half a character\\n"); sys.stderr.flush()
'''


def check_cli(tree, *args, flags=(), env=None):
    """``python [flags] -m npu_shim check [args]`` with the repository and the fake sglang."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("NPU_SHIM_", "SGLANG_", "PYTHON"))}
    full_env.update({"PYTHONPATH": os.pathsep.join([REPO, str(tree / "image"), str(tree / "pkgs")]),
                     "CHAIN_MARKER": str(tree / "marker"), "PYTHONDONTWRITEBYTECODE": "1"})
    full_env.update(env or {})
    return subprocess.run([sys.executable] + list(flags) + ["-m", "npu_shim", "check"] + list(args),
                          cwd=str(tree), env=full_env, capture_output=True, timeout=120)


def test_bytes_that_are_not_utf8_from_an_imported_module_cost_nothing(tree):
    """Before the fix the parent decoded the child's output strictly: a UnicodeDecodeError
    traceback instead of the report."""
    common = tree / "pkgs" / "sglang" / "srt" / "utils" / "common.py"
    common.write_text(common.read_text() + STRAY_OUTPUT)
    proc = check_cli(tree, "--json")
    assert b"Traceback" not in proc.stderr, proc.stderr
    report = json.loads(proc.stdout)
    assert report["imports"] == {"sglang.srt.utils.common": "ok"} and report["shim_active"] is True
    text = check_cli(tree, env={"LC_ALL": "C.UTF-8"})
    assert b"Traceback" not in text.stderr and text.stdout.startswith(b"npu-shim check: a child process")


def test_a_malformed_report_line_is_one_line_and_exit_4(tree):
    """A child that dies after printing the report's mark with no JSON after it (or a module that
    prints one): before the fix a JSONDecodeError traceback."""
    common = tree / "pkgs" / "sglang" / "srt" / "utils" / "common.py"
    for line in ('npu-shim-check:{"pid": 1', "npu-shim-check:[1, 2]", "npu-shim-check:{}"):
        common.write_text(common.read_text().split("\n# cut")[0] +
                          "\n# cut\nimport os, sys\nsys.stdout.write(%r + '\\n'); sys.stdout.flush(); "
                          "os._exit(0)\n" % line)
        proc = check_cli(tree)
        assert proc.returncode == 4, proc.stderr
        err = proc.stderr.decode()
        assert err.startswith("npu-shim check: the check process exited 0 with a malformed report line"), err
        assert "Traceback" not in err


def test_the_child_runs_with_the_interpreter_s_flags(tree):
    """``python -S -m npu_shim check``: a server started with -S runs no sitecustomize, so the shim
    is not active in it -- before the fix the child ran without -S and said "active: yes"."""
    proc = check_cli(tree, "--json", flags=["-S"])
    report = json.loads(proc.stdout)
    assert report["shim_active"] is False and report["states"] == {}
    assert proc.returncode == 4
    optimized = json.loads(check_cli(tree, "--json", flags=["-OO"]).stdout)
    assert optimized["shim_active"] is True


def test_a_stray_grandchild_of_the_check_child_is_gone_with_it(tree, tmp_path):
    """The check child leads its own process group: what a module it imported started is killed
    when the child is done (the grandchild here sleeps for a minute and writes its pid)."""
    pid_file = tmp_path / "grandchild.pid"
    sleeper = tmp_path / "sleeper.py"
    sleeper.write_text("import os, sys, time\nopen(sys.argv[1], 'w').write(str(os.getpid()))\ntime.sleep(60)\n")
    common = tree / "pkgs" / "sglang" / "srt" / "utils" / "common.py"
    common.write_text(common.read_text() + (
        "\nimport os as _os, subprocess as _sp, sys as _sys, time as _time\n"
        "_p = _sp.Popen([_sys.executable, %r, %r], stdout=_sp.DEVNULL, stderr=_sp.DEVNULL)\n"
        "while _p.poll() is None and not _os.path.exists(%r):\n    _time.sleep(0.05)\n"
        % (str(sleeper), str(pid_file), str(pid_file))))
    proc = check_cli(tree, "--json")
    assert json.loads(proc.stdout)["imports"] == {"sglang.srt.utils.common": "ok"}
    assert not _alive(int(pid_file.read_text()))


from test_children import alive as _alive, as_from_a_terminal  # noqa: E402 - shared by the cli tests


@contextlib.contextmanager
def _check_with_a_sleeping_child(tree, tmp_path, prefix=()):
    """``check`` (after ``prefix``: ``nohup``) whose child sleeps in an sglang import: (the
    command's Popen, the file the child's pid is written to once it sleeps); both killed after."""
    import signal
    import time

    pid_file = tmp_path / "child.pid"
    common = tree / "pkgs" / "sglang" / "srt" / "utils" / "common.py"
    common.write_text(common.read_text() + "\nimport os, time\nopen(%r, 'w').write(str(os.getpid()))\ntime.sleep(60)\n"
                      % str(pid_file))
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("NPU_SHIM_", "SGLANG_", "PYTHON"))}
    full_env.update({"PYTHONPATH": os.pathsep.join([REPO, str(tree / "image"), str(tree / "pkgs")]),
                     "CHAIN_MARKER": str(tree / "marker"), "PYTHONDONTWRITEBYTECODE": "1"})
    proc = subprocess.Popen(as_from_a_terminal(list(prefix) + [sys.executable, "-m", "npu_shim", "check"]),
                            cwd=str(tree), env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        time.sleep(0.1)
        yield proc, pid_file
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if pid_file.exists() and _alive(int(pid_file.read_text())):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


@pytest.mark.parametrize("signame", ["SIGHUP", "SIGTERM", "SIGINT", "SIGQUIT", "SIGUSR1", "SIGALRM"])
def test_a_stop_signal_ends_check_with_its_child_gone(tree, tmp_path, signame):
    """A closed ssh session (SIGHUP), a kill, Ctrl-C, Ctrl-\\ (SIGQUIT), a batch system's or a
    timer's signal: before the fixes SIGHUP and SIGTERM, then SIGQUIT, SIGUSR1 and SIGALRM ended
    the parent at once and left the check child (and what it started) running."""
    import signal

    with _check_with_a_sleeping_child(tree, tmp_path) as (proc, pid_file):
        proc.send_signal(getattr(signal, signame))
        _out, err = proc.communicate(timeout=30)
        assert proc.returncode == 128 + getattr(signal, signame), err
        assert err == "npu-shim check: stopped by %s; its child process group is gone\n" % signame, err
        assert not _alive(int(pid_file.read_text()))


def test_a_signal_ignored_by_nohup_does_not_stop_check(tree, tmp_path):
    """``nohup`` ignores SIGHUP so that a closed ssh session leaves the command running: before
    the fix ``check``'s own handler took SIGHUP over and stopped all the same."""
    import signal

    with _check_with_a_sleeping_child(tree, tmp_path, prefix=["nohup"]) as (proc, pid_file):
        proc.send_signal(signal.SIGHUP)
        with pytest.raises(subprocess.TimeoutExpired):
            proc.communicate(timeout=2)
        assert proc.poll() is None and _alive(int(pid_file.read_text()))
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=30)
        assert proc.returncode == 128 + signal.SIGTERM, err
        assert not _alive(int(pid_file.read_text()))


# -- property: whatever a child prints -------------------------------------------------------------

from hypothesis import given, strategies as st  # noqa: E402 - the property tests' imports, beside them

from npu_shim.cli import check, children  # noqa: E402 - the property tests' imports, beside them

LINES = st.one_of(st.text(max_size=40), st.just("npu-shim-check:"),
                  st.builds(lambda v: "npu-shim-check:" + v, st.text(max_size=40)),
                  st.builds(lambda v: "npu-shim-check:" + json.dumps(v), st.dictionaries(
                      st.sampled_from(check.REPORT_KEYS + ("x",)), st.integers(), max_size=12)))


@given(lines=st.lists(LINES, max_size=6), raw=st.binary(max_size=60))
def test_any_child_output_is_a_report_or_one_reason(lines, raw):
    """The parent's reading of a child's output (check's and selftest's): the last report line as
    a dict with every key print_report reads, or one reason -- never an exception."""
    out = "\n".join(lines) + raw.decode("utf-8", "backslashreplace")
    report, why = children.find_report(out, "npu-shim-check:", check.REPORT_KEYS)
    assert (report is None) != (why is None)
    if report is not None:
        assert set(check.REPORT_KEYS) <= set(report)
    assert "\n" not in children.last_words(out, "")


# -- whether graphs will be captured ---------------------------------------------------------------

class _Graph:
    """torch_npu's ``graph``: a context-manager class taking sglang's arguments."""

    def __init__(self, npu_graph, pool=None, stream=None, auto_dispatch_capture=False, capture_error_mode="global"):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _OldGraph(_Graph):
    def __init__(self, npu_graph, pool=None, stream=None):
        pass


class _NPUGraph:
    def replay(self):
        pass


def _npu(graph=_Graph, npu_graph=_NPUGraph):
    import types

    return types.SimpleNamespace(graph=graph, NPUGraph=npu_graph, graph_pool_handle=lambda: (0, 1),
                                 is_current_stream_capturing=lambda: False)


def _proc(tmp_path, commands):
    """A stand-in /proc: one directory per pid with its NUL-separated command line."""
    for pid, argv in commands.items():
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    return str(tmp_path)


def test_graphs_are_captured_by_default_where_torch_npu_has_the_graph_api(tmp_path):
    from npu_shim.cli import check

    facts = check.graph_facts(_npu(), proc=_proc(tmp_path, {}))
    assert facts["verdict"] == check.GRAPH_DEFAULT
    assert facts["api"] == {"present": list(check.GRAPH_API), "usable": True, "auto_dispatch_capture": True}
    assert facts["servers"] == []
    assert facts["text"].startswith("sglang captures decode graphs (target-verify too under speculative "
                                    "decoding) unless the server is started with --disable-cuda-graph; ")
    assert "auto_dispatch_capture accepted" in facts["text"]


def test_a_stub_or_missing_graph_api_says_capture_would_fail(tmp_path):
    import types

    from npu_shim.cli import check

    proc = _proc(tmp_path, {})
    stub = check.graph_facts(_npu(graph=lambda *a, **k: None), proc=proc)
    assert stub["api"]["usable"] is False and stub["api"]["present"] == list(check.GRAPH_API)
    assert stub["verdict"].startswith("NOT possible: torch_npu's graph API is missing here")
    assert "start it with --disable-cuda-graph" in stub["verdict"]
    bare = check.graph_facts(types.SimpleNamespace(), proc=proc)
    assert "(none present of graph, NPUGraph, graph_pool_handle, is_current_stream_capturing)" in bare["verdict"]
    old = check.graph_facts(_npu(graph=_OldGraph), proc=proc)
    assert old["api"]["auto_dispatch_capture"] is False and "auto_dispatch_capture NOT accepted" in old["text"]
    none = check.graph_facts(None, proc=proc)
    assert none["verdict"] == "no NPU torch here: no NPU graph is captured" and none["text"] == none["verdict"]


def test_server_commands_on_this_host_say_whether_they_capture(tmp_path):
    from npu_shim.cli import check

    proc = _proc(tmp_path, {
        101: ["python3", "-m", "sglang.launch_server", "--model-path", "m", "--disable-cuda-graph"],
        102: ["python3", "-m", "sglang.launch_server", "--model-path", "m", "--cuda-graph-bs", "1", "2"],
        103: ["sglang::scheduler_TP0"],  # a title, no arguments: not read
        104: ["tail", "-f", "sglang.launch_server.log"]})
    facts = check.graph_facts(_npu(), proc=proc)
    assert facts["servers"] == [{"pid": 101, "captures": False}, {"pid": 102, "captures": True}]
    assert "servers on this host: pid 101 has --disable-cuda-graph, pid 102 captures" in facts["text"]


def test_zbal_says_whether_a_capturing_server_gets_its_graph_pool(monkeypatch):
    """What a server that captures gets: the pool hooks the shim turns on, the operator's 1, or
    UNPOOLED for any other value (zbal reads it with int())."""
    from npu_shim.patches import zbal

    assert zbal.graph_pool_setting(None) == (True, "zbal pool hooks (ZBAL_ENABLE_GRAPH=1 set by the shim)")
    assert zbal.graph_pool_setting("01")[0] is True
    assert zbal.graph_pool_setting("0") == (False, "unpooled (ZBAL_ENABLE_GRAPH=0 set in the environment)")
    assert zbal.graph_pool_setting("yes")[0] is False
    monkeypatch.setenv("ZBAL_ENABLE_GRAPH", "0")
    from npu_shim.source import reading

    monkeypatch.setattr(reading, "find_package_dir", lambda name: "/z")
    monkeypatch.setattr(reading, "module_version", lambda names, path: "1.2.0")
    monkeypatch.setattr(zbal, "api_problems", lambda path: [])
    facts = zbal.PATCH.report.check_facts()
    assert facts["zbal_graphs"]["hooks"] is False
    assert facts["zbal_graphs"]["text"] == ("a server that captures NPU graphs: unpooled "
                                            "(ZBAL_ENABLE_GRAPH=0 set in the environment)")


def test_a_sglang_whose_default_is_no_graphs_says_so(tmp_path, monkeypatch):
    import dataclasses
    import types

    from npu_shim.cli import check

    @dataclasses.dataclass
    class ServerArgs:
        disable_cuda_graph: bool = True

    monkeypatch.setitem(sys.modules, "sglang.srt.server_args", types.SimpleNamespace(ServerArgs=ServerArgs))
    facts = check.graph_facts(_npu(), proc=_proc(tmp_path, {}))
    assert facts["sglang_disable_cuda_graph_default"] is True
    assert facts["verdict"] == "off by default in this sglang (ServerArgs.disable_cuda_graph is True)"
    ServerArgs.__dataclass_fields__["disable_cuda_graph"].default = False
    assert check.graph_facts(_npu(), proc=str(tmp_path))["verdict"] == check.GRAPH_DEFAULT
