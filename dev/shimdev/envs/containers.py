"""Test bed: a container engine and the images the deploy recipes run in (tests/test_deploy.py).

* ``ensure_engine()`` -- podman with runc and catatonit (the pause process of pods) and mmdebstrap,
  from apt when one is missing (root on Debian or Ubuntu: the test command's machines); returns a
  ``Podman`` whose every call uses the test bed's own ``containers.conf`` (``CONTAINERS_CONF``,
  never ``/etc``) and storage under ``CACHE/containers/storage``;
* ``ensure_python_image(podman)`` -- Debian bookworm's Essential packages and ``python3``, nothing
  else (no pip, no wrapt), imported from a rootfs tarball mmdebstrap made (cached in
  ``CACHE/containers/rootfs``); ``ensure_busybox_image(podman)`` -- Debian's busybox-static;
* ``ensure_built(podman, name, containerfile, files)`` -- an image built from a Containerfile and
  a small build context, named by the digest of both.

No registry is reachable from the test machines, so every image is local and nothing is pulled.
Everything is content-addressed (the image tag is the digest of what it is made of) and built
under a file lock, as the release environments are (dev/shimdev/envs/sglang_envs.py).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import resource
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

from shimdev.envs import sglang_envs

#: Bump to build every image anew (part of every image's digest).
LAYOUT = 1
#: The Debian release the images come from (the suite of upstream's CANN images differs; what
#: matters here is a real python3 from a distribution, installed by its package manager).
SUITE = "bookworm"
#: What goes into the python image besides Essential: python3 alone.
PYTHON_PACKAGES = ("python3",)
#: Left out of the image, as Debian's slim images leave them out: nothing the recipes read.
PATH_EXCLUDES = ("/usr/share/doc/*", "/usr/share/man/*", "/usr/share/locale/*", "/usr/share/info/*")
#: What apt installs when a command is missing (catatonit: podman's local pause image for pods).
APT_PACKAGES = ("podman", "runc", "catatonit", "mmdebstrap")
#: Commands that must be there afterwards, and where catatonit lives.
NEEDED = ("podman", "runc", "mmdebstrap", "apt-get")
CATATONIT = "/usr/libexec/podman/catatonit"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
IMAGE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: What nproc is capped at in containers (podman's own default is far above a VM's hard limit).
NPROC_CAP = 32768
TIMEOUT_S = 900


class EngineError(RuntimeError):
    """The engine or an image could not be set up; the message says what and how to fix it."""


# -- running commands ---------------------------------------------------------------------------

def _run(argv, what, env=None, timeout=TIMEOUT_S, cwd=None):
    """Run ``argv`` quietly; on failure raise EngineError with its output's tail."""
    try:
        proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                              timeout=timeout, cwd=cwd)
    except FileNotFoundError as exc:
        raise EngineError("%s: %s is not installed" % (what, argv[0])) from exc
    except subprocess.TimeoutExpired as exc:
        raise EngineError("%s: timed out after %ds: %s" % (what, timeout, " ".join(argv))) from exc
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.decode(errors="replace").splitlines()[-30:])
        raise EngineError("%s failed (exit %d): %s\n%s" % (what, proc.returncode, " ".join(argv), tail))
    return proc.stdout.decode(errors="replace")


