"""The bootstrap's import watcher, in this process: what it answers the import system, when it
activates the shim or only says "off", and how the runtime hands it on.  (The same in fresh
interpreters, started the way a deployment starts them: test_bootstrap.py.)

Each test starts from a watcher that has seen nothing and leaves sys.meta_path, sys.modules and
the watcher's state as it found them.
"""

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
                        ("_looking", set())):
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


def test_after_sglang_every_import_is_handed_on_to_the_active_finder(watcher):
    sys.meta_path.append(Finds("sglang"))
    _bootstrap.arm()
    asked = []

    def shim_finder(fullname, path, target):
        asked.append((fullname, path, target))
        return "spec of %s" % fullname

    assert _bootstrap.hand_on(shim_finder) is False  # not before sglang was seen
    assert _bootstrap.handing_on_to() is None
    _bootstrap.find_spec("sglang")
    assert _bootstrap.hand_on(shim_finder) is True and _bootstrap.handing_on_to() is shim_finder
    assert _bootstrap.find_spec("sglang.srt", ["p"], "t") == "spec of sglang.srt"
    assert asked == [("sglang.srt", ["p"], "t")]
    _bootstrap.stop_handing_on()
    assert _bootstrap.handing_on_to() is None
    assert _bootstrap.find_spec("sglang.srt") is None and len(asked) == 1


def test_a_watcher_out_of_sys_meta_path_hands_nothing_on(watcher):
    sys.meta_path.append(Finds("sglang"))
    _bootstrap.arm()
    _bootstrap.find_spec("sglang")
    _bootstrap.disarm()
    assert _bootstrap.hand_on(lambda *args: None) is False and _bootstrap.handing_on_to() is None


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
