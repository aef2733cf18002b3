"""The image's own sitecustomize, chained by the bootstrap, in this process: which one is next
after ours however sys.path spells our directory, what it sees while it runs, and how its errors
are told.  (The same at a fresh interpreter's start-up: test_bootstrap.py.)"""

import os
import sys
import types

import pytest

from npu_shim import _bootstrap


@pytest.fixture
def paths(tmp_path, monkeypatch):
    """Folders under tmp_path; ``make(name, code)`` writes a sitecustomize there.  sys.path, the
    sitecustomize module and the chained one are restored afterwards."""
    made = []

    def make(name, code=None):
        folder = tmp_path / name
        folder.mkdir()
        if code is not None:
            (folder / "sitecustomize.py").write_text(code)
        made.append(str(folder))
        return folder

    own = types.ModuleType("sitecustomize")
    monkeypatch.setitem(sys.modules, "sitecustomize", own)
    monkeypatch.setitem(sys.modules, "npu_shim.chained_sitecustomize", None)
    monkeypatch.setattr(sys, "path", list(sys.path))
    make.own = own
    yield make
    for folder in made:
        sys.path_importer_cache.pop(folder, None)


def ours_then(paths, code):
    """Our folder, then one whose sitecustomize is ``code``, as the whole of sys.path: ours."""
    ours = paths("ours", "")
    sys.path[:] = [str(ours), str(paths("entry", code))]
    return ours


def chain(ours):
    return _bootstrap.chain_next_sitecustomize(str(ours / "sitecustomize.py"))


def test_the_one_right_after_ours_runs_not_one_before_or_further_on(paths):
    before = paths("before", "RAN = 'before'\n")
    ours = paths("ours", "")
    right_after = paths("right_after", "RAN = 'right after'\n")
    further = paths("further", "RAN = 'further'\n")
    sys.path[:] = [str(before), str(ours), str(right_after), str(further)]
    assert chain(ours).RAN == "right after"


def test_our_directory_spelled_another_way_is_found_by_its_real_path(paths, tmp_path):
    ours = paths("ours", "")
    entry = paths("entry", "RAN = 'entry'\n")
    os.symlink(str(ours), str(tmp_path / "ours_link"))
    sys.path[:] = [str(tmp_path / "ours_link"), str(entry)]
    assert chain(ours).RAN == "entry"
    sys.path[:] = [str(tmp_path / "ours_link") + "/", str(tmp_path / "elsewhere")]
    assert chain(ours) is None


def test_the_current_directory_entry_counts_as_the_current_directory(paths, monkeypatch):
    ours = paths("ours", "")
    entry = paths("entry", "RAN = 'entry'\n")
    monkeypatch.chdir(str(ours))
    sys.path[:] = ["", str(entry)]
    assert chain(ours).RAN == "entry"


def test_our_own_file_met_again_through_a_link_is_never_chained(paths, tmp_path):
    ours = paths("ours", "")
    entry = paths("entry", "RAN = 'entry'\n")
    os.symlink(str(ours), str(tmp_path / "ours_again"))
    sys.path[:] = [str(ours), str(tmp_path / "ours_again"), str(entry)]
    sys.path_importer_cache.pop(str(tmp_path / "ours_again"), None)
    assert chain(ours).RAN == "entry"
    sys.path[:] = [str(ours), str(tmp_path / "ours_again")]
    assert chain(ours) is None


def test_the_chained_one_runs_under_its_own_name_and_ours_is_put_back(paths):
    ours = ours_then(paths, "import sys\nSELF = sys.modules['sitecustomize']\nNAME = __name__\n")
    module = chain(ours)
    assert module.SELF is module and module.NAME == "sitecustomize"
    assert sys.modules["sitecustomize"] is paths.own
    assert sys.modules["npu_shim.chained_sitecustomize"] is module


def test_with_none_of_ours_imported_the_chained_one_stays_sitecustomize(paths, monkeypatch):
    ours = ours_then(paths, "RAN = 1\n")
    monkeypatch.delitem(sys.modules, "sitecustomize")
    module = chain(ours)
    assert sys.modules["sitecustomize"] is module


@pytest.mark.parametrize("code, said", [
    ("raise ValueError('image bug')\n",
     "Error in sitecustomize; set PYTHONVERBOSE for traceback:\nValueError: image bug\n"),
    ("import no_such_module_in_the_image\n",
     "Error in sitecustomize; set PYTHONVERBOSE for traceback:\n"
     "ModuleNotFoundError: No module named 'no_such_module_in_the_image'\n"),
    ("raise ImportError('gone', name='sitecustomize')\n", ""),  # site.py is silent about this one
])
def test_an_error_in_the_chained_one_is_told_as_site_py_tells_it(paths, capsys, code, said):
    ours = ours_then(paths, code)
    module = chain(ours)
    assert capsys.readouterr().err == said
    assert sys.modules["sitecustomize"] is paths.own
    assert sys.modules["npu_shim.chained_sitecustomize"] is module


def test_in_verbose_mode_the_error_is_the_whole_traceback(paths, monkeypatch):
    ours = ours_then(paths, "raise ValueError('image bug')\n")
    hooked = []
    flags = {name: getattr(sys.flags, name) for name in dir(sys.flags)
             if not name.startswith("_") and not callable(getattr(sys.flags, name))}
    monkeypatch.setattr(sys, "flags", types.SimpleNamespace(**dict(flags, verbose=1)))
    monkeypatch.setattr(sys, "excepthook", lambda kind, exc, tb: hooked.append((kind, str(exc), tb is not None)))
    chain(ours)
    assert hooked == [(ValueError, "image bug", True)]
