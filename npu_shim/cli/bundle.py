"""``python -m npu_shim bundle OUT_DIR``: one self-contained directory to mount into an image.

An Ascend sglang image has no wrapt, and its mounts are read-only with ``PYTHONDONTWRITEBYTECODE=1``
set, so the bundle brings what the shim needs and is compiled ahead of time:

    OUT_DIR/sitecustomize.py                 the bootstrap (put OUT_DIR first on PYTHONPATH)
    OUT_DIR/npu_shim/                        the package
    OUT_DIR/npu_shim/_vendor/wrapt/<build>/  wrapt per CPython 3.9-3.13 x (x86_64, aarch64), and
                                             py3-none-any (pure Python) as the fallback
    __pycache__/*.pyc                        checked-hash .pyc for every interpreter given
                                             (valid whatever the files' mtimes become)
    OUT_DIR/MANIFEST                         JSON: versions, builds, interpreters, sha256 per file
    OUT_DIR/SHA256SUMS                       the same hashes for ``sha256sum -c``
    OUT_DIR.tar.gz                           the whole directory

Wheels come from PyPI through pip (``pip download --only-binary``); nothing is built from source
(npu_shim/cli/bundle_wheels.py); the .pyc are compiled by each interpreter found
(npu_shim/cli/bundle_pyc.py).

Every target is checked before anything is downloaded or created (npu_shim/cli/bundle_target.py;
what ``check`` verifies of a built bundle: npu_shim/cli/bundle_verify.py).  The bundle is assembled in
a staging directory beside OUT_DIR, then swapped in by renames: a previous bundle is renamed aside
into the staging directory (deleted with it) and renamed back if the swap fails.

The build imports tarfile, shutil, tempfile and the like inside its functions only.
"""

import json
import os
import sys

from npu_shim import _paths
from npu_shim._version import __version__
from npu_shim.cli.bundle_pyc import PYTHONS, compile_pyc, interpreters
from npu_shim.cli.bundle_target import BundleError, check_target, identity
from npu_shim.cli.bundle_verify import sha256, shown
from npu_shim.cli.bundle_wheels import MACHINES, download_wrapt, extract_package

# The npu_shim package being bundled.
_PACKAGE = _paths.PACKAGE_DIR

WRAPT_VERSION = "2.5.2"


# -- building ---------------------------------------------------------------------------------------

def _copy_shim(root):
    """sitecustomize.py and the npu_shim package (sources only) into root."""
    import shutil

    source_package = _PACKAGE
    source_root = os.path.dirname(source_package)
    bootstrap = os.path.join(source_root, "sitecustomize.py")
    if not os.path.isfile(bootstrap):
        raise BundleError("no sitecustomize.py beside %s: bundle from a checkout of npu-shim"
                          % source_package)
    shutil.copy2(bootstrap, root)
    shutil.copytree(source_package, os.path.join(root, "npu_shim"),
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "_vendor"))


def write_manifest(root, wrapt_version, builds, pythons):
    import time

    files = []
    for folder, dirs, names in os.walk(root):
        dirs.sort()
        for name in sorted(names):
            path = os.path.join(folder, name)
            files.append({"path": os.path.relpath(path, root), "size": os.path.getsize(path),
                          "sha256": sha256(path)})
    manifest = {
        "npu_shim": __version__,
        "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "wrapt": {"version": wrapt_version, "builds": sorted(builds)},
        "pyc": ["cpython-%s" % version for _, version in pythons],
        "files": files,
    }
    with open(os.path.join(root, "MANIFEST"), "w") as handle:
        json.dump(manifest, handle, indent=1)
        handle.write("\n")
    with open(os.path.join(root, "SHA256SUMS"), "w") as handle:
        handle.writelines("%s  %s\n" % (f["sha256"], f["path"]) for f in files)
    return manifest


def _make_parents(parent):
    """Create the folders above a new OUT_DIR; the topmost created (to remove on failure) or None."""
    top = None
    folder = parent
    while not os.path.lexists(folder):
        top, folder = folder, os.path.dirname(folder)
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as exc:
        raise BundleError("cannot create %s: %s" % (shown(parent), exc.strerror)) from None
    return top


def _remove_made_parents(parent, top):
    """Remove the folders _make_parents created, where they are still empty."""
    folder = parent
    while top and folder != os.path.dirname(top):
        try:
            os.rmdir(folder)
        except OSError:
            return
        folder = os.path.dirname(folder)


def _swap_in(staging, out_dir, had_dir):
    """Rename the new bundle and its archive into place.  A previous OUT_DIR is first renamed aside
    into staging (deleted with it) and renamed back if either rename fails."""
    root, aside = os.path.join(staging, "bundle"), os.path.join(staging, "previous")
    if had_dir:
        try:
            os.rename(out_dir, aside)
        except OSError as exc:
            raise BundleError("cannot move the previous %s aside: %s"
                              % (shown(out_dir), exc.strerror)) from None
    try:
        os.rename(root, out_dir)
        try:
            os.replace(os.path.join(staging, "bundle.tar.gz"), out_dir + ".tar.gz")
        except OSError:
            os.rename(out_dir, root)
            raise
    except OSError as exc:
        failed = "cannot put the bundle at %s: %s" % (shown(out_dir), exc.strerror)
        if not had_dir:
            raise BundleError(failed) from None
        try:
            os.rename(aside, out_dir)
        except OSError:
            raise BundleError("%s; the previous bundle is kept at %s" % (failed, aside)) from None
        raise BundleError(failed + " (the previous one is back)") from None