def digest_of(obj) -> str:
    """A short digest of a JSON-able ``obj``: what names a cached image."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:12]


def _digest_bytes(content):
    return hashlib.sha256(content if isinstance(content, bytes) else content.encode()).hexdigest()


def _containers_dir() -> Path:
    return sglang_envs.cache_dir() / "containers"


# -- the engine -----------------------------------------------------------------------------------

def missing_commands():
    """The commands (and catatonit) this test bed needs that are not installed."""
    missing = [name for name in NEEDED if shutil.which(name) is None]
    if not os.path.exists(CATATONIT):
        missing.append(CATATONIT)
    return missing


def install_engine(log=None):
    """apt-get install APT_PACKAGES when anything is missing; once per machine, never again."""
    missing = missing_commands()
    if not missing:
        return
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        why = "there is no apt-get" if shutil.which("apt-get") is None else "this user is not root"
        raise EngineError("%s missing: the test bed installs %s with apt-get as root (Debian, "
                          "Ubuntu), and here %s; install them yourself"
                          % (", ".join(missing), " ".join(APT_PACKAGES), why))
    with sglang_envs.file_lock("apt-container-engine"):
        if not missing_commands():
            return
        (log or (lambda s: None))("[containers] apt-get install %s" % " ".join(APT_PACKAGES))
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        # dpkg's own lock: another apt on the machine is waited for rather than failed on.
        lock = ["-o", "DPkg::Lock::Timeout=600"]
        _run(["apt-get", *lock, "update", "-q"], "apt-get update", env=env)
        _run(["apt-get", *lock, "install", "-y", "-q", *APT_PACKAGES], "installing the container engine", env=env)
    still = missing_commands()
    if still:
        raise EngineError("apt-get installed %s but %s still missing" % (" ".join(APT_PACKAGES), ", ".join(still)))


def containers_conf_text():
    """What podman needs on these VMs: ulimits within the hard limits (no CAP_SYS_RESOURCE to
    raise them), runc (crun refuses a hybrid cgroup layout), cgroupfs (no systemd as init)."""
    def within(limit, cap):
        hard = resource.getrlimit(limit)[1]
        return cap if hard == resource.RLIM_INFINITY else min(hard, cap)

    nofile = within(resource.RLIMIT_NOFILE, 1 << 20)
    nproc = within(resource.RLIMIT_NPROC, NPROC_CAP)
    return ("# Written by dev/shimdev/envs/containers.py for the test bed's podman; edit that file instead.\n"
            "[containers]\n"
            'default_ulimits = ["nofile=%d:%d", "nproc=%d:%d"]\n'
            "[engine]\n"
            'runtime = "runc"\n'
            'cgroup_manager = "cgroupfs"\n'
            'events_logger = "file"\n' % (nofile, nofile, nproc, nproc))


def _write_if_changed(path: Path, text: str) -> Path:
    if not path.exists() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name("%s.tmp%d" % (path.name, os.getpid()))
        tmp.write_text(text)
        tmp.replace(path)
    return path


class Podman:
    """podman with the test bed's configuration and storage; ``run(*args)`` -> CompletedProcess."""

    def __init__(self, root: Path, conf: Path):
        self.root = root
        self.conf = conf
        # Run state belongs to one boot and one storage: named after the storage, in /run.
        state = Path("/run") / ("npu-shim-podman-%s" % digest_of(str(root)))
        self.argv = ["podman", "--root", str(root), "--runroot", str(state / "run"),
                     "--tmpdir", str(state / "libpod")]
        self.env = dict(os.environ, CONTAINERS_CONF=str(conf))
        self.env.pop("CONTAINERS_STORAGE_CONF", None)

    def run(self, *args, check=True, timeout=300):
        argv = self.argv + [str(a) for a in args]
        proc = subprocess.run(argv, capture_output=True, text=True, env=self.env, timeout=timeout)
        if check and proc.returncode != 0:
            raise EngineError("podman %s failed (exit %d):\n%s" % (
                " ".join(str(a) for a in args), proc.returncode, proc.stderr[-3000:]))
        return proc

    def image_exists(self, name):
        return self.run("image", "exists", name, check=False).returncode == 0



def ensure_engine(log=None) -> Podman:
    """A working podman (installed when missing); ``podman info`` proves it starts."""
    install_engine(log=log)
    conf = _write_if_changed(_containers_dir() / "containers.conf", containers_conf_text())
    podman = Podman(_containers_dir() / "storage", conf)
    podman.run("info", "--format", "{{.Host.OCIRuntime.Name}}")
    return podman


