"""npu_shim/runtime/installer.py: ``install()`` / ``uninstall()`` in a fresh interpreter each, against the
fake sglang tree and demo patch of tests/test_bootstrap.py (install twice, uninstall restoring
copies and the children's environment: tests/test_bootstrap.py, tests/test_drop_in.py)."""

import os
import subprocess
import sys
import textwrap

import pytest

from npu_shim.runtime import installer
from test_bootstrap import REPO, last_json, run, tree  # noqa: F401 - ``tree`` is a fixture
from test_wrapt_loader import c_locale  # noqa: F401 - a fixture


def test_uninstall_before_the_shim_started_turns_it_off_and_install_arms_it_again(tree):
    proc = run(tree, """
        import json, sys
        import npu_shim
        from npu_shim import _bootstrap
        from npu_shim.runtime import activation
        npu_shim.uninstall()   # armed at start-up, nothing decided yet
        off = {"states": npu_shim.states(), "armed": _bootstrap.WATCHER in sys.meta_path}
        from sglang.srt.utils import common
        off["value"] = common.get_npu_memory_capacity()
        off["runtime"] = "npu_shim._wrapt" in sys.modules or activation.RUNTIME.installed
        again = npu_shim.install()  # sglang is imported now: patched in place
        print(json.dumps({"off": off, "again": again, "value": common.get_npu_memory_capacity(),
                          "state": npu_shim.states()["demo"]["state"]}))
    """)
    assert last_json(proc) == {"off": {"states": {}, "armed": False, "value": 1000, "runtime": False},
                               "again": True, "value": 1001, "state": "applied"}
    assert "Traceback" not in proc.stderr


# Without site-packages (``-S``) the interpreter has no wrapt, as on a real Ascend image; PYTHONPATH
# still holds the fake sglang and the repository, and nothing runs at start-up.
WITHOUT_WRAPT = """
import importlib.util, json, sys
import npu_shim, npu_shim.core.registry
npu_shim.core.registry.PATCH_MODULES[:] = ["demo"]
from npu_shim.runtime import activation

def shim_finders():
    return ["watcher" if getattr(f, "is_npu_shim_watcher", False) else type(f).__name__
            for f in sys.meta_path
            if getattr(f, "is_npu_shim_watcher", False) or type(f).__module__.startswith("npu_shim")]

seen = {"wrapt": importlib.util.find_spec("wrapt")}
seen["install_1"] = npu_shim.install()   # before sglang: arms the watcher
seen["finders_1"] = shim_finders()
from sglang.srt.utils import common      # the watcher fires; no wrapt: every patch says why
seen["state_1"] = npu_shim.states()["demo"]["state"]
seen["reason_1"] = npu_shim.states()["demo"]["reason"]
npu_shim.uninstall()
seen["after_uninstall"] = [npu_shim.states(), shim_finders(), activation.RUNTIME.installed]
seen["install_2"] = npu_shim.install()   # after sglang: activates at once
seen["state_2"] = npu_shim.states()["demo"]["state"]
seen["reason_2"] = npu_shim.states()["demo"]["reason"]
seen["finders_2"] = shim_finders()
seen["value"] = common.get_npu_memory_capacity()
seen["install_3"] = npu_shim.install()
print(json.dumps(seen))
"""


