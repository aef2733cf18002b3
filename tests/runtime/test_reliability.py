"""States never lie and half-applied patches never stay, each case in a fresh
interpreter with the fake sglang tree and demo patch of test_bootstrap.py."""

import types

import npu_shim
from test_bootstrap import DEMO_PATCH, last_json, run, tree  # noqa: F401 - ``tree`` is a fixture

RELOAD = """
    import importlib, json, npu_shim
    from sglang.srt.utils import common
    before = common.get_npu_memory_capacity()
    with open(common.__file__, "a") as f:
        f.write(%r)
    importlib.reload(common)
    state = npu_shim.states()["demo"]
    print(json.dumps({"before": before, "after": common.get_npu_memory_capacity(),
                      "init": getattr(common.Scheduler(None, 0), "patched", False),
                      "state": state["state"], "targets": state["targets"], "reason": state["reason"]}))
"""


def test_reload_of_a_patched_module_reapplies_the_patch(tree):
    proc = run(tree, RELOAD % "\n# reloaded\n")
    out = last_json(proc)
    assert out["before"] == out["after"] == 1001 and out["init"] is True
    assert out["state"] == "applied" and all(out["targets"].values())


def test_reload_into_code_the_shim_does_not_know_reverts_and_says_so(tree):
    proc = run(tree, RELOAD % "\nclass Scheduler:\n    def __init__(self, a, b, c=None):\n        pass\n")
    out = last_json(proc)
    assert out["before"] == 1001 and out["after"] == 1000 and out["init"] is False
    assert out["state"] == "failed" and not any(out["targets"].values())
    assert "Scheduler.__init__ has signature (a, b, c)" in out["reason"]
    assert "] demo: failed (while patching sglang.srt.utils.common" in proc.stderr


def test_a_module_imported_again_after_it_left_sys_modules_is_patched_and_uninstall_restores_it(tree):
    """sglang's modules taken out of sys.modules after the first import (a purge) and imported
    again are new module objects.  Before the fix they kept the original code (1000, no
    ``patched``) while ``states()`` said applied."""
    proc = run(tree, """
        import json, sys
        import npu_shim
        from sglang.srt.utils import common as first
        for name in [name for name in sys.modules if name.split(".")[0] == "sglang"]:
            del sys.modules[name]
        from sglang.srt.utils import common
        out = {"new": common is not first, "value": common.get_npu_memory_capacity(),
               "init": getattr(common.Scheduler(None, 0), "patched", False),
               "state": npu_shim.states()["demo"]["state"]}
        npu_shim.uninstall()
        out["restored"] = [common.get_npu_memory_capacity(), first.get_npu_memory_capacity()]
        print(json.dumps(out))
    """)
    assert last_json(proc) == {"new": True, "value": 1001, "init": True, "state": "applied",
                               "restored": [1000, 1000]}
    assert proc.stderr.count("demo=applied") == 1


def test_uninstall_after_reload_restores_the_reloaded_code(tree):
    proc = run(tree, """
        import importlib, json, sys, npu_shim
        from sglang.srt.utils import common
        importlib.reload(common)
        npu_shim.uninstall()
        print(json.dumps({"value": common.get_npu_memory_capacity(),
                          # no wrapt ImportHookFinder either: the shim's finder runs its own
                          # post-import hooks
                          "watchers": [type(f).__name__ for f in sys.meta_path
                                       if type(f).__module__.startswith("npu_shim")],
                          "loader": type(common.__loader__).__name__}))
    """)
    out = last_json(proc)
    assert out == {"value": 1000, "watchers": [], "loader": "SourceFileLoader"}


TWO_MODULES = DEMO_PATCH.replace(
    'modules = ("sglang.srt.utils.common",)',
    'modules = ("sglang.srt.utils.common", "sglang.srt.other")').replace(
    """            targets.Wrap("sglang.srt.utils.common", "Scheduler.__init__", mark_init,
                          [("server_args", "gpu_id")]),""",
    """            targets.Wrap("sglang.srt.other", "late", add_one, [("x",)]),""")


