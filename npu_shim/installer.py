"""``npu_shim.install()`` / ``uninstall()``: arming the shim by hand in a process, and making the
processes it starts activate it too (``reach_children``)."""

import os
import sys

from npu_shim import config, log, statefile
from npu_shim.runtime import _FINDER, _RT, activate, revert_record


def watcher_armed():
    """The start-up watcher is waiting for ``import sglang`` in this process."""
    from npu_shim import _bootstrap

    return _bootstrap._WATCHER in sys.meta_path and not _bootstrap._WATCHER.fired


def install():
    """Arm the shim in this process; patches already imported sglang modules in place."""
    from npu_shim import _bootstrap

    with _RT.lock:
        if _RT.installed or (watcher_armed() and not _bootstrap._WATCHER.off):
            return False
        # An explicit install() decides every patch even with NPU_SHIM_ENABLED=0 (each then reads
        # ``disabled``), as it always has; the start-up watcher only says "off".
        _bootstrap._WATCHER.off = False
        if "sglang" in sys.modules:
            activate()
        else:
            _bootstrap.arm()
    reach_children()
    return True


def reach_children(environ=None):
    """Make Python processes started from here (multiprocessing spawn/forkserver, ``subprocess``
    running Python) activate the shim as this one did: they inherit the environment, so the shim's
    directory goes first on PYTHONPATH (its ``sitecustomize.py``), or, for a pip install, its
    ``.pth`` is told to activate.  Returns the variable set, or None (already so, or impossible)."""
    environ = os.environ if environ is None else environ
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if _bootstrap_file_is_ours(os.path.join(root, "sitecustomize.py")):
        entries = [e for e in environ.get("PYTHONPATH", "").split(os.pathsep) if e]
        if entries[:1] == [root]:
            return None
        # First, so no other sitecustomize shadows ours; never an empty entry (that is the cwd).
        environ["PYTHONPATH"] = os.pathsep.join([root] + [e for e in entries if e != root])
        return "PYTHONPATH"
    if os.path.isfile(os.path.join(root, PTH_NAME)):
        if environ.get(config.ACTIVATE.name) == "1":
            return None
        environ[config.ACTIVATE.name] = "1"
        return config.ACTIVATE.name
    log.warning("install(): child processes will not be patched: %s has neither npu-shim's "
                "sitecustomize.py nor its %s" % (root, PTH_NAME))
    return None


PTH_NAME = "npu_shim-activate.pth"


def _bootstrap_file_is_ours(path):
    try:
        with open(path, encoding="utf-8") as handle:
            return "npu-shim bootstrap" in handle.read(200)
    except OSError:
        return False


def uninstall():
    """Restore every original (and every rebound copy); the shim is then off in this process."""
    from npu_shim import _bootstrap

    with _RT.lock:
        while _bootstrap._WATCHER in sys.meta_path:
            sys.meta_path.remove(_bootstrap._WATCHER)
        _FINDER.uninstall()
        if _RT.records:
            for record in _RT.records.values():
                revert_record(record)
        _RT.installed = False
        _RT.generation += 1
        _RT.records = None
        _RT.patches = None
    statefile.write()
