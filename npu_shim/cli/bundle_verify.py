"""Reading a built bundle and checking it against its MANIFEST (``python -m npu_shim check`` runs
``verify`` before it starts its child; the build writes the MANIFEST, npu_shim/cli/bundle.py).

Only modules every npu_shim command has loaded already are imported here: a file beside
``sitecustomize.py`` named like a module imported only here would run in ``check``'s process
before the bundle it came with was verified.
"""

import hashlib
import json
import os
import stat
import sys

MANIFEST_MAX_BYTES = 16 << 20
# Written beside the listed files, so never listed themselves.
OWN_FILES = ("MANIFEST", "SHA256SUMS")


def shown(path):
    """A path as one line of a message: control characters and undecodable bytes escaped."""
    return path if path.isprintable() else ascii(path)


def _open_regular(path):
    """A binary handle on a regular file, never through a link, never blocking on a FIFO."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError("not a regular file")
    return os.fdopen(fd, "rb")


def sha256(path):
    digest = hashlib.sha256()
    with _open_regular(path) as handle:
        for block in iter(lambda: handle.read(1 << 16), b""):
            digest.update(block)
    return digest.hexdigest()


def _listed_path_problem(path):
    """Why a MANIFEST path cannot be one of the bundle's files (absolute, '..', ...), or None."""
    if not isinstance(path, str) or not path or "\0" in path:
        return "a path that is not a file name"
    if os.path.isabs(path) or os.path.normpath(path) != path or path.split(os.sep)[0] == "..":
        return "%s is not a plain path inside the bundle" % shown(path)
    return None


def _manifest_problem(manifest):
    """Why parsed JSON is not one of our MANIFESTs, or None."""
    if not isinstance(manifest, dict) or not isinstance(manifest.get("npu_shim"), str):
        return "does not name npu_shim"
    files = manifest.get("files")
    if not isinstance(files, list):
        return "lists no files"
    for entry in files:
        if not (isinstance(entry, dict) and isinstance(entry.get("size"), int)
                and isinstance(entry.get("sha256"), str)):
            return "has an entry without path, size and sha256"
        problem = _listed_path_problem(entry.get("path"))
        if problem:
            return "lists " + problem
    return None


def read_manifest(root):
    """(the MANIFEST of the bundle at root, None), or (None, why not): "missing" when there is none."""
    path = os.path.join(root, "MANIFEST")
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None, "missing"
    except OSError as exc:
        return None, "unreadable (%s)" % exc.strerror
    if not stat.S_ISREG(info.st_mode):
        return None, "not a regular file"
    if info.st_size > MANIFEST_MAX_BYTES:
        return None, "too large to be one of ours"
    try:
        with _open_regular(path) as handle:
            manifest = json.loads(handle.read(MANIFEST_MAX_BYTES + 1).decode("utf-8"))
    except OSError as exc:
        return None, "unreadable (%s)" % (exc.strerror or exc)
    except (ValueError, RecursionError) as exc:  # truncated, edited, not JSON, nested too deep
        return None, "does not parse (%s)" % " ".join(str(exc).split())[:120]
    problem = _manifest_problem(manifest)
    return (manifest, None) if problem is None else (None, problem)


def _looks_like_bundle(root):
    """Whether a directory without a MANIFEST was a bundle: only a bundle has these."""
    return (os.path.lexists(os.path.join(root, "SHA256SUMS"))
            or os.path.lexists(os.path.join(root, "npu_shim", "_vendor")))


def unlisted(root, manifest):
    """[(path, why)] for what is under root but not in its MANIFEST, sorted: "extra" for a file,
    link or folder it does not list (a folder holding no listed file as "dir/", its contents not
    named), "a mount point" and "unreadable" for folders it cannot vouch for.  MANIFEST and
    SHA256SUMS are not listed in themselves; links are entries, never followed."""
    listed = {entry["path"] for entry in manifest["files"]}
    folders = {""}
    for path in listed:
        while path:
            path = os.path.dirname(path)
            folders.add(path)
    device = os.lstat(root).st_dev
    found, pending = [], [""]
    while pending:
        folder = pending.pop()
        try:
            entries = list(os.scandir(os.path.join(root, folder)))
        except OSError as exc:
            found.append((folder + os.sep, "unreadable (%s)" % exc.strerror))
            continue
        for entry in entries:
            path = os.path.join(folder, entry.name)
            if entry.is_dir(follow_symlinks=False):
                if path not in folders:
                    found.append((path + os.sep, "extra"))
                elif _device(entry) != device:
                    found.append((path + os.sep, "a mount point"))
                else:
                    pending.append(path)
            elif path not in listed and not (not folder and entry.name in OWN_FILES):
                found.append((path, "extra"))
    return sorted(found)


def _device(entry):
    try:
        return entry.stat(follow_symlinks=False).st_dev
    except OSError:  # gone since it was listed: not the folder that was checked
        return None


def _stdlib_names():
    names = getattr(sys, "stdlib_module_names", None)  # absent on the oldest Python supported
    if names is not None:
        return names
    found = set(sys.builtin_module_names)
    lib = os.path.dirname(os.__file__)
    for folder in (lib, os.path.join(lib, "lib-dynload")):
        try:
            found.update(name.split(".")[0] for name in os.listdir(folder))
        except OSError:
            pass
    return found


def _shadows(path):
    """The standard-library module an extra entry at the bundle's top shadows, or None: the
    bundle comes first on PYTHONPATH, so ``tarfile.py`` there is what ``import tarfile`` runs."""
    if os.sep in path.rstrip(os.sep):
        return None
    name = path.rstrip(os.sep).split(".")[0]
    # A folder (a package), a link (maybe to one), a module file.
    importable = path.endswith((os.sep, ".py", ".pyc", ".so")) or "." not in path
    return name if importable and name in _stdlib_names() else None


def _describe_unlisted(path, why):
    shadowed = _shadows(path) if why == "extra" else None
    return "%s: %s%s" % (shown(path), why, " (shadows the standard library's %s)" % shadowed
                                            if shadowed else "")


def _listed_file_problem(root, entry):
    path = os.path.join(root, entry["path"])
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return "%s: missing" % shown(entry["path"])
    except OSError as exc:
        return "%s: unreadable (%s)" % (shown(entry["path"]), exc.strerror)
    if not stat.S_ISREG(info.st_mode) or info.st_size != entry["size"]:
        return "%s: changed" % shown(entry["path"])
    try:
        same = sha256(path) == entry["sha256"]
    except OSError:
        same = False  # swapped for something else since lstat
    return None if same else "%s: changed" % shown(entry["path"])


def verify(root):
    """How a bundle differs from its MANIFEST -- "PATH: missing", "PATH: changed", "PATH: extra"
    -- ([] when intact); ["MANIFEST: missing"] (or what is wrong with it) for a directory that
    was a bundle and lost its MANIFEST, or whose MANIFEST is broken; None if it is no bundle."""
    manifest, problem = read_manifest(root)
    if manifest is None:
        if problem == "missing" and not _looks_like_bundle(root):
            return None
        return ["MANIFEST: %s" % problem]
    problems = [_listed_file_problem(root, entry) for entry in manifest["files"]]
    problems = [p for p in problems if p]
    return problems + [_describe_unlisted(path, why) for path, why in unlisted(root, manifest)]
