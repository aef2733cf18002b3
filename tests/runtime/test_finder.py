"""finder: the shim's own post-import hooks, the table the start-up watcher (the shim's one
meta-path finder) hands imports on to -- a hooked module's hooks run after its code, every other
import is ignored, no wrapt import hook is loaded, the table never enters sys.meta_path (reloads:
test_reliability.py; the watcher's lookup and its guard: test_bootstrap_watcher.py)."""

import contextlib
import importlib
import importlib.machinery
import json
import sys
import types

import pytest

from npu_shim import _bootstrap
from npu_shim.runtime import activation, finder, metrics_hook, role
from test_bootstrap import last_json, run, tree  # noqa: F401 - ``tree`` is a fixture
from test_drop_in import bare_venvs  # noqa: F401 - a fixture

ROLE_MODULE = role.MODULE  # the module of the shim's own role target (run_scheduler_process)
#: The modules the shim's own targets wait on, which nothing here imports: the role's, and where
#: sglang keeps its metrics collectors (npu_shim/runtime/metrics_hook.py).
OWN_MODULES = sorted([ROLE_MODULE, *metrics_hook.MODULES])


def test_only_modules_with_a_hook_waiting_are_looked_up_and_no_wrapt_import_hook_is_loaded(tree):
    """The shim's finder owns the post-import hooks: no wrapt ImportHookFinder in sys.meta_path
    (wrapt's takes a lock on every import), no wrapt importer module loaded; the shim's finder
    looks up only the hooked modules, whose hooks still fire."""
    proc = run(tree, """
        import json, sys
        import sglang
        asked = []
        from npu_shim import _bootstrap
        from npu_shim.runtime import activation
        shim = activation.RUNTIME.finder
        look_up = _bootstrap.look_up
        _bootstrap.look_up = lambda name, *rest: asked.append(name) or look_up(name, *rest)
        waiting = shim.waiting()
        import colorsys
        from sglang.srt.utils import common
        print(json.dumps({"finders": ["watcher" if getattr(f, "is_npu_shim_watcher", False) else type(f).__name__
                                      for f in sys.meta_path
                                      if "ImportHookFinder" in type(f).__name__
                                      or getattr(f, "is_npu_shim_watcher", False)
                                      or type(f).__module__.startswith(("npu_shim", "sitecustomize"))],
                          "through_watcher": _bootstrap.handing_on_to() == shim.find_spec,
                          "importers": sorted(m for m in sys.modules if "wrapt" in m and "importer" in m),
                          "waiting": waiting, "left": shim.waiting(), "asked": sorted(set(asked)),
                          "value": common.get_npu_memory_capacity()}))
    """)
    out = last_json(proc)
    # One finder of the shim's: the start-up watcher, which hands imports to the shim's hook table;
    # no wrapt finder, no wrapt importer.
    assert out["finders"] == ["watcher"] and out["through_watcher"] is True
    assert out["importers"] == [] and out["asked"] == ["sglang.srt.utils.common"]
    # the shim's own targets wait on their modules, which nothing here imports
    assert out["waiting"] == sorted(OWN_MODULES + ["sglang.srt.utils.common"]) and out["left"] == OWN_MODULES
    assert out["value"] == 1001  # the demo patch applied through the hook


def test_the_shim_finder_ignores_imports_and_unhooked_modules():
    watcher = activation.RUNTIME.finder
    assert watcher.find_spec("json", None, None) is None
    assert watcher.find_spec("json", None, importlib.import_module("json")) is None


def test_an_application_that_imported_wrapt_first_keeps_wrapts_own_finder(tree):
    """The application imported wrapt before sglang and registered its own post-import hook: the
    shim reuses that module for its wrappers only, wrapt's own ImportHookFinder stays in
    sys.meta_path and serves the application's hooks (and none of the shim's); the shim's hooks
    are its finder's, and it still re-applies after a reload."""
    proc = run(tree, """
        import importlib, json, sys
        import wrapt
        fired = []
        wrapt.register_post_import_hook(lambda module: fired.append(module.__name__), "colorsys")
        import sglang
        from npu_shim.runtime import activation, wrapt_loader
        from sglang.srt.utils import common
        import colorsys
        patched = common.get_npu_memory_capacity()
        importlib.reload(common)
        print(json.dumps({
            "wrapt_hooks": sorted(m for m in wrapt.importer._post_import_hooks if m.startswith("sglang")),
            "loaded": wrapt_loader.load() is wrapt, "origin": wrapt_loader.loaded_origin().source,
            "private": sorted(m for m in sys.modules if m.startswith("npu_shim._wrapt")),
            "wrapt_finders": [type(f).__module__ for f in sys.meta_path
                              if type(f).__name__ == "ImportHookFinder"],
            "fired": fired, "patched": patched, "after_reload": common.get_npu_memory_capacity(),
            "state": activation.RUNTIME.states()["demo"]["state"]}))
    """)
    assert last_json(proc) == {
        "wrapt_hooks": [], "loaded": True, "origin": "image",
        "private": [], "wrapt_finders": ["wrapt.importer"], "fired": ["colorsys"],
        "patched": 1001, "after_reload": 1001, "state": "applied"}
    assert "activation failed" not in proc.stderr, proc.stderr


# -- its place in sys.meta_path ----------------------------------------------------------------------

@pytest.fixture
def own_meta_path(monkeypatch):
    """sys.meta_path as a copy without the start-up watcher (restored afterwards), the watcher's
    state as it was before start-up, and put back afterwards."""
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path if f is not _bootstrap.WATCHER])
    monkeypatch.setattr(_bootstrap, "_saw_sglang", False)
    monkeypatch.setattr(_bootstrap, "_hand_on_to", None)
    monkeypatch.setattr(_bootstrap, "_looking", sys.modules["_thread"]._local())
    return sys.meta_path


