"""The container test bed (dev/shimdev/envs/containers.py) without starting a container: its podman
configuration, when it installs anything, how its images are named, the busybox root file
system.  The images themselves run in tests/test_deploy.py."""

import resource
import subprocess
import tarfile

import pytest

from shimdev.envs import containers


def test_containers_conf_stays_within_the_hard_limits_and_names_runc_and_cgroupfs():
    text = containers.containers_conf_text()
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nproc = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    expect_nofile = 1 << 20 if nofile == resource.RLIM_INFINITY else min(nofile, 1 << 20)
    expect_nproc = containers.NPROC_CAP if nproc == resource.RLIM_INFINITY else min(nproc, containers.NPROC_CAP)
    assert 'default_ulimits = ["nofile=%d:%d", "nproc=%d:%d"]' % (
        expect_nofile, expect_nofile, expect_nproc, expect_nproc) in text
    assert 'runtime = "runc"' in text and 'cgroup_manager = "cgroupfs"' in text


def test_podman_calls_carry_the_test_beds_conf_and_storage(tmp_path):
    podman = containers.Podman(tmp_path / "storage", tmp_path / "containers.conf")
    assert podman.env["CONTAINERS_CONF"] == str(tmp_path / "containers.conf")
    assert podman.argv[:3] == ["podman", "--root", str(tmp_path / "storage")]
    other = containers.Podman(tmp_path / "other", tmp_path / "containers.conf")
    # Run state is per storage: two storages never share one run directory.
    assert podman.argv[4] != other.argv[4] and podman.argv[4].startswith("/run/npu-shim-podman-")


def test_nothing_is_installed_when_every_command_is_there(monkeypatch):
    monkeypatch.setattr(containers, "missing_commands", lambda: [])
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("ran %s" % (a,)))
    containers.install_engine()


def test_a_user_who_cannot_install_is_told_what_is_missing(monkeypatch):
    monkeypatch.setattr(containers, "missing_commands", lambda: ["podman"])
    monkeypatch.setattr(containers.os, "geteuid", lambda: 1000)
    with pytest.raises(containers.EngineError) as caught:
        containers.install_engine()
    assert str(caught.value).startswith("podman missing: the test bed installs podman runc catatonit")
    assert "this user is not root; install them yourself" in str(caught.value)


class FakePodman:
    """Records builds; an image exists once built."""

    def __init__(self):
        self.images, self.built = set(), []

    def image_exists(self, name):
        return name in self.images

    def run(self, *args, **kwargs):
        tag = args[args.index("-t") + 1]
        self.built.append(tag)
        self.images.add(tag)


def test_built_images_are_named_by_their_inputs_and_built_once():
    podman = FakePodman()
    first = containers.ensure_built(podman, "x", "FROM a\n", {"f": "1"})
    assert containers.ensure_built(podman, "x", "FROM a\n", {"f": "1"}) == first
    assert podman.built == [first] and first.startswith("localhost/npu-shim-test/x:")
    changed = containers.ensure_built(podman, "x", "FROM a\n", {"f": "2"})
    based_elsewhere = containers.ensure_built(podman, "x", "FROM b\n", {"f": "1"})
    assert len({first, changed, based_elsewhere}) == 3


def test_busybox_root_holds_the_binary_a_link_per_applet_and_a_root_user(tmp_path):
    binary = tmp_path / "busybox"
    binary.write_bytes(b"\x7fELF")
    out = tmp_path / "rootfs.tar"
    containers.busybox_rootfs(binary, ["busybox", "sh", "tar"], out)
    with tarfile.open(str(out)) as tar:
        members = {m.name: m for m in tar.getmembers()}
        assert sorted(members) == ["bin", "bin/busybox", "bin/sh", "bin/tar", "etc", "etc/group",
                                   "etc/passwd", "root", "tmp"]
        assert members["bin/sh"].issym() and members["bin/sh"].linkname == "busybox"
        assert members["tmp"].mode == 0o1777
        assert tar.extractfile("etc/passwd").read().startswith(b"root:x:0:0:")


def test_the_mirror_is_the_one_apt_uses_for_the_suite(monkeypatch):
    listing = ("bookworm-security http://security.example/debian-security/\n"
               "bookworm http://mirror.example/debian/\n")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, listing, ""))
    assert containers.apt_mirror("bookworm") == "http://mirror.example/debian"
    assert containers.apt_mirror("trixie") == containers.DEFAULT_MIRROR