def test_second_module_failing_reverts_what_the_first_one_applied(tree):
    """The loaded ``late`` is not the code its source shows (rebound at import), so applying the
    patch to the second module fails after the first module was patched."""
    assert TWO_MODULES != DEMO_PATCH
    (tree / "image" / "demo.py").write_text(TWO_MODULES)
    (tree / "pkgs" / "sglang" / "srt" / "other.py").write_text(
        "def late(x):\n    return x\n\nlate = lambda x, y=0: x\n")
    proc = run(tree, """
        import json, npu_shim
        from sglang.srt.utils import common
        first = common.get_npu_memory_capacity()
        from sglang.srt import other
        state = npu_shim.states()["demo"]
        print(json.dumps({"first": first, "after": common.get_npu_memory_capacity(),
                          "late": type(other.late).__name__, "state": state["state"],
                          "targets": state["targets"], "reason": state["reason"]}))
    """)
    out = last_json(proc)
    assert out["first"] == 1001  # applied to the first module ...
    assert out["after"] == 1000 and out["late"] == "function"  # ... and reverted there
    assert out["state"] == "failed" and not any(out["targets"].values())
    assert "while patching sglang.srt.other" in out["reason"] and "signature (x, y)" in out["reason"]
    # uninstall after the failure, then install again: nothing left over, the patch applies anew
    again = run(tree, """
        import json, npu_shim
        from sglang.srt.utils import common
        from sglang.srt import other
        npu_shim.uninstall()
        print(json.dumps([npu_shim.install(), npu_shim.install(), common.get_npu_memory_capacity(),
                          npu_shim.states()["demo"]["state"]]))
    """)
    assert last_json(again) == [True, False, 1000, "failed"]
    strict = run(tree, "from sglang.srt.utils import common\nfrom sglang.srt import other\n",
                 env={"NPU_SHIM_STRICT": "1"}, check=False)
    assert strict.returncode == 1
    assert "ShimError: npu-shim (strict): demo is failed: while patching sglang.srt.other" in strict.stderr


def test_bad_variables_are_each_reported_once_with_the_prefix_at_activation(tree):
    proc = run(tree, """
        import logging
        from sglang.srt.utils import common
        common.get_npu_memory_capacity()
        import npu_shim
        npu_shim.states()
    """, env={"NPU_SHIM_LOG_LEVEL": "loud", "NPU_SHIM_STRICT": "maybe",
              "SGLANG_ZBAL_BOOTSTRAP_URL": "tcp://[:]:1", "SGLANG_ZBAL_LOCAL_MEM_SIZE": "１２２８８"})
    lines = proc.stderr.strip().splitlines()
    prefix = "[npu-shim %s sglang 0.5.9 pid " % npu_shim.__version__
    assert lines and all(line.startswith(prefix) for line in lines), lines
    for name in ("NPU_SHIM_LOG_LEVEL", "NPU_SHIM_STRICT", "SGLANG_ZBAL_BOOTSTRAP_URL",
                 "SGLANG_ZBAL_LOCAL_MEM_SIZE"):
        assert sum(name + "=" in line for line in lines) == 1, (name, lines)
    # the one the demo patch reads is in its ``failed`` line; the others say what happens instead
    assert any("demo: failed (SGLANG_ZBAL_LOCAL_MEM_SIZE=" in line for line in lines)
    assert any("NPU_SHIM_LOG_LEVEL='loud' is invalid" in line and "using INFO" in line for line in lines)
    assert any("NPU_SHIM_STRICT='maybe' is invalid" in line and "strict mode off" in line
               for line in lines)


# ------------------------------------------------------------------------------ chaining


def _plain_python(tree, code):
    """The same start-up without the shim: the image's sitecustomize is Python's own."""
    return run(tree, code, shim=False, check=False)


def test_image_sitecustomize_import_errors_are_reported_as_python_does(tree):
    for body, reported in (("raise ImportError('gone', name='sitecustomize')\n", False),
                           ("import module_that_is_not_there\n", True)):
        (tree / "image" / "sitecustomize.py").write_text(body)
        ours, plain = run(tree, "print('alive')", check=False), _plain_python(tree, "print('alive')")
        assert ours.stdout.strip() == plain.stdout.strip() == "alive"
        assert ("Error in sitecustomize" in ours.stderr) is reported, ours.stderr
        assert ours.stderr == plain.stderr, (ours.stderr, plain.stderr)


def test_repo_on_the_path_twice_through_a_symlink_never_chains_to_itself(tree):
    import os

    from test_bootstrap import REPO

    link = tree / "repo-link"
    link.symlink_to(REPO)
    for order in ([REPO, str(link)], [str(link), REPO]):
        path = os.pathsep.join(order + [str(tree / "image"), str(tree / "pkgs")])
        (tree / "marker").write_text("")
        proc = run(tree, """
            import json, os, sys
            print(json.dumps(os.path.realpath(sys.modules["npu_shim.chained_sitecustomize"].__file__)))
        """, env={"PYTHONPATH": path})
        assert last_json(proc) == os.path.realpath(str(tree / "image" / "sitecustomize.py")), order
        assert (tree / "marker").read_text() == "ran\n" and proc.stderr == ""


