"""procinfo: who a process is -- here, the children sglang spawns that are not schedulers."""
import sys
import types

import pytest

from npu_shim.reporting import procinfo


@pytest.fixture
def main_module(monkeypatch):
    """Replace ``__main__`` by a module named ``name`` whose spec says ``sglang.launch_server``."""
    def make(name):
        module = types.ModuleType(name)
        module.__spec__ = types.SimpleNamespace(name="sglang.launch_server")
        monkeypatch.setitem(sys.modules, "__main__", module)
        monkeypatch.setattr(procinfo, "_noted", None)
        monkeypatch.setattr(procinfo, "_title", lambda: None)
    return make


def test_the_launcher_is_the_http_server(main_module):
    main_module("__main__")
    assert procinfo.role()["role"] == "http_server"


def test_a_spawned_child_of_the_launcher_is_not_the_http_server(main_module):
    """multiprocessing's spawn re-imports the parent's main module as ``__mp_main__`` in the
    child: its spec still says sglang.launch_server (the detokenizer was called http_server)."""
    main_module("__mp_main__")
    assert procinfo.role()["role"] == "unknown"


def test_the_detokenizer_is_known_by_the_target_it_starts(main_module):
    main_module("__mp_main__")

    def run_detokenizer_process(*args):
        pass

    procinfo.note_child_target(run_detokenizer_process)
    assert procinfo.role() == {"role": "detokenizer",
                               "source": "process target run_detokenizer_process"}
    assert procinfo.role_label() == "detokenizer"


def test_another_target_says_nothing(main_module):
    main_module("__mp_main__")
    procinfo.note_child_target(lambda: None)
    procinfo.note_child_target(None)
    assert procinfo.role()["role"] == "unknown"