def _assemble(staging, name, wrapt_version, pythons, machines, compilers, log):
    """The complete bundle in staging/bundle and its archive in staging/bundle.tar.gz."""
    import tarfile

    root = os.path.join(staging, "bundle")
    os.makedirs(root)
    _copy_shim(root)
    log("downloading wrapt %s for CPython %s on %s, and its pure-Python wheel"
        % (wrapt_version, ", ".join(pythons), ", ".join(machines)))
    wheels = download_wrapt(os.path.join(staging, "wheels"), wrapt_version, pythons, machines)
    vendor = os.path.join(root, "npu_shim", "_vendor", "wrapt")
    for build_name, wheel in sorted(wheels.items()):
        extract_package(wheel, os.path.join(vendor, build_name))
    log("compiling .pyc (checked-hash) with CPython %s" % ", ".join(v for _, v in compilers))
    compile_pyc(root, compilers)
    manifest = write_manifest(root, wrapt_version, wheels, compilers)
    with tarfile.open(os.path.join(staging, "bundle.tar.gz"), "w:gz") as tar:
        tar.add(root, arcname=name)
    return manifest


def _remove_staging(staging, keep):
    import shutil

    if keep is None:
        shutil.rmtree(staging, ignore_errors=True)
        return
    for name in os.listdir(staging):
        if name != keep:
            shutil.rmtree(os.path.join(staging, name), ignore_errors=True)


def build(out_dir, python_paths=(), wrapt_version=WRAPT_VERSION, pythons=PYTHONS,
          machines=MACHINES, force=False, log=print):
    """Build the bundle at ``out_dir`` (and ``out_dir.tar.gz``); returns the manifest.  Every
    refusal comes before anything is downloaded or created (``check_target``)."""
    import tempfile

    from npu_shim.cli import children

    target = check_target(out_dir, force)
    out_dir = target[0]
    compilers = interpreters(python_paths)
    if not compilers:
        raise BundleError("no CPython %s interpreter found to compile .pyc with" % "/".join(PYTHONS))
    parent = os.path.dirname(out_dir)
    made = _make_parents(parent)
    # Staging and the swap go by the parent's real path, fixed now: a link on the way re-pointed
    # during the build must not send half the build elsewhere (it is refused before the swap).
    real_parent = os.path.realpath(parent)
    place = identity(real_parent)
    real_out = os.path.join(real_parent, os.path.basename(out_dir))
    release, swapped = None, False
    try:
        staging = tempfile.mkdtemp(prefix=".npu-shim-bundle-", dir=real_parent)
    except OSError as exc:
        _remove_made_parents(parent, made)
        raise BundleError("cannot create a staging directory in %s: %s"
                          % (shown(parent), exc.strerror)) from None
    try:
        manifest = _assemble(staging, os.path.basename(out_dir), wrapt_version, pythons, machines,
                             compilers, log)
        release = children.hold_signals()
        # The build took a while: OUT_DIR must still lead where it did, and what is there must
        # still be what was checked.
        if os.path.realpath(parent) != real_parent or identity(real_parent) != place:
            raise BundleError("%s now leads elsewhere (a link on the way changed during the build); "
                              "nothing was replaced" % shown(parent))
        if check_target(out_dir, force) != target:
            raise BundleError("%s or its .tar.gz changed during the build; nothing was replaced"
                              % shown(out_dir))
        _swap_in(staging, real_out, target[1] is not None)
        swapped = True
    finally:
        release = release or children.hold_signals()
        # A previous bundle still aside after a failed swap could not be put back: it stays.
        stuck = not swapped and os.path.lexists(os.path.join(staging, "previous"))
        _remove_staging(staging, "previous" if stuck else None)
        if not swapped:
            _remove_made_parents(parent, made)
        release()
    # Kept somewhere the bundle's users cannot write, this digest proves the bundle unchanged
    # without running any of it (check, in a process that ran its sitecustomize, cannot).
    log("bundle: %s (%d files), %s.tar.gz; sha256 of its SHA256SUMS: %s (keep it: `sha256sum "
        "SHA256SUMS` and `sha256sum -c SHA256SUMS` in the bundle prove it unchanged)"
        % (out_dir, len(manifest["files"]), out_dir, sha256(os.path.join(out_dir, "SHA256SUMS"))))
    return manifest


def run(args):
    """The ``bundle`` command with its parsed ``args``; its exit status."""
    from npu_shim.cli.exit_codes import EXIT_PROBLEM
    from npu_shim.reporting.terminal import printable

    try:
        build(args.out_dir, args.python, args.wrapt_version or WRAPT_VERSION,
              machines=tuple(args.platform) or MACHINES, force=args.force,
              log=lambda line: sys.stderr.write("npu-shim bundle: %s\n" % printable(line)))
    except BundleError as exc:
        sys.stderr.write("npu-shim bundle: error: %s\n" % printable(exc))
        return EXIT_PROBLEM
    return 0