@pytest.mark.another_python
def test_install_uninstall_install_without_wrapt(tree):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NPU_SHIM_", "SGLANG_", "PYTHON"))}
    env.update(PYTHONPATH=os.pathsep.join([str(tree / "image"), str(tree / "pkgs"), REPO]),
               PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.run([sys.executable, "-S", "-c", textwrap.dedent(WITHOUT_WRAPT)], cwd=str(tree),
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = last_json(proc)
    assert out.pop("wrapt") is None
    reason = out.pop("reason_1")
    assert reason.startswith("wrapt is not available: wrapt is not installed in this image")
    assert out.pop("reason_2") == reason
    assert out == {"install_1": True, "finders_1": ["watcher"], "state_1": "failed",
                   "after_uninstall": [{}, [], False], "install_2": True, "state_2": "failed",
                   "finders_2": [], "value": 1000, "install_3": False}
    # each activation says so once: the summary and the failed patch, twice in all
    assert proc.stderr.count("demo: failed (wrapt is not available") == 2, proc.stderr
    assert "Traceback" not in proc.stderr


# -- reach_children, in this process: what the children inherit -------------------------------------

def _root(tmp_path, monkeypatch, sitecustomize=None, pth=False):
    """A shim root of the test's own (a checkout's or a bundle's, or a pip install's site dir):
    ``sitecustomize`` the text of its sitecustomize.py (None: none), ``pth`` whether it has the .pth."""
    from npu_shim import _paths

    root = tmp_path / "root"
    root.mkdir()
    if sitecustomize is not None:
        (root / "sitecustomize.py").write_text(sitecustomize, encoding="utf-8")
    if pth:
        (root / installer.PTH_NAME).write_text("import npu_shim._bootstrap\n")
    monkeypatch.setattr(_paths, "ROOT", str(root))
    return str(root)


OURS = '"""npu-shim bootstrap: watch for ``import sglang`` in every Python process."""\n'


def test_a_checkout_goes_first_on_the_childrens_pythonpath_once(tmp_path, monkeypatch):
    """Its sitecustomize.py must come first (no other one shadows it), without an empty entry
    (that would be the children's cwd) and without a second copy of the root."""
    root = _root(tmp_path, monkeypatch, sitecustomize=OURS)
    environ = {}
    assert installer.reach_children(environ) == "PYTHONPATH"
    assert environ == {"PYTHONPATH": root}
    environ = {"PYTHONPATH": os.pathsep.join(["/a", "", "/b", root, ""])}
    assert installer.reach_children(environ) == "PYTHONPATH"
    assert environ == {"PYTHONPATH": os.pathsep.join([root, "/a", "/b"])}
    assert installer.reach_children(environ) is None  # already first: nothing to do
    assert environ == {"PYTHONPATH": os.pathsep.join([root, "/a", "/b"])}


def test_reach_children_sets_this_process_environment_by_default(tmp_path, monkeypatch):
    root = _root(tmp_path, monkeypatch, sitecustomize=OURS)
    monkeypatch.setenv("PYTHONPATH", "/a")
    assert installer.reach_children() == "PYTHONPATH"
    assert os.environ["PYTHONPATH"] == os.pathsep.join([root, "/a"])


def test_a_pip_install_tells_its_pth_to_activate_the_children(tmp_path, monkeypatch):
    """No sitecustomize.py of the shim's (another one's, or none) but its .pth: NPU_SHIM_ACTIVATE=1,
    PYTHONPATH left alone."""
    _root(tmp_path, monkeypatch, sitecustomize="import os  # the image's own\n", pth=True)
    environ = {"PYTHONPATH": "/a"}
    assert installer.reach_children(environ) == "NPU_SHIM_ACTIVATE"
    assert environ == {"PYTHONPATH": "/a", "NPU_SHIM_ACTIVATE": "1"}
    assert installer.reach_children(environ) is None
    assert environ == {"PYTHONPATH": "/a", "NPU_SHIM_ACTIVATE": "1"}
    environ = {"NPU_SHIM_ACTIVATE": "0"}  # switched off by someone: install() switches it on
    assert installer.reach_children(environ) == "NPU_SHIM_ACTIVATE" and environ == {"NPU_SHIM_ACTIVATE": "1"}


def test_a_root_with_neither_says_the_children_are_not_patched(tmp_path, monkeypatch, caplog):
    import logging

    root = _root(tmp_path, monkeypatch)
    (tmp_path / "root" / "sitecustomize.py").mkdir()  # unreadable as a file: not ours
    environ = {"PYTHONPATH": "/a"}
    with caplog.at_level(logging.INFO, logger="npu_shim"):
        assert installer.reach_children(environ) is None
    assert environ == {"PYTHONPATH": "/a"}
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [(
        "WARNING", "install(): child processes will not be patched: %s has neither npu-shim's "
                   "sitecustomize.py nor its npu_shim-activate.pth" % root)]


def test_the_bootstrap_is_known_by_the_mark_in_its_first_200_characters(tmp_path):
    """The mark is in the bootstrap's first line; a file that names it further down (a comment
    quoting it) is someone else's."""
    path = tmp_path / "sitecustomize.py"
    path.write_text(OURS, encoding="utf-8")
    assert installer._bootstrap_file_is_ours(str(path)) is True
    path.write_text("#" * 183 + "npu-shim bootstrap\n", encoding="utf-8")  # its last character: the 201st
    assert installer._bootstrap_file_is_ours(str(path)) is False
    path.write_text("#" * 182 + "npu-shim bootstrap\n", encoding="utf-8")  # the 200th
    assert installer._bootstrap_file_is_ours(str(path)) is True
    path.write_text("# \u00e9" * 60 + "\n" + OURS, encoding="utf-8")  # characters, not bytes; read as UTF-8
    assert installer._bootstrap_file_is_ours(str(path)) is False
    path.write_text("# \u00e9\n" + OURS, encoding="utf-8")
    assert installer._bootstrap_file_is_ours(str(path)) is True
    assert installer._bootstrap_file_is_ours(str(tmp_path / "missing.py")) is False


def test_the_bootstrap_is_read_as_utf8_whatever_the_locale(tmp_path, c_locale):
    path = tmp_path / "sitecustomize.py"
    path.write_text("# npu-shim \u2014\n" + OURS, encoding="utf-8")
    assert installer._bootstrap_file_is_ours(str(path)) is True


def test_the_repository_root_is_reached_through_pythonpath(tmp_path):
    """This checkout's own sitecustomize.py is the bootstrap."""
    assert installer._bootstrap_file_is_ours(os.path.join(REPO, "sitecustomize.py")) is True
