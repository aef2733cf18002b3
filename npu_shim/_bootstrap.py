"""npu-shim bootstrap: watch for ``import sglang`` in every Python process; chain the image's own
``sitecustomize``."""

# The repository root's sitecustomize.py is a symbolic link to this file (a bundle holds a copy),
# so with the shim on PYTHONPATH this one module is all a process loads at start-up; it registers
# itself as npu_shim._bootstrap for install() and the runtime.  A pip install runs start() from
# its .pth instead.  Every process unmarshals and runs this file: no class, few functions, comments
# rather than docstrings (scripts/bench_drop_in.py counts the instructions).  Only sys and os are
# touched; the first ``import sglang`` hands over to npu_shim.runtime.activation.
#
# The watcher is this module itself, and it is the only object of the shim's ever placed in
# sys.meta_path: a finder that finds nothing itself.  It notices the first ``import sglang``, and
# from then on hands every import on to the active shim's post-import hooks (the hook table,
# runtime/finder.ShimFinder, which is never in sys.meta_path): one finder of ours, since the import
# system asks each finder about each of the thousands of imports of an sglang process.  look_up is
# the one walk over the finders after it, with the one recursion guard: it answers both "is sglang
# there" (findable) and the hook table's "which spec would be imported".  The runtime talks to it
# through its functions (hand_on, stop_handing_on, look_up, waiting, activates_the_shim, take_over,
# disarm), handed this module; it never imports it.  Its state below is written only here.

import os
import sys

# How every boolean variable is spelled: npu_shim/core/config.py's TRUE_WORDS / FALSE_WORDS, written
# again rather than imported (importing the package's config here would load it in every process at
# start-up); tests/core/test_config.py holds the two equal.
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")

is_npu_shim_watcher = True  # what find_package_dir skips (asking it would activate the shim)
_saw_sglang = False  # the first ``import sglang`` went past (the shim activated, or said off)
_says_off_only = False  # NPU_SHIM_ENABLED=0: only say so when sglang is imported
_hand_on_to = None  # the hook table's find_spec, once the shim is active
# Per thread, the names it is looking up through the finders after the watcher (look_up's guard):
# a thread-local, so that a child made by os.fork() has none of the other threads' lookups.
_looking = sys.modules["_thread"]._local()


def find_spec(fullname, path=None, target=None):
    global _saw_sglang
    if _saw_sglang:
        return None if _hand_on_to is None else _hand_on_to(fullname, path, target)
    if fullname != "sglang" or not findable(fullname, path, target):
        return None
    # Stay in sys.meta_path: the import system is iterating that list right now, and removing an
    # entry would make it skip the finder after us (editable installs live there).
    _saw_sglang = True
    if _says_off_only:
        from npu_shim.runtime import off as off_line

        off_line.say_off()
        return None
    from npu_shim.runtime import activation  # deferred: wrapt and the patches load only from here

    activation.RUNTIME.activate_guarded(WATCHER)
    return None  # let the normal finders import sglang


def look_up(fullname, path=None, target=None, legacy=None):
    # The spec the finders after the watcher give ``fullname`` (what the import system imports
    # when the watcher answers None), or None.  A lookup this one causes in the same thread (a
    # finder asking importlib about the same name: wrapt's does) is answered None, not recursed.
    # A finder without find_spec is passed over, or answers ``legacy`` where that is given; what a
    # finder raises goes to the caller (the import system would see the same).
    names = getattr(_looking, "names", None)
    if names is None:
        names = _looking.names = set()
    if fullname in names:
        return None
    names.add(fullname)
    try:
        for finder in list(sys.meta_path):
            if finder is WATCHER:
                continue
            find = getattr(finder, "find_spec", None)
            if find is None:
                if legacy is not None:
                    return legacy
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                return spec
        return None
    finally:
        names.discard(fullname)


def findable(fullname, path, target):
    # Whether a finder after us finds ``fullname``: a process where ``import sglang`` fails (no
    # sglang in this Python: ``try: import sglang``) activates nothing and says nothing, and a
    # later import that finds it still activates.  A finder that raises, or one without find_spec,
    # is left to the import system (activate, as it may find it).
    try:
        return look_up(fullname, path, target, True) is not None
    except Exception:  # noqa: BLE001 - the import system asks that finder next and sees the same
        return True


def arm():
    # Put the watcher first in sys.meta_path (idempotent); False when sglang was already imported.
    global _saw_sglang
    if "sglang" in sys.modules:
        return False
    _saw_sglang = False
    if WATCHER not in sys.meta_path:
        sys.meta_path.insert(0, WATCHER)
    return True


def disarm():
    # Out of sys.meta_path (uninstall()).
    while WATCHER in sys.meta_path:
        sys.meta_path.remove(WATCHER)


def waiting():
    # Armed and waiting for the first ``import sglang``.
    return WATCHER in sys.meta_path and not _saw_sglang


def says_off_only():
    # Armed with NPU_SHIM_ENABLED=0: it only says "off" at ``import sglang``.
    return _says_off_only


def activates_the_shim():
    # This process's start-up armed the shim itself (not only to say "off"): it activates, or
    # did, at the first ``import sglang`` (true too once install() had the watcher hand on).
    return (waiting() or _saw_sglang) and not _says_off_only