# -- the base images -----------------------------------------------------------------------------

def apt_mirror(suite=SUITE):
    """The Debian mirror apt uses for ``suite`` (its sources), or deb.debian.org."""
    try:
        out = subprocess.run(["apt-get", "indextargets", "--format", "$(RELEASE) $(REPO_URI)"],
                             capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return DEFAULT_MIRROR
    for line in out.splitlines():
        release, _, uri = line.partition(" ")
        if release == suite and uri:
            return uri.rstrip("/")
    return DEFAULT_MIRROR


def python_image_spec():
    return {"layout": LAYOUT, "suite": SUITE, "variant": "essential", "include": list(PYTHON_PACKAGES),
            "exclude": list(PATH_EXCLUDES), "path": IMAGE_PATH}


def _cached_tarball(name, build, log):
    """``CACHE/containers/rootfs/<name>.tar``, made by ``build(tmp_path)`` once, renamed into place."""
    target = _containers_dir() / "rootfs" / ("%s.tar" % name)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name("%s.tmp%d" % (target.name, os.getpid()))
    try:
        (log or (lambda s: None))("[containers] building %s" % target)
        build(tmp)
        tmp.replace(target)
    finally:
        if tmp.exists():
            tmp.unlink()
    return target


def _import(podman, tarball, tag, changes=()):
    args = ["import"]
    for change in changes:
        args += ["--change", change]
    podman.run(*args, tarball, tag, timeout=600)


def _scratch_dir():
    """Where mmdebstrap unpacks and configures: memory when there is room (dpkg syncs every file
    it writes: slow on a disk, free in tmpfs)."""
    shm = "/dev/shm"
    try:
        stat = os.statvfs(shm)
    except OSError:
        return None
    return shm if stat.f_bavail * stat.f_frsize > (2 << 30) else None


def ensure_python_image(podman: Podman, log=None) -> str:
    """``localhost/npu-shim-test/python3:<digest>``: Essential + python3 from Debian, no pip."""
    spec = python_image_spec()
    digest = digest_of(spec)
    tag = "localhost/npu-shim-test/python3:%s" % digest
    if podman.image_exists(tag):
        return tag

    def build(tmp):
        argv = ["mmdebstrap", "--quiet", "--mode=root", "--variant=essential", "--format=tar",
                "--include=%s" % ",".join(PYTHON_PACKAGES)]
        argv += ["--dpkgopt=path-exclude=%s" % path for path in PATH_EXCLUDES]
        argv += [SUITE, str(tmp), apt_mirror()]
        scratch = _scratch_dir()
        _run(argv, "mmdebstrap (the python3 image's root file system)",
             env=dict(os.environ, **({"TMPDIR": scratch} if scratch else {})))

    with sglang_envs.file_lock("container-python3-%s" % digest):
        if not podman.image_exists(tag):
            tarball = _cached_tarball("python3-%s" % digest, build, log)
            _import(podman, tarball, tag, ["ENV PATH=%s" % spec["path"], 'CMD ["python3"]'])
    return tag


def apt_download(package, folder: Path) -> Path:
    """The .deb of ``package`` the host's apt would install, downloaded into ``folder``."""
    argv, what = ["apt-get", "download", package], "apt-get download %s" % package
    try:
        _run(argv, what, cwd=str(folder))
    except EngineError:
        # The host's package lists may name a version its mirror has dropped since.
        _run(["apt-get", "update", "-q"], "apt-get update")
        _run(argv, what, cwd=str(folder))
    (deb,) = folder.glob("%s_*.deb" % package)
    return deb


def busybox_rootfs(busybox: Path, applets, out: Path):
    """A tarball of ``busybox`` as /bin/busybox, a link per applet, /etc/passwd and /tmp."""
    def entry(tar, name, kind=tarfile.DIRTYPE, mode=0o755, data=b"", link=""):
        info = tarfile.TarInfo(name)
        info.type, info.mode, info.size, info.linkname = kind, mode, len(data), link
        tar.addfile(info, io.BytesIO(data) if data else None)

    with tarfile.open(str(out), "w") as tar:
        for folder in ("bin", "etc", "root"):
            entry(tar, folder)
        entry(tar, "tmp", mode=0o1777)
        tar.add(str(busybox), "bin/busybox")
        for applet in applets:
            if applet != "busybox":
                entry(tar, "bin/" + applet, kind=tarfile.SYMTYPE, mode=0o777, link="busybox")
        entry(tar, "etc/passwd", tarfile.REGTYPE, 0o644, b"root:x:0:0:root:/root:/bin/sh\n")
        entry(tar, "etc/group", tarfile.REGTYPE, 0o644, b"root:x:0:\n")


def ensure_busybox_image(podman: Podman, log=None) -> str:
    """``localhost/npu-shim-test/busybox:<digest>``: Debian's busybox-static and nothing else."""
    digest = digest_of({"layout": LAYOUT, "suite": SUITE, "package": "busybox-static"})
    tag = "localhost/npu-shim-test/busybox:%s" % digest

    def build(tmp):
        with tempfile.TemporaryDirectory() as work:
            deb = apt_download("busybox-static", Path(work))
            _run(["dpkg-deb", "-x", str(deb), work + "/x"], "unpacking " + deb.name)
            binary = Path(work) / "x" / "bin" / "busybox"
            applets = _run([str(binary), "--list"], "busybox --list").split()
            busybox_rootfs(binary, applets, tmp)

    if podman.image_exists(tag):
        return tag
    with sglang_envs.file_lock("container-busybox-%s" % digest):
        if not podman.image_exists(tag):
            tarball = _cached_tarball("busybox-%s" % digest, build, log)
            _import(podman, tarball, tag, ["ENV PATH=/bin", 'CMD ["sh"]'])
    return tag


def prepare(log=None):
    """The engine and the base images, ahead of the tests that run them (scripts/run_tests.py
    runs this beside building the release environments, so a cold machine pays for both once).
    Returns the error instead of raising it: those tests fail with it themselves."""
    try:
        podman = ensure_engine(log=log)
        ensure_python_image(podman, log=log)
        ensure_busybox_image(podman, log=log)
    except (EngineError, OSError, subprocess.SubprocessError) as exc:
        return exc
    return None


# -- images built from a Containerfile ------------------------------------------------------------

def ensure_built(podman: Podman, name: str, containerfile: str, files: dict, build_args=None) -> str:
    """``localhost/npu-shim-test/<name>:<digest>`` built from ``containerfile`` with a context of
    ``files`` ({relative path: text or bytes}); the same inputs give the same image, built once."""
    digest = digest_of({"layout": LAYOUT, "containerfile": containerfile, "args": build_args or {},
                        "files": {k: _digest_bytes(v) for k, v in sorted(files.items())}})
    tag = "localhost/npu-shim-test/%s:%s" % (name, digest)
    if podman.image_exists(tag):
        return tag
    with sglang_envs.file_lock("container-%s-%s" % (name, digest)):
        if not podman.image_exists(tag):
            with tempfile.TemporaryDirectory() as context:
                for relative, content in files.items():
                    path = Path(context) / relative
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_bytes(content if isinstance(content, bytes) else content.encode())
                (Path(context) / "Containerfile").write_text(containerfile)
                build(podman, Path(context) / "Containerfile", context, tag, build_args)
    return tag


def build(podman: Podman, containerfile, context, tag, build_args=None):
    """``podman build`` without pulling and without intermediate images left behind."""
    args = ["build", "--pull=never", "--layers=false", "--network=none", "-q", "-f", containerfile, "-t", tag]
    for key, value in sorted((build_args or {}).items()):
        args += ["--build-arg", "%s=%s" % (key, value)]
    podman.run(*args, context, timeout=600)
    return tag
