"""A state directory that root can write to and read from on a node shared with other users.

Processes run as root, and ``/dev/shm`` (or a state directory) may be shared with other users and
hosts: whoever can rename entries in a directory can swap a file root is about to write for a
symlink to anything.  So every directory is opened component by component from ``/``, each with
``O_NOFOLLOW`` relative to the descriptor of its parent, and checked on that descriptor (so nothing
can be swapped in between the check and the use):

* every directory on the way belongs to root or to this user, and is writable by nobody else
  unless it has the sticky bit (``/tmp``, ``/dev/shm``: others cannot rename what is not theirs);
* the state directory itself belongs to this user and is writable by nobody else -- or it is a
  sticky directory others may write to (``install -d -m 1777 DIR``), the one safe way for several
  users to share one: each user's processes then write into their own ``uid-<uid>/`` below it
  (root's, or the shared directory owner's, taken back when another user made it first).
Missing directories are created ``0755``.  A refusal is one ``UnsafeDirectory`` line saying why
and what to do.

Files are created exclusively (``O_EXCL | O_NOFOLLOW``), their mode set through the descriptor,
and renamed into place within the same directory descriptor; reading opens with ``O_NOFOLLOW |
O_NONBLOCK`` (a FIFO cannot block), reads only regular files and at most a given number of bytes.
"""

import errno
import os
import re
import stat

USER_DIR_PREFIX = "uid-"
# O_DIRECTORY: a FIFO put where a directory should be fails at once instead of blocking the open
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_UNSAFE_NAME = re.compile(r"[^A-Za-z0-9._-]")


class UnsafeDirectory(OSError):
    """A state directory the shim will not use (the message says why and what to do)."""


def safe_name(text, limit=64):
    """``text`` as a file name part: letters, digits, ``.``, ``_`` and ``-`` only."""
    return _UNSAFE_NAME.sub("_", str(text))[:limit].lstrip(".") or "_"


def user_dir_name(uid=None):
    return "%s%d" % (USER_DIR_PREFIX, os.geteuid() if uid is None else uid)


