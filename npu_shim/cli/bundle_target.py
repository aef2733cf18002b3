"""Where a bundle may go: OUT_DIR and OUT_DIR.tar.gz checked before anything is downloaded or
created (``check_target``), and again before the built bundle is swapped in.

OUT_DIR must be absent, an empty directory, or -- with ``force`` -- a previous bundle exactly as
built (its MANIFEST names npu_shim and lists every file in it); ``/``, the current directory and
its parents, the home directory, links, mount points and other files are refused, each with
``BundleError`` and one line.
"""

import os
import stat

from npu_shim import _paths
from npu_shim.cli.bundle_verify import read_manifest, shown, unlisted


class BundleError(RuntimeError):
    """The bundle could not be built; nothing was left at OUT_DIR."""


def identity(path):
    """What is at path (device, inode, kind; None when nothing), to see it unchanged later."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    return info.st_dev, info.st_ino, stat.S_IFMT(info.st_mode)


def _home_dirs():
    """The home directory as $HOME says and as the password database says."""
    found = [os.path.expanduser("~")]
    try:
        import pwd

        found.append(pwd.getpwuid(os.getuid()).pw_dir)
    except (ImportError, KeyError):
        pass
    return [path for path in found if os.path.isabs(path)]


def _refused_place(path):
    """Why OUT_DIR may never be replaced, whatever is in it, or None: it is (or holds) the current
    directory or the home directory, or it is, holds or is inside the npu_shim being bundled."""
    places = [("the home directory", home) for home in _home_dirs()]
    try:
        places.append(("the current directory", os.getcwd()))
    except OSError:
        pass  # removed: it cannot be OUT_DIR
    source = _paths.PACKAGE_DIR
    places.append(("the npu_shim package being bundled", source))
    for what, given in places:
        for place in {given, os.path.realpath(given)}:
            for name in {path, os.path.realpath(path)}:
                if name == place:
                    return "%s is %s" % (shown(path), what)
                if place.startswith(name + os.sep):
                    return "%s holds %s" % (shown(path), what)
                if given == source and name.startswith(place + os.sep):
                    return "%s is inside %s" % (shown(path), what)
    return None


def _absolute(out_dir):
    """OUT_DIR made absolute, refusing the empty string and "/" (``$DEST/`` with DEST unset)."""
    if not out_dir.strip():
        raise BundleError("OUT_DIR is empty (is a variable in it unset?)")
    if "\0" in out_dir:
        raise BundleError("OUT_DIR %s holds a NUL character" % ascii(out_dir))
    try:
        path = os.path.abspath(out_dir)
    except OSError as exc:  # a relative OUT_DIR and a current directory that was removed
        raise BundleError("OUT_DIR %s: %s" % (shown(out_dir), exc.strerror)) from None
    if os.path.dirname(path) == path:
        raise BundleError("OUT_DIR %s is the root directory (is a variable in it unset?)"
                          % shown(out_dir))
    return path


def _not_a_previous_bundle(path):
    """Why the directory at path is not a previous bundle exactly as built, or None."""
    manifest, problem = read_manifest(path)
    if manifest is None:
        return "its MANIFEST %s" % problem if problem != "missing" else "it has no MANIFEST"
    found = unlisted(path, manifest)
    if found:
        return "it holds what its MANIFEST does not list: %s%s" % (
            ", ".join(shown(p) if why == "extra" else "%s (%s)" % (shown(p), why)
                      for p, why in found[:5]), ", ..." if len(found) > 5 else "")
    return None


def _check_out_dir(path, force):
    try:
        info = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return _check_parents(path)
    except OSError as exc:
        raise BundleError("%s: %s" % (shown(path), exc.strerror)) from None
    if stat.S_ISLNK(info.st_mode):
        raise BundleError("%s is a symbolic link (to %s): give a directory or a new path"
                          % (shown(path), _link_target(path)))
    if not stat.S_ISDIR(info.st_mode):
        raise BundleError("%s exists and is not a directory" % shown(path))
    if os.path.ismount(path):
        raise BundleError("%s is a mount point: give a new directory inside it" % shown(path))
    try:
        if not os.listdir(path):
            return
    except OSError as exc:
        raise BundleError("%s: %s" % (shown(path), exc.strerror)) from None
    if not force:
        raise BundleError("%s exists and is not empty (use --force to replace a previous bundle)"
                          % shown(path))
    why = _not_a_previous_bundle(path)
    if why:
        raise BundleError("%s is not a previous npu-shim bundle (%s); --force replaces only one"
                          % (shown(path), why))


def _link_target(path):
    try:
        return shown(os.readlink(path))
    except OSError:  # replaced since lstat
        return "?"


def _check_parents(path):
    """A new OUT_DIR: the nearest existing folder above it must be a directory."""
    parent = os.path.dirname(path)
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise BundleError("%s cannot be created: %s is not a directory" % (shown(path),
                                                                           shown(parent)))


def _check_archive(archive, force):
    try:
        info = os.lstat(archive)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise BundleError("%s: %s" % (shown(archive), exc.strerror)) from None
    if not stat.S_ISREG(info.st_mode):
        raise BundleError("%s exists and is not a regular file (%s)" % (
            shown(archive), "a symbolic link" if stat.S_ISLNK(info.st_mode) else
            "a directory" if stat.S_ISDIR(info.st_mode) else "a special file"))
    if not force:
        raise BundleError("%s exists (use --force to replace it)" % shown(archive))


def check_target(out_dir, force=False):
    """(absolute OUT_DIR, what is there now, what is at OUT_DIR.tar.gz now), after refusing --
    with BundleError, one line -- every target a build must not write to or replace."""
    path = _absolute(out_dir)
    refused = _refused_place(path)
    if refused:
        raise BundleError(refused)
    _check_out_dir(path, force)
    _check_archive(path + ".tar.gz", force)
    return path, identity(path), identity(path + ".tar.gz")