class Nobody:
    """A finder some other package puts in front later: it finds nothing."""

    def find_spec(self, fullname, path=None, target=None):
        return None


def test_the_table_never_enters_sys_meta_path_the_watcher_goes_first_once(own_meta_path):
    """install() after sglang was imported: the watcher, not yet in sys.meta_path, goes first and
    hands on to the table; installing again neither moves nor adds it."""
    shim = finder.ShimFinder(lambda name: False, lambda module: None)
    before = list(own_meta_path)
    shim.install(_bootstrap.WATCHER)
    assert own_meta_path == [_bootstrap.WATCHER] + before and _bootstrap.handing_on_to() == shim.find_spec
    shim.install(_bootstrap.WATCHER)
    assert own_meta_path == [_bootstrap.WATCHER] + before
    # Another finder inserted in front later: the watcher stays where it is (a list the import
    # system may be walking is not reordered) and is not added a second time.
    other = Nobody()
    own_meta_path.insert(0, other)
    shim.install(_bootstrap.WATCHER)
    assert own_meta_path == [other, _bootstrap.WATCHER] + before
    shim.uninstall(_bootstrap.WATCHER)
    assert _bootstrap.handing_on_to() is None and shim not in own_meta_path
    _bootstrap.disarm()  # what uninstall() does next
    assert own_meta_path == [other] + before


def test_once_the_watcher_fired_the_finder_answers_through_it(own_meta_path, monkeypatch):
    shim = finder.ShimFinder(lambda name: False, lambda module: None)
    monkeypatch.setattr(_bootstrap, "_saw_sglang", True)  # as the first ``import sglang`` leaves it
    own_meta_path.append(_bootstrap.WATCHER)
    before = list(own_meta_path)
    shim.install(_bootstrap.WATCHER)
    assert own_meta_path == before and _bootstrap.handing_on_to() == shim.find_spec
    shim.uninstall(_bootstrap.WATCHER)
    assert _bootstrap.handing_on_to() is None
    # fired, but no longer in sys.meta_path (uninstall() removed it): the watcher goes first again,
    # and the table answers through it
    own_meta_path.remove(_bootstrap.WATCHER)
    shim.install(_bootstrap.WATCHER)
    assert own_meta_path[0] is _bootstrap.WATCHER and _bootstrap.handing_on_to() == shim.find_spec
    assert shim not in own_meta_path


def test_a_finder_in_front_does_not_stop_reloads_being_reapplied(tree):
    """install() after sglang was imported: the start-up watcher goes to the front of
    sys.meta_path (the hook table never does); a finder inserted before it later is asked first,
    and the watcher still hands the reload on to the table."""
    proc = run(tree, """
        import importlib, json, sys
        from sglang.srt.utils import common
        import npu_shim
        from npu_shim import _bootstrap
        from npu_shim.runtime import activation
        npu_shim.install()
        first = sys.meta_path.index(_bootstrap.WATCHER)
        class Nobody:
            def find_spec(self, fullname, path=None, target=None):
                return None
        sys.meta_path.insert(0, Nobody())
        importlib.reload(common)
        print(json.dumps({"first": first, "now": sys.meta_path.index(_bootstrap.WATCHER),
                          "table": activation.RUNTIME.finder in sys.meta_path,
                          "value": common.get_npu_memory_capacity(),
                          "state": activation.RUNTIME.states()["demo"]["state"]}))
    """, shim=False)
    assert last_json(proc) == {"first": 0, "now": 1, "table": False, "value": 1001, "state": "applied"}


# -- the shim's post-import hooks ------------------------------------------------------------------

@pytest.fixture
def hooks(own_meta_path, tmp_path, monkeypatch):
    """A fresh ShimFinder, the start-up watcher first in (a copy of) sys.meta_path handing imports
    on to it, modules ``hk_*`` written under ``hooks.dir`` importable; ``hooks.reapplied``: the
    modules it re-applied after a reload."""
    monkeypatch.syspath_prepend(str(tmp_path))
    reapplied = []
    shim = finder.ShimFinder(lambda name: name.startswith("hk_"), reapplied.append)
    shim.install(_bootstrap.WATCHER)
    shim.reapplied, shim.dir = reapplied, tmp_path
    before = set(sys.modules)
    yield shim
    shim.uninstall(_bootstrap.WATCHER)
    for name in set(sys.modules) - before:
        if name.startswith("hk_"):
            del sys.modules[name]


def no_lookup_under_way():
    """True when this thread is inside no lookup of the watcher's (its guard holds no name)."""
    return getattr(_bootstrap._looking, "names", set()) == set()


def _write(hooks, relative, text):
    path = hooks.dir / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    importlib.invalidate_caches()


def test_a_hook_runs_once_after_the_module_code_and_at_once_for_a_module_imported_already(hooks):
    _write(hooks, "hk_a.py", "X = 1\n")
    fired = []
    hooks.register("hk_a", lambda module: fired.append((module.__name__, module.X)))
    assert hooks.waiting() == ["hk_a"] and fired == []
    import hk_a
    assert fired == [("hk_a", 1)] and hooks.waiting() == []
    # no trace of the hook's loader on the module
    assert type(hk_a.__loader__).__name__ == "SourceFileLoader" and hk_a.__spec__.loader is hk_a.__loader__
    importlib.import_module("hk_a")
    assert fired == [("hk_a", 1)]
    hooks.register("hk_a", lambda module: fired.append(("at once", module)))
    assert fired == [("hk_a", 1), ("at once", hk_a)] and hooks.waiting() == []