def test_states_name_every_target_and_exactly_the_wrappers_applied(tree):
    proc = run(tree, """
        import json, npu_shim
        from sglang.srt.utils import common
        print(json.dumps(npu_shim.states()["demo"]))
    """)
    state = last_json(proc)
    targets = ["sglang.srt.utils.common:get_npu_memory_capacity",
               "sglang.srt.utils.common:Scheduler.__init__"]
    assert state["name"] == "demo" and state["state"] == "applied" and state["details"] == {}
    assert state["targets"] == {t: True for t in targets}
    assert state["wrappers"] == sorted(targets)


def test_record_lists_only_applied_wraps_as_wrappers():
    from npu_shim.core import framework
    from npu_shim.runtime import decisions, targets

    wrap = targets.Wrap("m", "f", None, [()])
    other = targets.Wrap("m", "g", None, [()])
    replace = targets.Replace("m", "X", lambda original: 1)
    record = decisions.PatchRecord(types.SimpleNamespace(name="p"),
                                 framework.Decision(framework.APPLIED, "why", [wrap, other, replace]))
    record.applied = {wrap.describe(), replace.describe()}
    assert record.as_dict() == {
        "name": "p", "state": "applied", "reason": "why",
        "targets": {"m:f": True, "m:g": False, "m:X": True}, "wrappers": ["m:f"],
        "details": {}}


# ------------------------------------------------------------------- runtime, in process


def test_running_on_npu_is_false_without_torch_without_npu_and_when_asking_fails(monkeypatch):
    import sys

    from npu_shim.runtime import decisions

    def npu(available):
        def is_available():
            if isinstance(available, Exception):
                raise available
            return available
        return types.SimpleNamespace(npu=types.SimpleNamespace(is_available=is_available))

    for torch, expected in ((None, False), (types.SimpleNamespace(), False), (npu(False), False),
                            (npu(RuntimeError("driver")), False), (npu(True), True)):
        monkeypatch.setitem(sys.modules, "torch", torch)
        assert decisions.running_on_npu() is expected, torch


def _record(state, must_honour=False):
    from npu_shim.core import framework
    from npu_shim.runtime import decisions

    patch = types.SimpleNamespace(name="p", must_honour=lambda environ: must_honour)
    return decisions.PatchRecord(patch, framework.Decision(state, "because"))


def test_each_state_is_logged_at_its_level_and_a_requested_feature_is_enforced(caplog, monkeypatch):
    import logging

    import pytest

    from npu_shim.reporting import summary
    from npu_shim.runtime import decisions
    from npu_shim.core.framework import ShimError

    from npu_shim.reporting import log

    monkeypatch.delenv("NPU_SHIM_STRICT", raising=False)
    log.configure()  # sets the logger's level once per process: before caplog lowers it
    with caplog.at_level(logging.DEBUG, logger="npu_shim"):
        for state in ("failed", "unsupported", "applied", "inactive"):
            summary.report(_record(state))
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("ERROR", "p: failed (because)"), ("WARNING", "p: unsupported (because)"),
        ("DEBUG", "p: applied (because)"), ("DEBUG", "p: inactive (because)")]
    decisions.enforce(_record("failed"))  # not requested, not strict: logged only
    decisions.enforce(_record("applied", must_honour=True))
    with pytest.raises(ShimError, match="^npu-shim: p was requested but is unsupported: because$"):
        decisions.enforce(_record("unsupported", must_honour=True))
    monkeypatch.setenv("NPU_SHIM_STRICT", "1")
    with pytest.raises(ShimError, match=r"^npu-shim \(strict\): p is failed: because$"):
        decisions.enforce(_record("failed"))


def test_hooks_of_an_earlier_install_do_nothing():
    from npu_shim.runtime import activation

    calls = []
    runtime = activation.Runtime(patches=[])  # the test's own, in the state of a 7th install
    runtime.apply_module = calls.append
    runtime.records, runtime.installed, runtime.generation = {}, True, 7
    module = types.ModuleType("sglang.x")
    runtime.import_hook(6)(module)  # an earlier install
    runtime.installed = False
    runtime.import_hook(7)(module)  # this install, since uninstalled
    assert calls == []
    runtime.installed = True
    runtime.import_hook(7)(module)
    assert calls == [module]


