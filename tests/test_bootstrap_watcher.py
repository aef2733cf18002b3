"""The bootstrap's import watcher, in this process: what it answers the import system, when it
activates the shim or only says "off", how the runtime has it hand imports on, and its one lookup
through the finders after it (``look_up``, with the one recursion guard).  (The same in fresh
interpreters, started the way a deployment starts them: test_bootstrap.py.)

Each test starts from a watcher that has seen nothing and leaves sys.meta_path, sys.modules and
the watcher's state as it found them.
"""

import os
import sys
import threading
import types

import pytest

from npu_shim import _bootstrap
from npu_shim.reporting import log
from npu_shim.runtime import activation, off


class Finds:
    """A meta-path finder that finds ``names`` (a spec of a package) and records what it was asked."""

    def __init__(self, *names):
        self.names = names
        self.asked = []

    def find_spec(self, fullname, path=None, target=None):
        self.asked.append((fullname, path) if target is None else (fullname, path, target))
        if fullname in self.names:
            return types.SimpleNamespace(name=fullname, submodule_search_locations=[])
        return None


class Raises:
    def find_spec(self, fullname, path=None, target=None):
        raise RuntimeError("a broken finder")


@pytest.fixture
def watcher(monkeypatch):
    """The watcher as start-up leaves it before any ``import sglang``, with the shim's activation
    and its "off" line recorded instead of run."""
    for name, value in (("_saw_sglang", False), ("_says_off_only", False), ("_hand_on_to", None),
                        ("_looking", sys.modules["_thread"]._local())):
        monkeypatch.setattr(_bootstrap, name, value)
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path if f is not _bootstrap.WATCHER])
    monkeypatch.delitem(sys.modules, "sglang", raising=False)
    calls = []
    monkeypatch.setattr(activation.RUNTIME, "activate_guarded", lambda w=None: calls.append(("activate", w)))
    monkeypatch.setattr(off, "say_off", lambda: calls.append(("off",)))
    return calls


def test_arming_puts_the_watcher_first_once(watcher):
    first = Finds()
    sys.meta_path.insert(0, first)
    assert not _bootstrap.waiting()
    assert _bootstrap.arm() is True
    assert sys.meta_path[0] is _bootstrap.WATCHER and sys.meta_path[1] is first
    assert _bootstrap.arm() is True
    assert sys.meta_path.count(_bootstrap.WATCHER) == 1
    assert _bootstrap.waiting() and _bootstrap.activates_the_shim() and not _bootstrap.says_off_only()
    sys.meta_path.append(_bootstrap.WATCHER)  # however it got there twice, disarming takes out both
    _bootstrap.disarm()
    assert _bootstrap.WATCHER not in sys.meta_path
    assert not _bootstrap.waiting() and not _bootstrap.activates_the_shim()