def test_a_module_imported_inside_another_modules_hook_gets_its_hooks(hooks):
    _write(hooks, "hk_outer.py", "")
    _write(hooks, "hk_inner.py", "")
    fired = []

    def outer(module):
        fired.append(module.__name__)
        import hk_inner  # noqa: F401 - a hooked module imported inside a hook
        hooks.register("hk_outer", lambda again: fired.append("registered in its own hook"))

    hooks.register("hk_outer", outer)
    hooks.register("hk_inner", lambda module: fired.append(module.__name__))
    import hk_outer  # noqa: F401 - the import fires the hooks
    assert fired == ["hk_outer", "hk_inner", "registered in its own hook"] and hooks.waiting() == []


def test_reload_reapplies_and_does_not_run_the_hooks_again(hooks):
    _write(hooks, "hk_reloaded.py", "X = 1\n")
    fired = []
    hooks.register("hk_reloaded", lambda module: fired.append(module.X))
    import hk_reloaded
    _write(hooks, "hk_reloaded.py", "X = 22\n")
    importlib.reload(hk_reloaded)
    assert hk_reloaded.X == 22 and fired == [1] and hooks.reapplied == [hk_reloaded]
    assert type(hk_reloaded.__spec__.loader).__name__ == "SourceFileLoader"


@pytest.mark.parametrize("imported_first", [False, True])
def test_a_hooked_module_imported_again_after_it_left_sys_modules_is_reapplied(hooks, imported_first):
    """A module whose hooks ran (at its import, or at once for one imported before), taken out
    of sys.modules (a purge, ``mock.patch.dict``) and imported again, is a new module object with
    the original code: before the fix the finder looked only at reloads and the new module
    stayed unpatched while the states said applied."""
    _write(hooks, "hk_again.py", "X = 1\n")
    fired = []
    if imported_first:
        importlib.import_module("hk_again")
    hooks.register("hk_again", lambda module: fired.append(module))
    first = importlib.import_module("hk_again")
    del sys.modules["hk_again"]
    again = importlib.import_module("hk_again")
    assert again is not first and fired == [first] and hooks.reapplied == [again]
    assert type(again.__spec__.loader).__name__ == "SourceFileLoader"


class LegacyLoader:
    """A loader from before exec_module: ``load_module`` only."""

    def load_module(self, fullname):
        import types

        module = sys.modules[fullname] = types.ModuleType(fullname)
        module.__loader__ = self
        module.X = "legacy"
        return module


class LegacyFinder:
    def find_spec(self, fullname, path=None, target=None):
        import importlib.util

        return importlib.util.spec_from_loader(fullname, LegacyLoader()) if fullname == "hk_legacy" else None


def test_a_loader_with_only_load_module_runs_the_hooks(hooks, own_meta_path):
    import warnings

    own_meta_path.append(LegacyFinder())
    fired = []
    hooks.register("hk_legacy", lambda module: fired.append(module.X))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ImportWarning)  # "exec_module() not found" (3.10+)
        import hk_legacy
    assert fired == ["legacy"] and isinstance(hk_legacy.__loader__, LegacyLoader)
    assert isinstance(hk_legacy.__spec__.loader, LegacyLoader)


def test_a_namespace_package_and_its_module_run_their_hooks(hooks):
    _write(hooks, "hk_ns/mod.py", "X = 3\n")
    fired = []
    hooks.register("hk_ns", lambda module: fired.append(module.__name__))
    hooks.register("hk_ns.mod", lambda module: fired.append(module.X))
    import hk_ns.mod
    assert fired == ["hk_ns", 3] and list(hk_ns.__path__) == [str(hooks.dir / "hk_ns")]
    assert "NamespaceLoader" in type(hk_ns.__loader__).__name__