def test_record_of_a_decided_patch_holds_the_details_its_decision_handed_out():
    from npu_shim.core import framework
    from npu_shim.runtime import activation, decisions

    details = {}
    decision = framework.Decision("applied", "ok", details=details)
    record = decisions.PatchRecord(types.SimpleNamespace(name="p"), decision)
    runtime = activation.Runtime()  # the test's own, as deciding left it
    runtime.records = {"p": record}
    assert runtime.record("p") is record and runtime.record("q") is None
    details["released_mib"] = 1.5  # what a wrapper writes through its closure
    assert record.details == {"released_mib": 1.5} and record.as_dict()["details"] == {"released_mib": 1.5}
    runtime.records = None
    assert runtime.record("p") is None


def test_a_module_is_applied_for_every_applied_patch_after_one_that_is_not():
    from npu_shim.core import framework
    from npu_shim.runtime import activation, decisions, targets

    module = types.ModuleType("sglang.fake_target")

    def f():
        return 1

    module.f = f
    skipped = _record("unsupported")
    applied = decisions.PatchRecord(types.SimpleNamespace(name="q", must_honour=lambda e: False),
                                  framework.Decision(framework.APPLIED, "ok", [
                                      targets.Wrap("sglang.fake_target", "f",
                                                    lambda w, i, a, k: w() + 1, [()])]))
    runtime = activation.Runtime()  # the test's own, as deciding left it
    runtime.records = {"p": skipped, "q": applied}
    runtime.apply_module(module)
    assert module.f() == 2 and applied.applied == {"sglang.fake_target:f"}
    decisions.revert_record(applied)
    assert module.f is f


def test_wrappers_pickle_and_copy_by_reference_in_process(monkeypatch):
    """The fast twin of test_hostile_inputs' real-release test: a module-level function, a method
    on its class and bound to an instance, each wrapped as the shim wraps targets."""
    import copy
    import pickle
    import sys

    from npu_shim.runtime.targets import function_wrapper

    module = types.ModuleType("npu_shim_pickle_probe")
    exec("def f(x):\n    return x + 1\n\nclass Box:\n    def __init__(self, v):\n        self.v = v\n"
         "    def get(self):\n        return self.v\n", module.__dict__)
    monkeypatch.setitem(sys.modules, module.__name__, module)

    def passthrough(wrapped, instance, args, kwargs):
        return wrapped(*args, **kwargs)

    module.f = function_wrapper(module.f, passthrough)
    module.Box.get = function_wrapper(module.Box.__dict__["get"], passthrough)
    box = module.Box(5)
    assert pickle.loads(pickle.dumps(module.f)) is module.f and copy.deepcopy(module.f) is module.f
    assert copy.copy(module.f) is module.f
    assert b"npu_shim_pickle_probe" in pickle.dumps(module.f)  # a global by name, like f itself
    unbound = pickle.loads(pickle.dumps(module.Box.get))
    assert unbound.__wrapped__ is module.Box.__dict__["get"].__wrapped__ and unbound(box) == 5
    for bound in (pickle.loads(pickle.dumps(box.get)), copy.deepcopy(box.get)):
        assert bound() == 5 and bound.__self__ is not box and type(bound.__self__) is module.Box
        assert type(bound).__module__ == "npu_shim.runtime.targets"
    assert copy.copy(box.get)() == 5


# ------------------------------------------------------------------- threads, fork, install()

# The demo patch with a second module, sglang.srt.other, whose target's ``requires`` waits for the
# test's gate: a thread importing that module is then inside the shim's hook, the runtime's lock held.
GATED = DEMO_PATCH.replace(
    'modules = ("sglang.srt.utils.common",)',
    'modules = ("sglang.srt.utils.common", "sglang.srt.other")').replace(
    "        return [\n",
    "        def gate():\n"
    "            import gate\n"
    "            gate.inside.set()\n"
    "            gate.release.wait(30)\n"
    "        return [\n"
    "            targets.Wrap(\"sglang.srt.other\", \"late\", add_one, [(\"x\",)], requires=gate),\n")

GATE = """
        import sys, threading, types
        gate = sys.modules["gate"] = types.ModuleType("gate")
        gate.inside, gate.release = threading.Event(), threading.Event()
"""  # indented as the scripts it goes in front of


