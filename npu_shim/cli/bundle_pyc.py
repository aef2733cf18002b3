"""The ``.pyc`` a bundle holds (``python -m npu_shim bundle``, npu_shim/cli/bundle.py): the
interpreters to compile them with (those given with ``--python``, else every CPython 3.9-3.13
this machine has) and the compiling, in each interpreter, at every optimisation level.

Imports glob, re, shutil and subprocess inside its functions only."""

import os
import sys

from npu_shim.cli.bundle_target import BundleError
from npu_shim.cli.bundle_verify import shown

PYTHONS = ("3.9", "3.10", "3.11", "3.12", "3.13")


def interpreters(requested):
    """[(path, "3.11")] for the interpreters to compile .pyc with: those requested, else this one,
    every ``python3.9`` .. ``python3.13`` on PATH and every CPython 3.9-3.13 pyenv has."""
    import shutil
    import subprocess

    candidates = list(requested) or [sys.executable] + [
        found for found in (shutil.which("python" + v) for v in PYTHONS) if found] + _pyenv_pythons()
    result, seen = [], set()
    for path in candidates:
        try:
            version, why = _python_version(path)
        except (OSError, subprocess.SubprocessError) as exc:
            version, why = None, "cannot run it: %s" % (getattr(exc, "strerror", None) or exc)
        if version is None:
            if requested:
                raise BundleError("--python %s: %s; the bundle supports CPython %s"
                                  % (shown(path), why, ", ".join(PYTHONS)))
            continue
        if version not in seen:
            seen.add(version)
            result.append((path, version))
    return result


# What an interpreter prints of itself; one line, so that anything else it prints is not taken.
_WHO = "import sys; print('npu-shim-python %d.%d %s' % (sys.version_info[:2] + (sys.implementation.name,)))"


def _python_version(path):
    """("3.11", None) for a CPython 3.9-3.13 at ``path``, or (None, what it is instead): a
    program that is no Python, or prints something else, is told apart from one that is."""
    import re

    from npu_shim.cli import children

    code, out, _err = children.run([path, "-I", "-S", "-c", _WHO], 60)
    found = re.search(r"^npu-shim-python (\d+\.\d+) (\S+)$", out, re.M)
    if code != 0 or not found:
        said = " ".join(out.split())[:60]
        return None, "it is not a Python (it exited %d%s)" % (
            code, ", printing %s" % ascii(said) if said else " and printed nothing")
    version, implementation = found.groups()
    if implementation != "cpython" or version not in PYTHONS:
        return None, "it is %s %s" % (shown(implementation), version)
    return version, None


def _pyenv_pythons():
    """Interpreters pyenv has installed (its shims on PATH run only the selected ones)."""
    import glob

    root = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    return sorted(glob.glob(os.path.join(root, "versions", "3.*", "bin", "python3")))


# Hash-based .pyc stay valid whatever mtimes a copy, a tar or an image layer gives the files.
# sitecustomize's is unchecked: every Python process on the node loads it, and checking means
# reading and hashing its source each time; the bundle is verified as a whole instead (an edited
# sitecustomize.py is "changed" to check, and is not what runs).  The package's are checked: only
# sglang processes load them.
#
# Every optimisation level (.pyc, .opt-1.pyc, .opt-2.pyc): a process started with -O or -OO finds
# its own, so it neither writes one into a writable bundle (which check would then call an extra
# file) nor compiles an edited sitecustomize.py that the plain level would not run.
_COMPILE = """\
import compileall, os, py_compile, re, sys
root = sys.argv[1]
tag = "cp%d%d-" % sys.version_info[:2]
vendor = os.path.join(root, "npu_shim", "_vendor", "wrapt")
levels = [0, 1, 2]
ok = compileall.compile_file(os.path.join(root, "sitecustomize.py"), quiet=2, optimize=levels,
                             invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
skip = re.compile(re.escape(vendor + os.sep) + r"(?!(%s|py3-none-any))" % re.escape(tag))
ok &= compileall.compile_dir(os.path.join(root, "npu_shim"), quiet=2, rx=skip, optimize=levels,
                             invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH)
sys.exit(0 if ok else 1)
"""


def compile_pyc(root, pythons):
    import subprocess

    from npu_shim.cli import children

    for path, version in pythons:
        try:
            code, out, err = children.run([path, "-I", "-c", _COMPILE, root], 300)
        except subprocess.TimeoutExpired:
            code, out, err = None, "", "it did not finish in 300 s"
        if code != 0:
            raise BundleError("compiling .pyc with %s (%s) failed:\n%s%s"
                              % (shown(path), version, out[-2000:], err[-2000:]))