@pytest.mark.another_python
@pytest.mark.parametrize("version", ["3.9", "3.10"])
def test_a_namespace_package_without_a_loader_in_its_spec_runs_its_hooks(version, tmp_path):
    """Before Python 3.11 a namespace package's spec has no loader (the import system makes one)."""
    import subprocess

    from test_drop_in import REPO, cpython

    (tmp_path / "hk_ns").mkdir()
    code = """if 1:
        import json, sys
        from npu_shim import _bootstrap
        from npu_shim.runtime import finder
        shim = finder.ShimFinder(lambda name: False, lambda module: None)
        shim.install(_bootstrap.WATCHER)
        fired = []
        shim.register("hk_ns", lambda module: fired.append(type(module.__loader__).__name__))
        import hk_ns
        print(json.dumps([fired, hk_ns.__spec__.loader is hk_ns.__loader__, hk_ns.__file__]))
    """
    proc = subprocess.run([cpython(version), "-c", code], capture_output=True, text=True,
                          env={"PYTHONPATH": "%s:%s" % (tmp_path, REPO), "PYTHONDONTWRITEBYTECODE": "1"},
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [["_NamespaceLoader"], True, None]


def test_a_module_that_fails_to_import_runs_no_hook_and_leaves_nothing(hooks):
    _write(hooks, "hk_bad.py", "raise RuntimeError('broken')\n")
    fired = []
    hooks.register("hk_bad", lambda module: fired.append(module.__name__))
    with pytest.raises(RuntimeError, match="broken"):
        import hk_bad
    assert fired == [] and "hk_bad" not in sys.modules
    assert hooks.waiting() == ["hk_bad"] and no_lookup_under_way()
    _write(hooks, "hk_bad.py", "X = 'fixed'\n")
    import hk_bad  # noqa: F401 - the import fires the hook
    assert fired == ["hk_bad"] and hooks.waiting() == []


def test_threads_importing_and_registering_run_each_hook_exactly_once(hooks):
    import threading
    import time

    _write(hooks, "hk_slow.py", "import time\ntime.sleep(0.2)\nX = 1\n")
    fired = []
    lock = threading.Lock()

    def hook(tag):
        def run(module):
            with lock:
                fired.append((tag, getattr(module, "X", "half-imported")))
        return run

    hooks.register("hk_slow", hook("first"))
    seen = []
    start = threading.Barrier(9)

    def importer():
        start.wait()
        seen.append((importlib.import_module("hk_slow").X, no_lookup_under_way()))

    def registerer(i):
        start.wait()
        time.sleep(0.05 * (i % 3))
        hooks.register("hk_slow", hook(i))

    threads = [threading.Thread(target=importer) for _ in range(4)]
    threads += [threading.Thread(target=registerer, args=(i,)) for i in range(5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert seen == [(1, True)] * 4
    # registered while the module's code still ran: run once it finished, never on half a module
    assert sorted(fired, key=str) == sorted([("first", 1)] + [(i, 1) for i in range(5)], key=str)
    assert hooks.waiting() == [] and no_lookup_under_way()


GATED_MODULE = "import gate\ngate.inside.set()\nassert gate.release.wait(30)\nX = 1\n"


@pytest.fixture
def gate(monkeypatch):
    """A module ``gate`` with two events: a module's code sets ``inside`` and waits for ``release``."""
    import threading

    module = types.ModuleType("gate")
    module.inside, module.release = threading.Event(), threading.Event()
    monkeypatch.setitem(sys.modules, "gate", module)
    return module


@pytest.mark.parametrize("outcome", ["imported", "failed"])
def test_a_hook_registered_while_another_thread_runs_the_modules_code_waits_for_its_end(hooks, gate, outcome):
    """A module in sys.modules whose code still runs is half imported (``__spec__._initializing``):
    its hooks run on the importing thread when its code finished, the spec's class put back; an
    import that fails leaves them waiting for the next, which runs them."""
    import threading

    _write(hooks, "hk_gated.py", GATED_MODULE + ("raise ImportError('no')\n" if outcome == "failed" else ""))
    fired, errors = [], []

    def importer():
        try:
            importlib.import_module("hk_gated")
        except ImportError as exc:
            errors.append(str(exc))

    thread = threading.Thread(target=importer)
    thread.start()
    assert gate.inside.wait(30)
    half = sys.modules["hk_gated"]
    hooks.register("hk_gated", lambda module: fired.append((module, module.X, threading.current_thread())))
    assert fired == [] and hooks.waiting() == ["hk_gated"] and type(half.__spec__).__name__ == "ModuleSpec"
    gate.release.set()
    thread.join(30)
    assert type(half.__spec__) is importlib.machinery.ModuleSpec
    if outcome == "imported":
        assert fired == [(half, 1, thread)] and hooks.waiting() == [] and errors == []
        return
    assert fired == [] and hooks.waiting() == ["hk_gated"] and errors == ["no"]
    _write(hooks, "hk_gated.py", "X = 2\n")
    again = importlib.import_module("hk_gated")
    assert fired == [(again, 2, threading.current_thread())] and hooks.waiting() == []


def test_a_hook_a_module_registers_for_itself_runs_when_its_code_finished(hooks):
    """install() from code a hooked module's import runs: the same thread, further up."""
    _write(hooks, "hk_self.py", "import sys\nsys.modules['hk_self_test'].register('hk_self', "
                                "lambda module: module.SEEN.append(module.X))\nSEEN = []\nX = 1\n")
    sys.modules["hk_self_test"] = hooks
    try:
        import hk_self
    finally:
        del sys.modules["hk_self_test"]
    assert hk_self.SEEN == [1] and hooks.waiting() == []


def test_the_watch_on_a_spec_fires_once_when_its_import_ends_and_not_after():
    spec = importlib.machinery.ModuleSpec("hk_spec", None)
    calls = []
    spec._initializing = True
    assert finder._watch_initializing(spec, lambda: calls.append(1)) is True
    assert type(spec).__name__ == "ModuleSpec" and type(spec) is not importlib.machinery.ModuleSpec
    assert finder._watch_initializing(spec, lambda: calls.append(2)) is True  # one watch, not two
    spec.loader = "kept"
    spec._initializing = True
    assert calls == [] and spec.loader == "kept"
    spec._initializing = False
    assert calls == [1] and type(spec) is importlib.machinery.ModuleSpec
    spec._initializing = False
    assert calls == [1]
    # an import that ended before the watch was set: no watch left, the caller runs the hooks
    assert finder._watch_initializing(spec, lambda: calls.append(3)) is False
    assert calls == [1] and type(spec) is importlib.machinery.ModuleSpec


def test_a_watched_spec_reads_as_its_own_class_while_its_import_runs():
    """Code that looks at ``type(module.__spec__)`` during the import (a repr, a check by name or
    module) sees the spec's own class, never one of npu-shim's -- for a spec class nested in
    another too -- and the class itself once the import ended."""
    class Specs:
        class Nested(importlib.machinery.ModuleSpec):
            pass

    for base in (importlib.machinery.ModuleSpec, Specs.Nested):
        spec = base("hk_disguised", None)
        spec._initializing = True
        ended = []
        assert finder._watch_initializing(spec, lambda: ended.append(True)) is True
        watched = type(spec)
        assert watched is not base and isinstance(spec, base)
        assert (watched.__name__, watched.__qualname__, watched.__module__) == (
            base.__name__, base.__qualname__, base.__module__)
        spec._initializing = False
        assert ended == [True] and type(spec) is base


def test_a_spec_whose_class_cannot_change_runs_the_hooks_at_once(hooks, monkeypatch):
    class Fixed:
        __slots__ = ("_initializing",)

    module = types.ModuleType("hk_fixed")
    module.__spec__ = Fixed()
    module.__spec__._initializing = True
    monkeypatch.setitem(sys.modules, "hk_fixed", module)
    fired = []
    hooks.register("hk_fixed", fired.append)
    assert fired == [module] and hooks.waiting() == []


@contextlib.contextmanager
def held_by_another_thread(lock):
    """``lock`` held by another thread until the block ends."""
    import threading

    held, release = threading.Event(), threading.Event()

    def hold():
        with lock:
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(30)
        yield
    finally:
        release.set()
        holder.join(30)


def test_after_a_fork_the_table_takes_a_new_lock_and_registers_while_the_old_one_is_held(hooks):
    """What the fork handler runs in the child, here in this process: ``forked`` gives the table a
    lock of its own, free while another thread still holds the one it had, so registering and
    the import's hooks go on."""
    _write(hooks, "hk_relocked.py", "X = 1\n")
    fired = []
    with held_by_another_thread(hooks._lock):
        hooks.forked()
        assert hooks._lock.acquire(timeout=10)
        hooks._lock.release()
        hooks.register("hk_relocked", fired.append)
        import hk_relocked
        assert fired == [hk_relocked] and hooks.waiting() == []


def in_a_child_forked_while_held(lock, check):
    """Fork while another thread holds ``lock``; in the child run ``check()`` (True: it holds).
    The child's exit status: 0 when it held, 1 when not or it raised, None when it still waited
    after 10 s (it is killed then)."""
    import os
    import time

    with held_by_another_thread(lock):
        pid = os.fork()
        if pid == 0:  # the child: never back into pytest
            try:
                os._exit(0 if check() else 1)
            finally:
                os._exit(1)
    for _ in range(200):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return None


def test_a_child_forked_while_another_thread_holds_the_lock_registers_and_finds(hooks):
    """The table's lock is made anew in a forked child (the thread that held it is not there).
    (The lookups other threads had under way are not the child's either: the watcher's guard is
    per thread, test_bootstrap_watcher.py.)"""
    _write(hooks, "hk_forked.py", "X = 1\n")
    fired = []

    def check():
        hooks.register("hk_forked", fired.append)
        import hk_forked
        return hooks.waiting() == [] and fired == [hk_forked] and no_lookup_under_way()

    assert in_a_child_forked_while_held(hooks._lock, check) == 0
    assert hooks.waiting() == [] and fired == []  # the parent's finder: nothing registered


def test_through_the_watcher_the_finder_asks_the_other_finders_but_never_the_watcher(
        hooks, own_meta_path, monkeypatch):
    """Asking the watcher back would only come round to the table again: the watcher is asked
    once, by the import system.  (``hooks``: the module's directory; a table handed on to before.)"""
    _write(hooks, "hk_watched.py", "X = 'watched'\n")
    asked = []
    find_spec = _bootstrap.find_spec
    monkeypatch.setattr(_bootstrap, "find_spec", lambda fullname, *rest: asked.append(fullname) or
                        find_spec(fullname, *rest))
    shim = finder.ShimFinder(lambda name: False, lambda module: None)
    assert shim.watcher is None  # none handed in yet
    shim.install(_bootstrap.WATCHER)
    assert shim.watcher is _bootstrap.WATCHER and _bootstrap.handing_on_to() == shim.find_spec
    assert shim not in own_meta_path
    fired = []
    shim.register("hk_watched", lambda module: fired.append(module.X))
    import hk_watched  # noqa: F401 - the import fires the hook
    assert fired == ["watched"] and asked == ["hk_watched"]
    shim.uninstall(_bootstrap.WATCHER)
    assert _bootstrap.handing_on_to() is None


def test_a_regular_package_runs_its_init_before_its_hooks(hooks):
    _write(hooks, "hk_pkg/__init__.py", "X = 'init'\n")
    fired = []
    hooks.register("hk_pkg", lambda module: fired.append(module.X))
    import hk_pkg
    assert fired == ["init"] and type(hk_pkg.__loader__).__name__ == "SourceFileLoader"
    assert hk_pkg.__file__ == str(hooks.dir / "hk_pkg" / "__init__.py")


class Recording:
    """A finder in front of the ones that find: what it was asked, with the reload's target."""

    def __init__(self):
        self.asked = []

    def find_spec(self, fullname, path=None, target=None):
        self.asked.append((fullname, target))
        return None


def test_a_reload_hands_its_target_to_the_other_finders(hooks, own_meta_path):
    _write(hooks, "hk_target.py", "X = 1\n")
    import hk_target
    recording = Recording()
    own_meta_path.insert(1, recording)
    importlib.reload(hk_target)
    assert recording.asked == [("hk_target", hk_target)] and hooks.reapplied == [hk_target]


class Peeking:
    """A finder that, asked for ``hk_peek_outer``, imports ``hk_peek_inner`` first (its own
    configuration, say) -- a lookup inside the shim's lookup of another module."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "hk_peek_outer":
            importlib.import_module("hk_peek_inner")
        return None


def test_a_hooked_module_imported_by_a_finder_during_another_lookup_gets_its_hooks(hooks, own_meta_path):
    _write(hooks, "hk_peek_outer.py", "")
    _write(hooks, "hk_peek_inner.py", "")
    own_meta_path.insert(1, Peeking())
    fired = []
    hooks.register("hk_peek_outer", lambda module: fired.append(module.__name__))
    hooks.register("hk_peek_inner", lambda module: fired.append(module.__name__))
    import hk_peek_outer  # noqa: F401 - the import fires the hooks
    assert fired == ["hk_peek_inner", "hk_peek_outer"] and hooks.waiting() == []


def test_the_found_loader_answers_for_a_spec_looked_up_but_not_loaded(hooks):
    """``importlib.util.find_spec`` (runpy, pkgutil) hands out the spec with the shim's loader:
    what else is asked of the loader is the found one's answer."""
    import importlib.util

    _write(hooks, "hk_src.py", "X = 'source'\n")
    hooks.register("hk_src", lambda module: None)
    spec = importlib.util.find_spec("hk_src")
    assert spec.loader.get_source("hk_src") == "X = 'source'\n" and spec.loader.is_package("hk_src") is False
    assert spec.loader.get_filename("hk_src") == str(hooks.dir / "hk_src.py")


def test_modules_made_from_two_lookups_of_one_name_run_the_hooks_once(hooks):
    """The importlib.util recipe (find_spec, module_from_spec, exec_module), twice: the hooks
    run for the first module; the second has none waiting and loads all the same."""
    import importlib.util

    _write(hooks, "hk_twice.py", "X = 2\n")
    fired = []
    hooks.register("hk_twice", lambda module: fired.append(module))
    specs = [importlib.util.find_spec("hk_twice"), importlib.util.find_spec("hk_twice")]
    modules = [importlib.util.module_from_spec(spec) for spec in specs]
    for spec, module in zip(specs, modules):
        spec.loader.exec_module(module)
    assert fired == modules[:1] and [module.X for module in modules] == [2, 2] and hooks.waiting() == []


class Caching:
    """A finder that hands out one spec object per module, however often it is asked."""

    def __init__(self, path):
        self.path, self.specs = path, {}

    def find_spec(self, fullname, path=None, target=None):
        import importlib.machinery
        import importlib.util

        if fullname != "hk_cached":
            return None
        if fullname not in self.specs:
            loader = importlib.machinery.SourceFileLoader(fullname, str(self.path))
            self.specs[fullname] = importlib.util.spec_from_loader(fullname, loader)
        return self.specs[fullname]


def test_a_spec_that_carries_the_shims_loader_already_is_not_wrapped_again(hooks, own_meta_path):
    """A caching finder asked twice for the same reload before it loads: the patches are re-applied
    once, and the spec ends with the found loader."""
    _write(hooks, "hk_cached.py", "X = 1\n")
    caching = Caching(str(hooks.dir / "hk_cached.py"))
    own_meta_path.insert(1, caching)
    import hk_cached
    spec = hooks.find_spec("hk_cached", None, hk_cached)
    assert hooks.find_spec("hk_cached", None, hk_cached) is spec is hk_cached.__spec__
    spec.loader.exec_module(hk_cached)  # what the reload does with it
    assert hooks.reapplied == [hk_cached] and type(spec.loader).__name__ == "SourceFileLoader"


class MadeLoader:
    """A loader that makes the module object itself (``create_module``) and runs code of its own."""

    def __init__(self, make):
        self.make, self.specs = make, []

    def create_module(self, spec):
        self.specs.append(spec)
        return self.make(spec)

    def exec_module(self, module):
        module.X = "made"


class ExecOnlyLoader:
    """A loader with ``exec_module`` and no ``create_module``: the default module object."""

    def exec_module(self, module):
        module.X = "default"


class LoaderFinder:
    """Finds each ``hk_`` name of ``loaders`` with the loader given for it."""

    def __init__(self, **loaders):
        self.loaders = loaders

    def find_spec(self, fullname, path=None, target=None):
        import importlib.util

        loader = self.loaders.get(fullname)
        return None if loader is None else importlib.util.spec_from_loader(fullname, loader)


class Sealed(types.ModuleType):
    """A module object that takes no ``__loader__`` nor ``__spec__`` (the import system skips
    what a module does not take)."""

    @property
    def __loader__(self):
        raise AttributeError("__loader__")

    @property
    def __spec__(self):
        raise AttributeError("__spec__")


class Nameless(types.ModuleType):
    """A module object without a ``__name__``."""

    @property
    def __name__(self):
        raise AttributeError("__name__")


class OwnSpec(types.ModuleType):
    """A module object with a ``__spec__`` of its own, which the import system cannot replace
    (read-only, as a module type of an extension's may have it)."""

    def __init__(self, name, spec, loader=None):
        super().__init__(name)
        self.__dict__["own_spec"] = spec
        self.__loader__ = loader

    @property
    def __spec__(self):
        return self.own_spec


def test_a_hook_for_an_object_without_a_spec_in_sys_modules_runs_at_once(hooks, monkeypatch):
    """What sys.modules holds under a hooked name may have no ``__spec__`` (a module object that takes
    none, one put there by hand): it counts as imported, and its hook runs at once."""
    module = Sealed("hk_sealed_before")
    monkeypatch.setitem(sys.modules, "hk_sealed_before", module)
    fired = []
    hooks.register("hk_sealed_before", fired.append)
    assert fired == [module] and hooks.waiting() == []


def test_a_loaders_own_module_object_gets_the_hooks(hooks, own_meta_path):
    made = MadeLoader(lambda spec: types.ModuleType(spec.name))
    own_meta_path.append(LoaderFinder(hk_made=made, hk_exec_only=ExecOnlyLoader()))
    fired = []
    hooks.register("hk_made", fired.append)
    hooks.register("hk_exec_only", fired.append)
    import hk_exec_only
    import hk_made
    assert fired == [hk_exec_only, hk_made] and (hk_made.X, hk_exec_only.X) == ("made", "default")
    assert made.specs == [hk_made.__spec__] and hk_made.__loader__ is made and hk_made.__spec__.loader is made


def _with_loader(loader):
    """``create_module``: a module object that says its ``__loader__`` already."""
    def make(spec):
        module = types.ModuleType(spec.name)
        module.__loader__ = loader
        return module
    return make


def test_a_module_that_says_its_own_loader_and_spec_keeps_them_and_no_trace_of_the_shims(hooks, own_meta_path):
    """A loader's module may carry its own ``__loader__`` and ``__spec__`` (the import system
    leaves them): kept, except where they name the shim's loader, which become the found one."""
    theirs = object()
    own = importlib.machinery.ModuleSpec("hk_own", theirs)
    copied = MadeLoader(lambda spec: OwnSpec(spec.name, importlib.machinery.ModuleSpec(spec.name, spec.loader),
                                             spec.loader))
    kept = MadeLoader(lambda spec: OwnSpec(spec.name, own, theirs))
    told = MadeLoader(_with_loader(theirs))
    own_meta_path.append(LoaderFinder(hk_copied=copied, hk_own=kept, hk_told=told))
    fired = []
    for name in ("hk_copied", "hk_own", "hk_told"):
        hooks.register(name, fired.append)
    import hk_copied
    import hk_own
    import hk_told
    assert fired == [hk_copied, hk_own, hk_told]
    # made from the spec it was handed (the shim's loader then): the found loader in both
    assert hk_copied.__loader__ is copied and hk_copied.__spec__.loader is copied
    assert hk_copied.__spec__ is not copied.specs[0]
    # another loader named: kept
    assert hk_own.__loader__ is theirs and hk_own.__spec__ is own and own.loader is theirs
    assert hk_told.__loader__ is theirs and hk_told.__spec__.loader is told


def test_odd_module_objects_are_loaded_and_hooked_as_far_as_they_go(hooks, own_meta_path):
    """One without ``__loader__`` and ``__spec__``, one whose ``__spec__`` has no loader: their
    hooks run; one without a name: it loads, and its hooks (found by name) stay waiting."""
    odd_spec = types.SimpleNamespace(name="hk_odd_spec")
    own_meta_path.append(LoaderFinder(
        hk_sealed=MadeLoader(lambda spec: Sealed(spec.name)),
        hk_odd_spec=MadeLoader(lambda spec: OwnSpec(spec.name, odd_spec)),
        hk_nameless=MadeLoader(lambda spec: Nameless("hk_nameless"))))
    fired = []
    for name in ("hk_sealed", "hk_odd_spec", "hk_nameless"):
        hooks.register(name, lambda module: fired.append(module.X))
    import hk_nameless
    import hk_odd_spec
    import hk_sealed
    assert fired == ["made", "made"] and hooks.waiting() == ["hk_nameless"]
    assert hk_odd_spec.__spec__ is odd_spec and hk_sealed.X == "made"
    assert hk_nameless.X == "made"


class OldNamespace:
    """Finds ``hk_oldns`` as Python < 3.11 does a namespace package: a spec without a loader."""

    def __init__(self, locations, origin=None):
        self.locations, self.origin = locations, origin

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "hk_oldns":
            return None
        spec = importlib.machinery.ModuleSpec(fullname, None, origin=self.origin, is_package=True)
        spec.submodule_search_locations = list(self.locations)
        spec.has_location = self.origin is not None
        return spec


def test_a_namespace_spec_without_a_loader_gets_the_import_systems_loader_and_its_hooks(hooks, own_meta_path):
    """In-process, what tests the real 3.9 and 3.10 in another Python: the namespace loader the
    import system would make, ``__file__`` None as it would set it."""
    locations = [str(hooks.dir / "hk_oldns")]
    own_meta_path.append(OldNamespace(locations))
    fired = []
    hooks.register("hk_oldns", lambda module: fired.append(module.__loader__))
    import hk_oldns
    loader = hk_oldns.__loader__
    assert fired == [loader] and type(loader).__name__ == "NamespaceLoader" and loader._path == locations
    assert hk_oldns.__spec__.loader is loader and hk_oldns.__file__ is None and hk_oldns.__path__ == locations


def test_a_namespace_spec_with_a_location_keeps_its_file(hooks, own_meta_path):
    """As the import system leaves it: a spec that has a location gives ``__file__`` its origin."""
    origin = str(hooks.dir / "hk_oldns" / "marker")
    own_meta_path.append(OldNamespace([str(hooks.dir / "hk_oldns")], origin=origin))
    fired = []
    hooks.register("hk_oldns", lambda module: fired.append(module.__file__))
    import hk_oldns
    assert fired == [origin] and hk_oldns.__file__ == origin


def test_the_namespace_loader_is_made_from_the_class_the_python_has(monkeypatch):
    """``NamespaceLoader`` (3.11+) first, ``_NamespaceLoader`` (3.9, 3.10), else none: the spec
    is left without a loader, for the import system."""
    from importlib import _bootstrap_external

    class OldLoader:
        """3.9's and 3.10's ``_NamespaceLoader``."""

    spec = importlib.machinery.ModuleSpec("hk_ns_kind", None, is_package=True)
    spec.submodule_search_locations = ["/nowhere/hk_ns_kind"]
    monkeypatch.setattr(_bootstrap_external, "_NamespaceLoader", OldLoader)
    made = finder._namespace_loader(spec)
    assert type(made) is _bootstrap_external.NamespaceLoader and made._path == ["/nowhere/hk_ns_kind"]
    monkeypatch.delattr(_bootstrap_external, "NamespaceLoader")
    made = finder._namespace_loader(spec)
    assert type(made) is OldLoader and made._path == ["/nowhere/hk_ns_kind"]
    monkeypatch.delattr(_bootstrap_external, "_NamespaceLoader")
    assert finder._namespace_loader(spec) is None
    finder._hook_loader(spec, lambda module: None)
    assert spec.loader is None


class ReusingLegacyLoader:
    """A legacy loader that, as ``load_module`` must, reuses the module in sys.modules (a reload)
    and leaves its ``__loader__`` alone."""

    def load_module(self, fullname):
        module = sys.modules.get(fullname)
        if module is None:
            module = sys.modules[fullname] = types.ModuleType(fullname)
            module.__loader__ = self
        module.X = getattr(module, "X", 0) + 1
        return module


def test_a_reloaded_legacy_module_keeps_no_trace_of_the_shims_loader(hooks, own_meta_path):
    import importlib.util
    import warnings

    loader = ReusingLegacyLoader()
    own_meta_path.append(LoaderFinder(hk_relegacy=loader))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ImportWarning)  # "exec_module() not found" (3.10+)
        import hk_relegacy
        importlib.reload(hk_relegacy)
    assert hk_relegacy.X == 2 and hooks.reapplied == [hk_relegacy]
    assert hk_relegacy.__loader__ is loader and hk_relegacy.__spec__.loader is loader


# -- end to end, with each wrapt an image may have and with the bundle's -------------------------

_END_TO_END = """
import importlib, json, sys
fired = []
app = %r
if app != "shim-first":  # the application imported wrapt before sglang
    import wrapt
if app == "app-hooks-first":  # ... and hooked the very module the shim hooks
    wrapt.register_post_import_hook(lambda m: fired.append(m.__name__), "sglang.srt.utils.common")
import sglang
from npu_shim.runtime import activation, wrapt_loader
shim = activation.RUNTIME.finder
waiting = shim.waiting()
from sglang.srt.utils import common
patched = common.get_npu_memory_capacity()
private = sorted(m for m in sys.modules if m.startswith("npu_shim._wrapt"))
try:  # the application's own wrapt hook, registered afterwards
    import wrapt
    wrapt.register_post_import_hook(lambda m: fired.append(m.__name__), "colorsys")
    import colorsys
except ImportError:
    fired = None
importlib.reload(common)
print(json.dumps({"origin": wrapt_loader.loaded_origin().describe(), "waiting": waiting,
                  "left": shim.waiting(), "patched": patched,
                  "after_reload": common.get_npu_memory_capacity(),
                  "state": activation.RUNTIME.states()["demo"]["state"], "private": private,
                  "fired": fired}))
"""

_PRIVATE_1_14 = ["npu_shim._wrapt", "npu_shim._wrapt._wrappers"]
_PRIVATE_1_17 = ["npu_shim._wrapt", "npu_shim._wrapt._wrappers"]
_PRIVATE_2X = ["npu_shim._wrapt", "npu_shim._wrapt._wrappers", "npu_shim._wrapt.exceptions"]


@pytest.mark.another_python
@pytest.mark.parametrize("app", ["shim-first", "app-wrapt-first", "app-hooks-first"])
@pytest.mark.parametrize("version, private", [
    ("1.14.1", _PRIVATE_1_14), ("1.17.3", _PRIVATE_1_17), ("2.5.2", _PRIVATE_2X)])
def test_the_shims_hooks_with_the_images_wrapt(version, private, app, tree, bare_venvs):
    """The image's wrapt at 1.14, 1.17 and 2.x: the shim's hooks patch, re-apply after a reload
    and load no wrapt import hook, whether or not the application imported wrapt first; the
    application's own wrapt hooks fire as well -- on a module of its own, and on the very module
    the shim hooks (wrapt's finder then in front of the shim's)."""
    from shimdev.envs import sglang_envs
    from test_drop_in import REPO
    from test_drop_in import run as run_in

    layer = sglang_envs.ensure_wrapt(version)
    out = last_json(run_in(bare_venvs("3.11"), tree, _END_TO_END % app, REPO, after=[layer]))
    # wrapt 1.14 (not 1.17 nor 2.x) keeps answering for a module whose hooks fired, and on a
    # reload hands back the module's own spec (importlib.util.find_spec, without the target): when
    # the application hooks the very module with it, its finder is in front and the shim's is
    # not asked.
    reapplied = not (app == "app-hooks-first" and version == "1.14.1")
    assert out == {
        "origin": "image %s" % version, "waiting": sorted(OWN_MODULES + ["sglang.srt.utils.common"]),
        "left": OWN_MODULES,
        "patched": 1001, "after_reload": 1001 if reapplied else 1000, "state": "applied",
        # reused as the application imported it, or loaded privately: wrappers only
        "private": private if app == "shim-first" else [],
        "fired": (["sglang.srt.utils.common"] if app == "app-hooks-first" else []) + ["colorsys"]}


@pytest.mark.another_python
def test_the_shims_hooks_with_the_bundles_wrapt(tree, bare_venvs, built_bundle):
    from test_drop_in import run as run_in

    out = last_json(run_in(bare_venvs("3.11"), tree, _END_TO_END % "shim-first", built_bundle,
                           readonly=built_bundle))
    assert out == {
        "origin": "bundle 2.5.2 [cp311-x86_64-glibc2.5]", "waiting": sorted(OWN_MODULES + ["sglang.srt.utils.common"]),
        "left": OWN_MODULES, "patched": 1001, "after_reload": 1001, "state": "applied",
        "private": _PRIVATE_2X, "fired": None}
