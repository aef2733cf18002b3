"""``npu_shim.install()``'s reach beyond this process: the processes it starts activate the shim too
(``reach_children``).  Arming and disarming this process is ``Runtime.install`` / ``uninstall``
(npu_shim/runtime/activation.py)."""

import os

from npu_shim import _paths
from npu_shim.core import config
from npu_shim.reporting import log


def reach_children(environ=None):
    """Make Python processes started from here (multiprocessing spawn/forkserver, ``subprocess``
    running Python) activate the shim as this one did: they inherit the environment, so the shim's
    directory goes first on PYTHONPATH (its ``sitecustomize.py``), or, for a pip install, its
    ``.pth`` is told to activate.  Returns the variable set, or None (already so, or impossible)."""
    environ = os.environ if environ is None else environ
    root = _paths.ROOT
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