def is_shared(st):
    """A sticky directory others may write to: several users' records, one subdirectory each."""
    return bool(st.st_mode & stat.S_ISVTX) and bool(st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def _problem_on_the_way(st, euid):
    if st.st_uid not in (0, euid):
        return "belongs to uid %d (not root, not uid %d)" % (st.st_uid, euid)
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        return "is writable by %s, not sticky" % ("others" if st.st_mode & stat.S_IWOTH else "its group")
    return None


def _problem_as_state_dir(st, euid):
    if st.st_uid != euid:  # its owner could swap the records written there
        return "belongs to uid %d, not uid %d" % (st.st_uid, euid)
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return "is writable by others"
    return None


_ADVICE = "use your own directory, or share one: install -d -m 1777 DIR"


def _open_child(parent_fd, name, path):
    """The directory ``name`` in ``parent_fd``, made ``0755`` when missing; never a symlink."""
    try:
        return os.open(name, DIR_FLAGS | os.O_NOFOLLOW, dir_fd=parent_fd)
    except FileNotFoundError:
        pass
    try:
        os.mkdir(name, 0o755, dir_fd=parent_fd)
    except FileExistsError:
        pass  # made in between by someone else: it is checked like any other
    try:
        return os.open(name, DIR_FLAGS | os.O_NOFOLLOW, dir_fd=parent_fd)
    except OSError as exc:
        raise _refusal(exc, path) from None


def _refusal(exc, path):
    if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
        return UnsafeDirectory(exc.errno, "%s is a symlink or not a directory (not followed)" % path)
    return exc


def open_directory(path):
    """A descriptor of ``path`` opened as this module says, missing directories made, each checked
    as a directory on the way (not yet as a state directory).  Raises UnsafeDirectory or OSError."""
    euid = os.geteuid()
    path = os.path.normpath(path)
    if not os.path.isabs(path):
        raise UnsafeDirectory(errno.EINVAL, "%s is not an absolute path" % path)
    fd = os.open("/", DIR_FLAGS)
    walked = ""
    try:
        for name in [part for part in path.split("/") if part]:
            problem = _problem_on_the_way(os.fstat(fd), euid)
            if problem:
                raise UnsafeDirectory(errno.EPERM, "%s %s; %s" % (walked or "/", problem, _ADVICE))
            walked += "/" + name
            try:
                child = _open_child(fd, name, walked)
            except OSError as exc:
                raise _refusal(exc, walked) from None
            os.close(fd)
            fd = child
        return fd
    except BaseException:
        os.close(fd)
        raise


class _Dir:
    """An open state directory: every operation relative to its descriptor."""

    def __init__(self, fd, path):
        self.fd, self.path = fd, path

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        os.close(self.fd)

    def replace_file(self, name, data, temp_prefix, temp_suffix):
        """Write ``name`` whole and atomically: a new file of ours, mode 0644, renamed over it."""
        temp = "%s%s-%d-%s%s" % (temp_prefix, safe_name(name, 80), os.getpid(), os.urandom(6).hex(),
                                 temp_suffix)
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600, dir_fd=self.fd)
        try:
            try:
                os.fchmod(fd, 0o644)  # readable by an operator who is not root; never by path
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
            os.replace(temp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException:
            try:
                os.unlink(temp, dir_fd=self.fd)
            except OSError:
                pass
            raise

    def sweep(self, suffix, max_age_s):
        """Remove this user's temporary files older than ``max_age_s`` (a killed writer's): every
        dot-file ending ``suffix``, whatever its prefix (today's writers and older ones named them
        differently)."""
        import time

        now = time.time()
        try:
            names = os.listdir(self.fd)
        except OSError:
            return 0
        removed = 0
        for name in names:
            if not (name.startswith(".") and name.endswith(suffix)):
                continue  # ``.npu-shim-*`` today; ``.<host>-<pid>.*.tmp`` up to the 0.2.2 release
            try:
                st = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
                if st.st_uid == os.geteuid() and now - st.st_mtime > max_age_s and \
                        (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
                    os.unlink(name, dir_fd=self.fd)
                    removed += 1
            except OSError:
                continue
        return removed


def _take_back(fd, name, shown):
    """Our ``uid-<uid>/`` in a shared directory, made first by another user (or a symlink or file
    put there), where we are root or own the shared directory (so may rename what others put in
    it): that is renamed aside (``.squatted-...``, which no reader lists) and ours made.  Anyone
    else's is refused as before: otherwise any user could keep root's records from being written
    by making its folder first."""
    found = os.stat(name, dir_fd=fd, follow_symlinks=False)
    if found.st_uid != os.geteuid() or not stat.S_ISDIR(found.st_mode):
        aside = ".squatted-%s-by-uid-%d-%s" % (name, found.st_uid, os.urandom(4).hex())
        os.rename(name, aside, src_dir_fd=fd, dst_dir_fd=fd)
    return _open_child(fd, name, shown)


def open_for_writing(path):
    """The directory this process's records go to (``path``, or its ``uid-<uid>/`` where ``path``
    is shared), created when missing, checked, as a context manager.  Raises UnsafeDirectory."""
    euid = os.geteuid()
    fd = open_directory(path)
    try:
        st = os.fstat(fd)
        if is_shared(st):
            problem = _problem_on_the_way(st, euid)  # its owner could rename our entries in it
            if problem:
                raise UnsafeDirectory(errno.EPERM, "it %s; %s" % (problem, _ADVICE))
            name = user_dir_name(euid)
            shown = os.path.join(path, name)
            may_take_back = euid == 0 or st.st_uid == euid
            try:
                child = _open_child(fd, name, shown)
            except OSError as exc:  # a symlink or a file put where our folder goes
                if not may_take_back or exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise _refusal(exc, shown) from None
                child = _take_back(fd, name, shown)
            else:
                if os.fstat(child).st_uid != euid and may_take_back:
                    os.close(child)
                    child = _take_back(fd, name, shown)
            os.close(fd)
            fd, path, st = child, shown, os.fstat(child)
        problem = _problem_as_state_dir(st, euid)
        if problem:
            where = "its %s/" % os.path.basename(path) if path.endswith(user_dir_name(euid)) else "it"
            raise UnsafeDirectory(errno.EPERM, "%s %s; %s" % (where, problem, _ADVICE))
        return _Dir(fd, path)
    except BaseException:
        os.close(fd)
        raise


def read_regular(dir_fd, name, limit):
    """(bytes, fstat) of a regular file ``name`` in ``dir_fd`` at most ``limit`` bytes long.
    Raises OSError, or ValueError saying why the file is not read (a symlink, a FIFO, a device,
    too large) -- never blocks on it and never reads more than ``limit`` + 1 bytes."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ValueError("a symlink (never followed)") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file (never read)")
        if st.st_size > limit:
            raise ValueError("%d bytes, over the %d a record may have (not read)" % (st.st_size, limit))
        chunks, left = [], limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 16))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > limit:
            raise ValueError("grew past the %d bytes a record may have while read" % limit)
        return data, st
    finally:
        os.close(fd)