def test_arming_after_sglang_was_imported_does_nothing(watcher, monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", types.ModuleType("sglang"))
    assert _bootstrap.arm() is False
    assert _bootstrap.WATCHER not in sys.meta_path and not _bootstrap.waiting()


def test_arming_again_waits_for_the_next_import_of_sglang(watcher, monkeypatch):
    monkeypatch.setattr(_bootstrap, "_saw_sglang", True)
    assert _bootstrap.arm() is True
    assert _bootstrap.waiting()


def test_the_first_findable_import_of_sglang_activates_the_shim_and_imports_nothing_itself(watcher):
    sglang = Finds("sglang")
    sys.meta_path.append(sglang)
    _bootstrap.arm()
    assert _bootstrap.find_spec("numpy") is None and watcher == []  # another name: nothing asked
    assert sglang.asked == []
    assert _bootstrap.find_spec("sglang") is None  # the finders after the watcher import it
    assert watcher == [("activate", _bootstrap.WATCHER)]
    assert sglang.asked == [("sglang", None)]
    assert not _bootstrap.waiting() and _bootstrap.activates_the_shim()
    assert _bootstrap.WATCHER in sys.meta_path  # stays: the import system is iterating the list
    assert _bootstrap.find_spec("sglang") is None  # seen: never activates twice
    assert watcher == [("activate", _bootstrap.WATCHER)]


def test_an_import_of_sglang_that_finds_nothing_activates_nothing(watcher):
    sys.meta_path.append(Finds("numpy"))
    _bootstrap.arm()
    assert _bootstrap.find_spec("sglang") is None
    assert watcher == [] and _bootstrap.waiting()


def test_switched_off_the_watcher_only_says_so(watcher, monkeypatch):
    sys.meta_path.append(Finds("sglang"))
    monkeypatch.setenv("NPU_SHIM_ENABLED", "0")
    _bootstrap.start()
    assert _bootstrap.says_off_only() and not _bootstrap.activates_the_shim()
    assert _bootstrap.find_spec("sglang") is None
    assert watcher == [("off",)]


def test_an_explicit_install_takes_over_a_watcher_armed_only_to_say_off(watcher, monkeypatch):
    sys.meta_path.append(Finds("sglang"))
    monkeypatch.setenv("NPU_SHIM_ENABLED", "0")
    _bootstrap.start()
    _bootstrap.take_over()
    assert not _bootstrap.says_off_only() and _bootstrap.activates_the_shim()
    _bootstrap.find_spec("sglang")
    assert watcher == [("activate", _bootstrap.WATCHER)]


def test_after_sglang_every_import_is_handed_on_to_the_hook_table(watcher):
    sys.meta_path.append(Finds("sglang"))
    _bootstrap.arm()
    asked = []

    def hook_table(fullname, path, target):
        asked.append((fullname, path, target))
        return "spec of %s" % fullname

    _bootstrap.find_spec("sglang")
    before = list(sys.meta_path)
    _bootstrap.hand_on(hook_table)
    assert _bootstrap.handing_on_to() is hook_table
    assert sys.meta_path == before  # in place: a list the import system may be walking is not reordered
    assert _bootstrap.find_spec("sglang.srt", ["p"], "t") == "spec of sglang.srt"
    assert asked == [("sglang.srt", ["p"], "t")] and watcher == [("activate", _bootstrap.WATCHER)]
    _bootstrap.stop_handing_on()
    assert _bootstrap.handing_on_to() is None
    assert _bootstrap.find_spec("sglang.srt") is None and len(asked) == 1


@pytest.mark.parametrize("how", ["never armed", "disarmed", "waiting"])
def test_handing_on_arms_the_watcher_first_in_sys_meta_path_in_that_state(watcher, how):
    """``install()`` after sglang was imported (or after ``uninstall()``): the watcher goes first,
    once, as if it had seen sglang -- it hands on and never activates the shim again itself."""
    first = Finds("sglang")
    sys.meta_path.insert(0, first)
    if how != "never armed":
        _bootstrap.arm()
    if how == "disarmed":
        _bootstrap.disarm()
    asked = []
    _bootstrap.hand_on(lambda *question: asked.append(question))
    assert sys.meta_path.count(_bootstrap.WATCHER) == 1 and sys.meta_path.index(_bootstrap.WATCHER) == 0
    assert not _bootstrap.waiting() and _bootstrap.activates_the_shim()
    _bootstrap.find_spec("sglang")
    assert asked == [("sglang", None, None)] and watcher == [] and first.asked == []
    other = Finds()
    sys.meta_path.insert(0, other)
    _bootstrap.hand_on(lambda *question: None)  # again (install() after uninstall()): not moved, not added
    assert sys.meta_path[:2] == [other, _bootstrap.WATCHER] and sys.meta_path.count(_bootstrap.WATCHER) == 1


def test_findable_asks_every_other_finder_in_turn(watcher):
    first, second = Finds(), Finds("sglang")
    sys.meta_path[:0] = [first, second]
    _bootstrap.arm()
    assert _bootstrap.findable("sglang", None, None) is True
    assert first.asked == [("sglang", None)] and second.asked == [("sglang", None)]
    assert _bootstrap.findable("other", ["x"], None) is False
    assert second.asked[-1] == ("other", ["x"])


@pytest.mark.parametrize("finder", [Raises(), types.SimpleNamespace(find_module=None)])
def test_a_finder_that_raises_or_has_no_find_spec_counts_as_finding_it(watcher, finder):
    """The import system asks that finder next and sees for itself."""
    sys.meta_path.insert(0, finder)
    assert _bootstrap.findable("sglang", None, None) is True


def test_a_lookup_the_question_causes_in_the_same_thread_is_answered_no(watcher):
    """A finder that asks the import system about sglang while asked (importlib.util.find_spec
    inside find_spec) is answered "not found" by the watcher, not recursed into."""
    inner = []

    class AsksAgain:
        def find_spec(self, fullname, path=None, target=None):
            if fullname == "sglang":
                inner.append(_bootstrap.findable("sglang", None, None))
            return None

    sys.meta_path[:0] = [AsksAgain(), Finds("sglang")]
    assert _bootstrap.findable("sglang", None, None) is True
    assert inner == [False]
    assert _bootstrap.findable("sglang", None, None) is True and inner == [False, False]  # asked anew


@pytest.mark.parametrize("value, armed, off_only", [
    ("", True, False), ("1", True, False), (" Yes ", True, False), ("ON", True, False),
    ("true", True, False), ("0", True, True), ("off", True, True), (" FALSE", True, True), ("no", True, True),
])
def test_start_arms_the_watcher_as_the_switch_says(watcher, monkeypatch, value, armed, off_only):
    monkeypatch.setenv("NPU_SHIM_ENABLED", value)
    _bootstrap.start()
    assert (_bootstrap.WATCHER in sys.meta_path) is armed
    assert _bootstrap.says_off_only() is off_only


def test_start_without_the_switch_arms_the_watcher(watcher, monkeypatch):
    monkeypatch.delenv("NPU_SHIM_ENABLED", raising=False)
    _bootstrap.start()
    assert _bootstrap.waiting() and not _bootstrap.says_off_only()


def test_start_with_a_bad_switch_says_why_once_and_stays_off(watcher, monkeypatch):
    said = []
    monkeypatch.setattr(log, "error_once", lambda key, message: said.append((key, message)))
    monkeypatch.setenv("NPU_SHIM_ENABLED", "maybe")
    _bootstrap.start()
    assert _bootstrap.WATCHER not in sys.meta_path and not _bootstrap.says_off_only()
    assert len(said) == 1 and said[0][0] == "config"
    assert said[0][1].startswith("shim off: ") and "NPU_SHIM_ENABLED" in said[0][1] and "maybe" in said[0][1]


def _arm_fails():
    raise OSError("meta path unwritable")


def test_start_never_raises_and_says_why_it_failed(watcher, monkeypatch):
    said = []
    monkeypatch.setattr(log, "error_once", lambda key, message: said.append((key, message)))
    monkeypatch.setattr(_bootstrap, "arm", _arm_fails)
    monkeypatch.delenv("NPU_SHIM_ENABLED", raising=False)
    _bootstrap.start()
    assert said == [("bootstrap", "shim off: bootstrap failed: OSError('meta path unwritable')")]
    assert _bootstrap.WATCHER not in sys.meta_path


def test_start_stays_silent_when_even_saying_so_fails(watcher, monkeypatch):
    def broken(key, message):
        raise RuntimeError("logging broken")

    monkeypatch.setattr(log, "error_once", broken)
    monkeypatch.setattr(_bootstrap, "arm", _arm_fails)
    monkeypatch.delenv("NPU_SHIM_ENABLED", raising=False)
    _bootstrap.start()  # no exception reaches the application
    assert _bootstrap.WATCHER not in sys.meta_path


def test_the_other_finders_are_asked_the_question_as_it_came(watcher):
    """``path`` and ``target`` (a reload's module) reach the finders after the watcher unchanged."""
    sglang = Finds("sglang")
    sys.meta_path.append(sglang)
    _bootstrap.arm()
    target = types.ModuleType("sglang")
    assert _bootstrap.find_spec("sglang", ["where"], target) is None
    assert sglang.asked == [("sglang", ["where"], target)] and watcher == [("activate", _bootstrap.WATCHER)]


def test_another_thread_asking_at_the_same_time_is_answered_for_itself(watcher):
    """The "no" to a lookup inside the question is per thread: a second thread importing sglang
    while the first is still asking the finders gets the finders' own answer."""
    entered, release = threading.Event(), threading.Event()
    first = []

    class Slow:
        def find_spec(self, fullname, path=None, target=None):
            if threading.current_thread() is asker:
                entered.set()
                assert release.wait(30)
            return types.SimpleNamespace(name=fullname)

    sys.meta_path.insert(0, Slow())
    asker = threading.Thread(target=lambda: first.append(_bootstrap.findable("sglang", None, None)))
    asker.start()
    try:
        assert entered.wait(30)
        assert _bootstrap.findable("sglang", None, None) is True
    finally:
        release.set()
        asker.join(30)
    assert first == [True]


# -- look_up: the one walk over the finders after the watcher, and its one recursion guard -------------

def test_look_up_gives_the_first_spec_of_the_finders_after_the_watcher_never_asking_it(watcher, monkeypatch):
    nothing, finds, later = Finds(), Finds("hk_x"), Finds("hk_x")
    sys.meta_path[:0] = [nothing, _bootstrap.WATCHER, finds, later]
    spec = _bootstrap.look_up("hk_x", ["where"], "target")
    assert spec.name == "hk_x" and later.asked == []
    assert nothing.asked == [("hk_x", ["where"], "target")] == finds.asked
    assert _bootstrap.look_up("hk_none") is None and later.asked == [("hk_none", None)]


def test_look_up_passes_a_legacy_finder_over_unless_told_what_it_answers(watcher):
    """A finder without find_spec: the hook table takes the spec of the next one (the import system
    of Python 3.12+ passes it over too); ``findable`` counts it as finding (before 3.12 the import
    system asks its find_module)."""
    sys.meta_path[:0] = [types.SimpleNamespace(find_module=None), Finds("hk_x")]
    assert _bootstrap.look_up("hk_x").name == "hk_x"
    assert _bootstrap.look_up("hk_x", None, None, "legacy") == "legacy"


def test_what_a_finder_raises_reaches_the_hook_tables_lookup_and_the_guard_is_let_go(watcher):
    sys.meta_path.insert(0, Raises())
    with pytest.raises(RuntimeError, match="a broken finder"):
        _bootstrap.look_up("hk_x")
    assert _bootstrap._looking.names == set()
    assert _bootstrap.findable("hk_x", None, None) is True


def test_the_guard_answers_a_lookup_of_the_same_name_inside_it_and_looks_up_any_other(watcher):
    """A finder asked about ``hk_outer`` that asks the import system about ``hk_outer`` again
    (wrapt's does) gets None; about another module (its own configuration), that one's spec."""
    inner = []

    class Peeks:
        def find_spec(self, fullname, path=None, target=None):
            if fullname == "hk_outer":
                inner.append(_bootstrap.look_up("hk_outer"))
                inner.append(_bootstrap.look_up("hk_inner").name)
            return None

    sys.meta_path[:0] = [Peeks(), Finds("hk_outer", "hk_inner")]
    assert _bootstrap.look_up("hk_outer").name == "hk_outer"
    assert inner == [None, "hk_inner"] and _bootstrap._looking.names == set()


def test_a_child_forked_while_another_thread_looks_up_a_name_can_look_it_up(watcher):
    """The guard is per thread (a thread-local): a child made by ``os.fork()`` keeps none of the
    other threads' lookups, even for a new thread that gets the ident of one of them (glibc hands
    a new thread the stack, and so the ident, of a thread the fork left behind)."""
    entered, release = threading.Event(), threading.Event()

    class Slow:
        def find_spec(self, fullname, path=None, target=None):
            if threading.current_thread() is asker:
                entered.set()
                assert release.wait(30)
            return types.SimpleNamespace(name=fullname) if fullname == "hk_forked" else None

    sys.meta_path.insert(0, Slow())
    asker = threading.Thread(target=_bootstrap.look_up, args=("hk_forked",))
    asker.start()
    try:
        assert entered.wait(30)
        pid = os.fork()
        if pid == 0:  # the child: never back into pytest
            try:
                found = []
                fresh = threading.Thread(target=lambda: found.append(_bootstrap.look_up("hk_forked")))
                fresh.start()
                fresh.join(10)
                os._exit(0 if [spec.name for spec in found] == ["hk_forked"] else 1)
            finally:
                os._exit(2)
    finally:
        release.set()
        asker.join(30)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