def take_over():
    # An explicit install(): the watcher activates the shim even where it was armed only to say
    # "off" (each patch then reads ``disabled``).
    global _says_off_only
    _says_off_only = False


def hand_on(find_spec):
    # Hand every later import on to ``find_spec`` (the hook table's): sglang counts as seen, and
    # the watcher goes first in sys.meta_path where it is not there (install() after sglang was
    # imported, or after uninstall()).  Where it is there it stays in place: a list the import
    # system may be walking right now is not reordered.
    global _saw_sglang, _hand_on_to
    _saw_sglang = True
    _hand_on_to = find_spec
    if WATCHER not in sys.meta_path:
        sys.meta_path.insert(0, WATCHER)


def stop_handing_on():
    global _hand_on_to
    _hand_on_to = None


def handing_on_to():
    return _hand_on_to


def start():
    # Arm the watcher; with NPU_SHIM_ENABLED off it only says so once sglang is imported (read
    # here without the config module: a bad value is reported through it and counts as off);
    # never raises.
    global _says_off_only
    try:
        raw = os.environ.get("NPU_SHIM_ENABLED", "").strip().lower()
        if raw == "" or raw in TRUE_WORDS:
            arm()
        elif raw in FALSE_WORDS:
            _says_off_only = True
            arm()
        else:
            from npu_shim.core import config
            from npu_shim.reporting import log  # only on this error path

            try:
                config.ENABLED.read()
            except config.ConfigError as exc:
                log.error_once("config", "shim off: %s" % exc)
    except Exception as exc:  # noqa: BLE001 - nothing may reach the application from start-up
        try:
            from npu_shim.reporting import log

            log.error_once("bootstrap", "shim off: bootstrap failed: %r" % (exc,))
        except Exception:  # noqa: BLE001 - saying so failed too: start-up goes on, silent
            pass


def chain_next_sitecustomize(our_file):
    # Run the sitecustomize that would have run without us (the next one on sys.path), once.
    # Python imports only the first sitecustomize it finds; images (Debian/Ubuntu Pythons among
    # them) often ship their own, which must still run.  It is executed under its own name and
    # then kept in sys.modules as npu_shim.chained_sitecustomize; errors in it are reported the
    # way site.py reports them and go no further.  The import system's own PathFinder and
    # module_from_spec: importing importlib for them would cost every process its import.
    path_finder = sys.modules["_frozen_importlib_external"].PathFinder
    ours = os.path.dirname(our_file)
    keys = sys.path
    if ours not in keys:  # normally a string match: site.py stores PYTHONPATH entries as abspath
        ours = os.path.realpath(ours)
        keys = [os.path.realpath(entry or os.getcwd()) for entry in sys.path]
    if ours not in keys:
        return None
    start = keys.index(ours) + 1
    after = [entry for entry, key in zip(sys.path[start:], keys[start:]) if key != ours]
    spec = path_finder.find_spec("sitecustomize", after) if after else None
    if spec is not None and spec.origin and os.path.realpath(spec.origin) == os.path.realpath(our_file):
        # Our own file again through another spelling of its directory (a symlink): never chain
        # to it; the next sitecustomize, if any, lies past that entry.  (One search over all the
        # entries first: this runs in every process.)
        spec = None
        for entry in after:
            found = path_finder.find_spec("sitecustomize", [entry])
            if found is not None and not (
                    found.origin and os.path.realpath(found.origin) == os.path.realpath(our_file)):
                spec = found
                break
    if spec is None or spec.loader is None:
        return None
    module = sys.modules["_frozen_importlib"].module_from_spec(spec)
    own = sys.modules.get("sitecustomize")
    sys.modules["sitecustomize"] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - same treatment site.py gives a failing sitecustomize
        # site.py is silent about ImportError(name='sitecustomize'), else one line (or the
        # traceback in verbose mode)
        if not (isinstance(exc, ImportError) and exc.name == "sitecustomize"):
            if sys.flags.verbose:
                sys.excepthook(type(exc), exc, exc.__traceback__)
            else:
                sys.stderr.write("Error in sitecustomize; set PYTHONVERBOSE for traceback:\n%s: %s\n"
                                 % (type(exc).__name__, exc))
    finally:
        if own is not None:
            sys.modules["sitecustomize"] = own
    sys.modules["npu_shim.chained_sitecustomize"] = module
    return module


WATCHER = sys.modules[__name__]  # the watcher: this module (see the comment at the top)

# This file executing as sitecustomize: arm, then chain the image's own; never raise.
if __name__ == "sitecustomize":
    try:
        # An earlier activation in this process (a pip install's .pth) owns the watcher.
        sys.modules.setdefault("npu_shim._bootstrap", WATCHER).start()
    except Exception as exc:  # noqa: BLE001 - start-up must never fail because of the shim
        sys.stderr.write("[npu-shim] shim off: bootstrap failed: %r\n" % (exc,))
    try:
        chain_next_sitecustomize(__file__)
    except Exception as exc:  # noqa: BLE001 - the image's own sitecustomize failing must not stop start-up
        sys.stderr.write("[npu-shim] could not run the next sitecustomize: %r\n" % (exc,))
