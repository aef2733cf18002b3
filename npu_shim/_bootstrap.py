"""What runs in every Python process at start-up: arm a watcher for ``import sglang``.

Only ``sys`` and ``os`` are touched here (both already loaded by the interpreter), so a process
that never imports sglang pays one meta-path entry and one string comparison per import.  The
first time sglang is about to be imported the watcher removes itself and hands over to
``npu_shim.runtime.activate``, which loads wrapt and the patches.
"""

import os
import sys

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class SglangImportWatcher:
    """A meta-path finder that finds nothing; it only notices the first ``import sglang``."""

    fired = False

    def find_spec(self, fullname, path=None, target=None):
        if self.fired or fullname != "sglang":
            return None
        # Stay in sys.meta_path: the import system is iterating that list right now, and removing
        # an entry would make it skip the finder after us (editable installs live there).
        self.fired = True
        from npu_shim import runtime  # deferred: wrapt and the patches load only from here

        runtime.activate_guarded()
        return None  # let the normal finders import sglang

    def __repr__(self):
        return "<npu-shim SglangImportWatcher fired=%s>" % self.fired


_WATCHER = SglangImportWatcher()


def master_switch_on():
    """NPU_SHIM_ENABLED, read without the config module; a bad value is reported and counts as off."""
    raw = os.environ.get("NPU_SHIM_ENABLED", "").strip().lower()
    if raw == "" or raw in _TRUE:
        return True
    if raw not in _FALSE:
        from npu_shim import config, log  # only on this error path

        try:
            config.ENABLED.read()
        except config.ConfigError as exc:
            log.error_once("config", "shim off: %s" % exc)
    return False


def is_armed():
    return _WATCHER in sys.meta_path and not _WATCHER.fired


def arm():
    """Install the watcher (idempotent).  Returns False when sglang was already imported."""
    if "sglang" in sys.modules:
        return False
    _WATCHER.fired = False
    if _WATCHER not in sys.meta_path:
        sys.meta_path.insert(0, _WATCHER)
    return True


def disarm():
    while _WATCHER in sys.meta_path:
        sys.meta_path.remove(_WATCHER)


def start():
    """Entry point of ``sitecustomize``: arm when the master switch allows it; never raises."""
    try:
        if master_switch_on():
            arm()
    except Exception as exc:  # noqa: BLE001 - nothing may reach the application from start-up
        try:
            from npu_shim import log

            log.error_once("bootstrap", "shim off: bootstrap failed: %r" % (exc,))
        except Exception:  # noqa: BLE001
            pass


def chain_next_sitecustomize(our_file):
    """Run the ``sitecustomize`` that would have run without us (the next one on sys.path), once.

    Python imports only the first ``sitecustomize`` it finds; images (Debian/Ubuntu Pythons among
    them) often ship their own, which must still run.  It is executed under its own name and then
    kept in ``sys.modules`` as ``npu_shim.chained_sitecustomize``; errors in it are reported the way
    ``site.py`` reports them and go no further.
    """
    from importlib.machinery import PathFinder

    ours = os.path.dirname(our_file)
    keys = sys.path
    if ours not in keys:  # normally a string match: site.py stores PYTHONPATH entries as abspath
        ours = os.path.realpath(ours)
        keys = [os.path.realpath(entry or os.getcwd()) for entry in sys.path]
    if ours not in keys:
        return None
    start = keys.index(ours) + 1
    after = [entry for entry, key in zip(sys.path[start:], keys[start:]) if key != ours]
    ours_real = os.path.realpath(our_file)
    for entry in after:
        spec = PathFinder.find_spec("sitecustomize", [entry])
        # Our own file again through another spelling of its directory (a symlink): never chain.
        if spec is not None and not (spec.origin and os.path.realpath(spec.origin) == ours_real):
            break
    else:
        return None
    if spec.loader is None:
        return None
    import importlib.util

    module = importlib.util.module_from_spec(spec)
    own = sys.modules.get("sitecustomize")
    sys.modules["sitecustomize"] = module
    try:
        spec.loader.exec_module(module)
    except ImportError as exc:
        if exc.name != "sitecustomize":  # site.py is silent about exactly this one
            _report_like_site(exc)
    except Exception as exc:  # noqa: BLE001 - same treatment site.py gives a failing sitecustomize
        _report_like_site(exc)
    finally:
        if own is not None:
            sys.modules["sitecustomize"] = own
    sys.modules["npu_shim.chained_sitecustomize"] = module
    return module


def _report_like_site(exc):
    if sys.flags.verbose:
        sys.excepthook(type(exc), exc, exc.__traceback__)
    else:
        sys.stderr.write("Error in sitecustomize; set PYTHONVERBOSE for traceback:\n%s: %s\n"
                         % (type(exc).__name__, exc))
