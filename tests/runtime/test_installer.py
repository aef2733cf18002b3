"""npu_shim/runtime/installer.py: ``install()`` / ``uninstall()`` in a fresh interpreter each, against the
fake sglang tree and demo patch of tests/test_bootstrap.py (install twice, uninstall restoring
copies and the children's environment: tests/test_bootstrap.py, tests/test_drop_in.py)."""

import os
import subprocess
import sys
import textwrap

import pytest

from test_bootstrap import REPO, last_json, run, tree  # noqa: F401 - ``tree`` is a fixture


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
import npu_shim, npu_shim.patches.registry
npu_shim.patches.registry.PATCH_MODULES[:] = ["demo"]
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