def test_a_child_forked_while_another_thread_is_inside_a_hook_reloads_without_deadlock(tree):
    """The runtime's lock is made anew in a forked child: before the fix the child, forked while
    a thread held it inside an import hook, blocked for ever on the next reload."""
    assert GATED != DEMO_PATCH
    (tree / "image" / "demo.py").write_text(GATED)
    (tree / "pkgs" / "sglang" / "srt" / "other.py").write_text("def late(x):\n    return x\n")
    proc = run(tree, GATE + """
        import importlib, json, os, threading, time
        from sglang.srt.utils import common
        importer = threading.Thread(target=importlib.import_module, args=("sglang.srt.other",))
        importer.start()
        assert gate.inside.wait(30)
        pid = os.fork()
        if pid == 0:
            importlib.reload(common)
            print(json.dumps({"child": common.get_npu_memory_capacity()}), flush=True)
            os._exit(0)
        gate.release.set()
        importer.join()
        for _ in range(200):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            status = "killed: deadlocked"
        from sglang.srt import other
        print(json.dumps({"status": status, "parent": [common.get_npu_memory_capacity(), other.late(1)]}))
    """)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines == ['{"child": 1001}', '{"status": 0, "parent": [1001, 2]}'], proc.stdout + proc.stderr


def test_install_while_another_thread_imports_a_hooked_module_patches_it_once_imported(tree):
    """install() while another thread is still running sglang.srt.utils.common's code: the
    half-imported module (``__spec__._initializing``) is patched when its import finishes.  Before
    the fix it was taken for an imported one: Scheduler.__init__ not found, demo failed (and in
    strict mode install() raised)."""
    common = tree / "pkgs" / "sglang" / "srt" / "utils" / "common.py"
    text = common.read_text()
    common.write_text(text.replace("class Scheduler:", "import gate\ngate.inside.set()\n"
                                                       "assert gate.release.wait(30)\n\nclass Scheduler:"))
    proc = run(tree, GATE + """
        import importlib, json, threading
        import sglang
        import npu_shim
        importer = threading.Thread(target=importlib.import_module, args=("sglang.srt.utils.common",))
        importer.start()
        assert gate.inside.wait(30)
        installed = npu_shim.install()
        during = npu_shim.states()
        gate.release.set()
        importer.join()
        from sglang.srt.utils import common
        print(json.dumps({"installed": installed, "during": during, "state": npu_shim.states()["demo"]["state"],
                          "value": common.get_npu_memory_capacity(),
                          "init": getattr(common.Scheduler(None, 0), "patched", False),
                          "spec": type(common.__spec__).__name__}))
    """, shim=False, env={"NPU_SHIM_STRICT": "1"})
    assert last_json(proc) == {"installed": True, "during": {}, "state": "applied", "value": 1001,
                               "init": True, "spec": "ModuleSpec"}


def test_reloads_and_install_cycles_keep_what_they_replaced_no_longer(tree):
    """36 reloads kept 2 more changes each (and the old functions with them), 25 uninstall()/
    install() cycles one more waiting hook per hooked module each: what they replaced is let go."""
    proc = run(tree, """
        import gc, importlib, json, weakref
        import npu_shim
        from npu_shim.runtime import activation
        from sglang.srt.utils import common
        runtime = activation.RUNTIME

        def waiting_hooks():
            return sum(len(hooks) for hooks in runtime.finder._hooks.values())

        hooks_before, old = waiting_hooks(), []
        for _ in range(36):
            old.append(weakref.ref(common.get_npu_memory_capacity.__wrapped__))
            importlib.reload(common)
        gc.collect()
        record = runtime.record("demo")
        from sglang.srt import utils  # its star import took the first wrapper and class: they stay
        out = {"changes": len(record.changes), "replaced": sum(entry.alive() for entry in record.replaced),
               "old_alive": [i for i, ref in enumerate(old) if ref() is not None],
               "copy": [utils.get_npu_memory_capacity.__wrapped__ is old[0](), utils.Scheduler is not common.Scheduler,
                        utils.Scheduler(None, 0).patched],
               "value": common.get_npu_memory_capacity()}
        for _ in range(25):
            npu_shim.uninstall()
            npu_shim.install()
        out.update(hooks=[hooks_before, waiting_hooks()], state=npu_shim.states()["demo"]["state"],
                   again=common.get_npu_memory_capacity())
        npu_shim.uninstall()
        out["restored"] = [common.get_npu_memory_capacity(), utils.get_npu_memory_capacity is old[0](),
                           hasattr(utils.Scheduler(None, 0), "patched")]
        print(json.dumps(out))
    """)
    out = last_json(proc)
    assert out["hooks"][0] > 0
    assert out == {"changes": 2, "replaced": 2, "old_alive": [0], "copy": [True, True, True], "value": 1001,
                   "hooks": [out["hooks"][0]] * 2, "state": "applied", "again": 1001,
                   "restored": [1000, True, False]}
