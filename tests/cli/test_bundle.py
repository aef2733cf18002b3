"""``bundle`` and ``check`` on hostile input, through the CLI in a subprocess: targets refused
before anything is downloaded or created, ``--force`` replacing only a previous bundle, SIGTERM
during a build, a bundle with files added or its MANIFEST damaged, and no sglang at all.

The builds here bundle the .pyc of one interpreter (this one) and wrapt's x86_64 builds (``FAST``):
what is checked does not depend on how many there are.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from npu_shim.cli import bundle, bundle_verify
from test_bootstrap import tree as bootstrap_tree  # noqa: F401 - a fixture
from test_check_image import _check
from test_drop_in import bare_venvs, snapshot, tree  # noqa: F401 - fixtures

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
THIS_PYTHON = "%d.%d" % sys.version_info[:2]
FAST = ["--python", sys.executable, "--platform", "x86_64"]


def cli(*args, cwd=REPO, env=None, timeout=600):
    full_env = dict(os.environ, PYTHONPATH=REPO)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "npu_shim"] + [str(a) for a in args], cwd=str(cwd),
                          env=full_env, capture_output=True, text=True, timeout=timeout)


def assert_refused(proc, words):
    """Exit 4 (a problem, said in one line) with one error line saying ``words``, before anything
    was downloaded or built."""
    assert proc.returncode == 4, proc.stderr
    assert proc.stderr.startswith("npu-shim bundle: error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert words in proc.stderr, proc.stderr


def listing(folder):
    """Every path under folder, links not followed: (kind, inode, size, mtime) each."""
    return snapshot(folder, lambda info: (info.st_mode, info.st_ino, info.st_size, info.st_mtime_ns))


@pytest.fixture(scope="module")
def small_bundle(tmp_path_factory):
    out = tmp_path_factory.mktemp("small") / "npu-shim"
    proc = cli("bundle", out, *FAST)
    assert proc.returncode == 0, proc.stderr
    return out


def copy_of(small_bundle, dest):
    shutil.copytree(str(small_bundle), str(dest), symlinks=True)
    assert bundle_verify.verify(str(dest)) == []
    return dest


# -- bundle: what is refused, before anything is downloaded or created -----------------------------

@pytest.mark.parametrize("arg, words", [
    ("/", "OUT_DIR / is the root directory"),          # bundle $DEST/ with DEST unset
    ("//", "is the root directory"),
    ("", "OUT_DIR is empty"),                           # bundle "$DEST" with DEST unset
    (".", "is the current directory"),
    ("sub/..", "is the current directory"),            # made absolute without looking
    ("..", "holds the current directory"),
])
def test_bundle_force_refuses_the_root_the_empty_string_and_the_current_directory(
        arg, words, small_bundle, tmp_path):
    """The current directory is a previous bundle here, so only the place itself can refuse it
    (before the fix "/" and "" meant the current directory, which --force deleted)."""
    work = copy_of(small_bundle, tmp_path / "work")
    before = listing(tmp_path)
    assert_refused(cli("bundle", arg, "--force", *FAST, cwd=work), words)
    assert listing(tmp_path) == before


def test_bundle_force_refuses_the_home_directory(small_bundle, tmp_path):
    home = copy_of(small_bundle, tmp_path / "home")
    before = listing(tmp_path)
    assert_refused(cli("bundle", home, "--force", *FAST, env={"HOME": str(home)}),
                   "is the home directory")
    assert listing(tmp_path) == before


def test_bundle_force_refuses_the_package_it_bundles_and_what_is_around_or_in_it(tmp_path):
    """On a copy of the sources: were the rule broken, --force would delete them."""
    source = tmp_path / "source"
    shutil.copytree(os.path.join(REPO, "npu_shim"), str(source / "npu_shim"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(os.path.join(REPO, "sitecustomize.py"), str(source / "sitecustomize.py"))
    (tmp_path / "elsewhere").mkdir()
    before = listing(tmp_path)
    for target, words in ((source / "npu_shim", "is the npu_shim package being bundled"),
                          (source, "holds the npu_shim package being bundled"),
                          (source / "npu_shim" / "patches" / "new", "is inside the npu_shim package")):
        assert_refused(cli("bundle", target, "--force", *FAST, cwd=tmp_path / "elsewhere",
                           env={"PYTHONPATH": str(source)}), words)
    assert listing(tmp_path) == before


def _notes(out, small_bundle):
    out.mkdir()
    (out / "notes.txt").write_text("mine")


def _bundle_plus_a_file(out, small_bundle):
    copy_of(small_bundle, out)
    (out / "notes.txt").write_text("mine")


def _bundle_plus_a_folder(out, small_bundle):
    copy_of(small_bundle, out)
    (out / "npu_shim" / "drafts").mkdir()


def _manifest_not_ours(out, small_bundle):
    out.mkdir()
    (out / "MANIFEST").write_text(json.dumps({"files": []}))
    (out / "SHA256SUMS").write_text("")


def _manifest_truncated(out, small_bundle):
    copy_of(small_bundle, out)
    text = (out / "MANIFEST").read_text()
    (out / "MANIFEST").write_text(text[:len(text) // 2])


@pytest.mark.parametrize("make, words", [
    (_notes, "is not a previous npu-shim bundle (it has no MANIFEST)"),
    (_bundle_plus_a_file, "its MANIFEST does not list: notes.txt"),
    (_bundle_plus_a_folder, "its MANIFEST does not list: npu_shim/drafts/"),
    (_manifest_not_ours, "its MANIFEST does not name npu_shim"),
    (_manifest_truncated, "its MANIFEST does not parse"),
])
def test_bundle_force_replaces_nothing_but_a_previous_bundle(make, words, small_bundle, tmp_path):
    out = tmp_path / "out"
    make(out, small_bundle)
    before = listing(tmp_path)
    assert_refused(cli("bundle", out, "--force", *FAST), words)
    assert listing(tmp_path) == before


def test_bundle_force_replaces_a_previous_bundle_and_its_archive(small_bundle, tmp_path):
    out = copy_of(small_bundle, tmp_path / "npu-shim")
    shutil.copy2(str(small_bundle) + ".tar.gz", str(out) + ".tar.gz")
    old = {p: os.lstat(p).st_ino for p in (str(out), str(out) + ".tar.gz")}
    without = cli("bundle", out, *FAST)
    assert_refused(without, "exists and is not empty (use --force")
    proc = cli("bundle", out, "--force", *FAST)
    assert proc.returncode == 0, proc.stderr
    assert all(os.lstat(p).st_ino != inode for p, inode in old.items())
    assert bundle_verify.verify(str(out)) == []
    assert sorted(os.listdir(str(tmp_path))) == ["npu-shim", "npu-shim.tar.gz"]  # no staging left


def _regular_file(out):
    out.write_text("mine")


def _link_to_a_directory(out):
    (out.parent / "real").mkdir()
    out.symlink_to(out.parent / "real")


def _link_to_a_file(out):
    (out.parent / "real").write_text("mine")
    out.symlink_to(out.parent / "real")


def _dangling_link(out):
    out.symlink_to(out.parent / "nowhere")


def _below_a_file(out):
    (out.parent / "real").write_text("mine")
    return out.parent / "real" / "npu-shim"


def _archive_a_directory(out):
    (out.parent / "npu-shim.tar.gz").mkdir()


def _archive_a_link(out):
    (out.parent / "elsewhere.tar.gz").write_text("mine")
    (out.parent / "npu-shim.tar.gz").symlink_to(out.parent / "elsewhere.tar.gz")


def _archive_exists(out):
    (out.parent / "npu-shim.tar.gz").write_text("mine")


@pytest.mark.parametrize("make, force, words", [
    (_regular_file, True, "exists and is not a directory"),
    (_link_to_a_directory, True, "is a symbolic link (to "),
    (_link_to_a_file, False, "is a symbolic link (to "),
    (_dangling_link, False, "is a symbolic link (to "),
    (_below_a_file, False, "cannot be created: %s is not a directory"),
    (_archive_a_directory, True, "npu-shim.tar.gz exists and is not a regular file (a directory)"),
    (_archive_a_link, True, "npu-shim.tar.gz exists and is not a regular file (a symbolic link)"),
    (_archive_exists, False, "npu-shim.tar.gz exists (use --force to replace it)"),
])
def test_bundle_refuses_a_hostile_out_dir_before_building(make, force, words, tmp_path):
    """One error line, exit 4, nothing created or changed -- and nothing downloaded first (before
    the fix most of these tracebacked, some after a full build or with OUT_DIR already replaced;
    an existing OUT_DIR.tar.gz was overwritten)."""
    out = make(tmp_path / "npu-shim") or tmp_path / "npu-shim"
    before = listing(tmp_path)
    proc = cli("bundle", out, *(["--force"] if force else []), *FAST)
    assert_refused(proc, words.replace("%s", str(tmp_path / "real")))
    assert "downloading" not in proc.stderr
    assert listing(tmp_path) == before


# -- bundle: SIGTERM during the build ---------------------------------------------------------------

# The CLI with pip replaced by a stand-in that writes its pid and waits (bundle_wheels._PIP, set in
# this wrapper process only: the seam is a module attribute, never an environment variable).
WRAPPER = """
import sys
from npu_shim.cli import bundle_wheels
bundle_wheels._PIP = (sys.executable, sys.argv.pop(1))
from npu_shim.__main__ import main
sys.exit(main(sys.argv[1:]))
"""
SLOW_PIP = """
import os, time
with open(os.environ["SLOW_PIP_PID"], "w") as handle:
    handle.write(str(os.getpid()))
time.sleep(300)
"""


from test_children import alive as _alive, as_from_a_terminal  # noqa: E402 - shared by the cli tests


# -- check: the bundle is verified first ------------------------------------------------------------

SHADOW = """
import os
with open(os.environ["SHADOW_MARKER"], "a") as handle:
    handle.write(__name__ + "\\n")
"""


def test_check_refuses_a_bundle_with_modules_added_that_shadow_the_standard_library(
        bare_venvs, small_bundle, tree, tmp_path):
    """Before the fix the added tarfile.py ran inside check, which said "files match its MANIFEST"
    and exited 0."""
    copy = copy_of(small_bundle, tmp_path / "npu-shim")
    for name in ("tarfile", "zipfile"):
        (copy / (name + ".py")).write_text(SHADOW)
    marker = tmp_path / "shadowed"  # not "marker": the image sitecustomize writes that one
    proc = _check(bare_venvs(THIS_PYTHON), tree, copy, {"SHADOW_MARKER": str(marker)})
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert not marker.exists(), marker.read_text()
    assert "the check process was not started" in proc.stdout
    assert ("2 files differ from its MANIFEST: tarfile.py: extra (shadows the standard library's "
            "tarfile); zipfile.py: extra (shadows the standard library's zipfile)") in proc.stdout
    report = json.loads(_check(bare_venvs(THIS_PYTHON), tree, copy, {"SHADOW_MARKER": str(marker)},
                               "--json").stdout)
    assert report["started"] is False and report["bundle"]["ok"] is False
    assert not marker.exists()


def _manifest_deleted(root):
    os.remove(str(root / "MANIFEST"))


def _manifest_cut(root):
    text = (root / "MANIFEST").read_text()
    (root / "MANIFEST").write_text(text[:len(text) // 3])


def _manifest_without_files(root):
    manifest = json.loads((root / "MANIFEST").read_text())
    del manifest["files"]
    (root / "MANIFEST").write_text(json.dumps(manifest))


def _manifest_a_fifo(root):
    os.remove(str(root / "MANIFEST"))
    os.mkfifo(str(root / "MANIFEST"))  # opening it to read would wait for a writer forever


@pytest.mark.parametrize("damage, words", [
    (_manifest_deleted, "a damaged bundle: MANIFEST missing"),
    (_manifest_cut, "a damaged bundle: MANIFEST does not parse"),
    (_manifest_without_files, "a damaged bundle: MANIFEST lists no files"),
    (_manifest_a_fifo, "a damaged bundle: MANIFEST not a regular file"),
])
def test_check_fails_on_a_bundle_whose_manifest_is_damaged(damage, words, bare_venvs, small_bundle,
                                                           tree, tmp_path):
    """Before the fix a missing or broken MANIFEST read as "not a bundle" (exit 0) whatever had
    been edited -- and a FIFO in its place hung check."""
    copy = copy_of(small_bundle, tmp_path / "npu-shim")
    with open(str(copy / "npu_shim" / "core" / "config.py"), "a") as handle:
        handle.write("\n# edited in place\n")
    damage(copy)
    proc = _check(bare_venvs(THIS_PYTHON), tree, copy)
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert "  bundle: %s: %s" % (copy, words) in proc.stdout


def test_verify_names_extra_files_folders_and_pyc_and_never_follows_links(small_bundle, tmp_path):
    """The .pyc compiled before the MANIFEST was written are listed; one written later (an
    interpreter without PYTHONDONTWRITEBYTECODE) is extra: a .pyc carries code."""
    copy = copy_of(small_bundle, tmp_path / "npu-shim")
    pycache = copy / "npu_shim" / "__pycache__"
    assert [n for n in os.listdir(str(pycache)) if n.endswith(".pyc")]  # listed, so not extra
    (pycache / "config.cpython-399.pyc").write_bytes(b"code")
    (copy / "npu_shim" / "drafts").mkdir()
    (copy / "npu_shim" / "drafts" / "a.py").write_text("")
    (copy / "json").mkdir()
    os.remove(str(copy / "npu_shim" / "reporting" / "log.py"))
    os.symlink("/etc/passwd", str(copy / "npu_shim" / "reporting" / "log.py"))
    os.mkfifo(str(copy / "npu_shim" / "fifo"))
    assert bundle_verify.verify(str(copy)) == [
        "npu_shim/reporting/log.py: changed",
        "json/: extra (shadows the standard library's json)",
        "npu_shim/__pycache__/config.cpython-399.pyc: extra",
        "npu_shim/drafts/: extra",
        "npu_shim/fifo: extra",
    ]


def test_check_verifies_the_bundle_with_only_modules_already_loaded(bare_venvs, small_bundle,
                                                                    tmp_path):
    """Verifying imports no module a file beside sitecustomize.py could shadow: before the fix,
    ``check`` imported subprocess, and verifying imported tarfile, zipfile, shutil, ..."""
    code = textwrap.dedent("""
        import json, sys
        import npu_shim.__main__
        before = set(sys.modules)
        from npu_shim.cli import check
        facts = check.bundle_facts()
        new = sorted(m for m in set(sys.modules) - before if not m.startswith("npu_shim"))
        print(json.dumps({"new": new, "ok": facts["ok"], "is_bundle": facts["is_bundle"]}))
    """)
    proc = subprocess.run([bare_venvs(THIS_PYTHON), "-c", code], capture_output=True, text=True,
                          cwd=str(tmp_path), env=dict(os.environ, PYTHONPATH=str(small_bundle),
                                                      PYTHONDONTWRITEBYTECODE="1"), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == {"new": [], "ok": True, "is_bundle": True}


# -- check: no sglang --------------------------------------------------------------------------------

def _check_without_sglang(python, first, cwd, *args):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NPU_SHIM_", "SGLANG_", "PYTHON"))}
    env.update({"PYTHONPATH": str(first), "PYTHONDONTWRITEBYTECODE": "1"})
    return subprocess.run([python, "-m", "npu_shim", "check"] + list(args), cwd=str(cwd), env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("shim", ["bundle", "checkout"])
def test_check_exits_5_when_no_sglang_is_importable(shim, bare_venvs, small_bundle, tmp_path):
    """Before the fix every target module read as "absent" and check exited 0."""
    first = small_bundle if shim == "bundle" else REPO
    proc = _check_without_sglang(bare_venvs(THIS_PYTHON), first, tmp_path)
    assert proc.returncode == 5, proc.stdout + proc.stderr
    assert ("  sglang: NOT FOUND: no 'sglang' package is importable with this interpreter and "
            "PYTHONPATH (put the directory that holds it on PYTHONPATH, or install sglang)\n") in proc.stdout
    as_json = _check_without_sglang(bare_venvs(THIS_PYTHON), first, tmp_path, "--json")
    assert as_json.returncode == 5 and json.loads(as_json.stdout)["sglang"]["path"] is None


def test_check_exits_4_when_sglang_is_there_but_fails_to_import(bare_venvs, small_bundle, tree):
    (tree / "pkgs" / "sglang" / "__init__.py").write_text("raise RuntimeError('broken')\n")
    proc = _check(bare_venvs(THIS_PYTHON), tree, small_bundle)
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert "  sglang: not imported (the import failed, below)\n" in proc.stdout
    assert "FAILED: RuntimeError: broken" in proc.stdout


# -- bundle: what --python is given ------------------------------------------------------------------

@pytest.mark.parametrize("program, words", [
    ("#!/bin/sh\nexit 0\n", "it is not a Python (it exited 0 and printed nothing)"),
    ("#!/bin/sh\necho 3.11\n", "it is not a Python (it exited 0, printing '3.11')"),
    ("#!/bin/sh\nprintf '\\377\\376 3.11 cpython\\n'\n",
     "it is not a Python (it exited 0, printing '\\\\xff\\\\xfe 3.11 cpython')"),
    ("#!/bin/sh\necho 'npu-shim-python 3.11 pypy'\n", "it is pypy 3.11"),
    ("#!/bin/sh\necho 'npu-shim-python 2.7 cpython'\n", "it is cpython 2.7"),
])
def test_bundle_python_that_is_no_cpython_is_refused_in_one_line(program, words, tmp_path):
    """Before the fix: IndexError and UnicodeDecodeError tracebacks."""
    fake = tmp_path / "python"
    fake.write_text(program)
    fake.chmod(0o755)
    proc = cli("bundle", tmp_path / "out", "--python", fake)
    assert_refused(proc, "--python %s: %s" % (fake, words))
    assert not (tmp_path / "out").exists()
    assert_refused(cli("bundle", tmp_path / "out", "--python", "/bin/true"), "it is not a Python")


# -- bundle: a link on the way to OUT_DIR re-pointed during the build ---------------------------------

def _fake_wheel(folder):
    import zipfile

    wheel = folder / "wrapt-0-py3-none-any.whl"
    with zipfile.ZipFile(str(wheel), "w") as archive:
        archive.writestr("wrapt/__init__.py", "")
    return str(wheel)


def test_a_parent_link_re_pointed_during_the_build_replaces_nothing(monkeypatch, tmp_path):
    """``OUT_DIR`` below a link re-pointed while pip runs: before the fix the staging directory
    was addressed through the link, so the rest of the build went to the new target -- a bundle
    without sitecustomize.py or npu_shim, a MANIFEST vouching for it, exit 0 -- and the staging
    directory stayed in the old one."""
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    new.mkdir()
    link = tmp_path / "link"
    link.symlink_to(old)
    wheels = tmp_path / "wheels"
    wheels.mkdir()

    def download(workdir, version, pythons, machines):
        link.unlink()
        link.symlink_to(new)
        os.makedirs(workdir)
        return {"py3-none-any": _fake_wheel(wheels)}

    monkeypatch.setattr(bundle, "download_wrapt", download)
    with pytest.raises(bundle.BundleError) as raised:
        bundle.build(str(link / "npu-shim"), [sys.executable], log=lambda line: None)
    assert "now leads elsewhere (a link on the way changed during the build); nothing was replaced" in str(raised.value)
    assert os.listdir(str(old)) == [] and os.listdir(str(new)) == []


def test_a_bundle_below_a_link_is_built_in_its_real_place(monkeypatch, tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    monkeypatch.setattr(bundle, "download_wrapt", lambda workdir, *a: (os.makedirs(workdir), {
        "py3-none-any": _fake_wheel(tmp_path)})[1])
    lines = []
    manifest = bundle.build(str(tmp_path / "link" / "npu-shim"), [sys.executable], log=lines.append)
    assert sorted(os.listdir(str(tmp_path / "real"))) == ["npu-shim", "npu-shim.tar.gz"]
    assert bundle_verify.verify(str(tmp_path / "real" / "npu-shim")) == []
    paths = {entry["path"] for entry in manifest["files"]}
    assert {"sitecustomize.py", "npu_shim/__init__.py"} <= paths
    # every optimisation level, so that -O and -OO find theirs (below)
    tag = sys.implementation.cache_tag
    assert {"__pycache__/sitecustomize.%s%s.pyc" % (tag, opt) for opt in ("", ".opt-1", ".opt-2")} <= paths
    digest = bundle_verify.sha256(str(tmp_path / "real" / "npu-shim" / "SHA256SUMS"))
    assert lines[-1].endswith("sha256 of its SHA256SUMS: %s (keep it: `sha256sum SHA256SUMS` and "
                              "`sha256sum -c SHA256SUMS` in the bundle prove it unchanged)" % digest)


# -- bundle: SIGHUP, and a stop signal while pip starts --------------------------------------------

def _stopped_during_pip(tmp_path, send, wrapper=WRAPPER):
    slow_pip = tmp_path / "slow_pip.py"
    slow_pip.write_text(SLOW_PIP)
    pid_file, parent = tmp_path / "pip.pid", tmp_path / "target"
    parent.mkdir()
    proc = subprocess.Popen(as_from_a_terminal([sys.executable, "-c", wrapper, str(slow_pip), "bundle",
                                                str(parent / "npu-shim")] + FAST), cwd=REPO,
                            env=dict(os.environ, PYTHONPATH=REPO, SLOW_PIP_PID=str(pid_file)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not pid_file.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pid_file.exists(), "the stand-in pip never ran: %s" % proc.communicate()[1]
        time.sleep(0.2)
        staged = [n for n in os.listdir(str(parent)) if n.startswith(".npu-shim-bundle-")]
        if send:
            proc.send_signal(send)
        _out, err = proc.communicate(timeout=60)
        return proc.returncode, err, int(pid_file.read_text()), parent, staged
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("sent", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_stop_signal_during_a_build_kills_pip_and_removes_the_staging_directory(tmp_path, sent):
    """SIGHUP is a closed ssh session: before the fix its default action ended the build where it
    stood, the staging directory left behind."""
    code, err, pip_pid, parent, staged = _stopped_during_pip(tmp_path, sent)
    try:
        assert staged, "the signal came before the staging directory existed"
        assert code == 128 + sent, err
        assert err.splitlines()[-1] == ("npu-shim bundle: stopped by %s; pip and the staging "
                                        "directory are gone" % signal.Signals(sent).name), err
        assert "Traceback" not in err
        assert os.listdir(str(parent)) == [] and not _alive(pip_pid)  # no staging, no OUT_DIR
    finally:
        if _alive(pip_pid):
            os.kill(pip_pid, signal.SIGKILL)


# The CLI with SIGTERM sent to itself from inside Popen's constructor, once the child exists: the
# moment at which, before the fix, the handler raised before the caller had the child to kill.
WRAPPER_SIGNAL_IN_POPEN = WRAPPER.replace("from npu_shim.__main__ import main", """
import os, signal, subprocess, time
real_init = subprocess.Popen.__init__
def init(self, *args, **kwargs):
    real_init(self, *args, **kwargs)
    if "download" in args[0]:  # pip's Popen, once the stand-in runs
        while not os.path.exists(os.environ["SLOW_PIP_PID"]):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)
subprocess.Popen.__init__ = init
from npu_shim.__main__ import main""")


def test_sigterm_while_pip_is_being_started_kills_it(tmp_path):
    """Before the fix ``Popen``'s constructor raised: pip orphaned, the staging directory left,
    while the CLI said both were gone."""
    code, err, pip_pid, parent, _ = _stopped_during_pip(tmp_path, None, WRAPPER_SIGNAL_IN_POPEN)
    try:
        assert code == 128 + signal.SIGTERM, err
        assert "Traceback" not in err
        assert os.listdir(str(parent)) == [] and not _alive(pip_pid)
    finally:
        if _alive(pip_pid):
            os.kill(pip_pid, signal.SIGKILL)


# -- check under -O / -OO, and a replaced sitecustomize .pyc ---------------------------------------

def _check_cli(copy, tree, *flags, env=None):
    """``check`` with the bundle first on PYTHONPATH, .pyc writing allowed (the bundle is writable)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("NPU_SHIM_", "SGLANG_", "PYTHON"))}
    full_env.update({"PYTHONPATH": os.pathsep.join([str(copy), str(tree / "image"), str(tree / "pkgs")]),
                     "CHAIN_MARKER": str(tree / "marker")})
    full_env.update(env or {})
    return subprocess.run([sys.executable] + list(flags) + ["-m", "npu_shim", "check", "--json"],
                          cwd=str(tree), env=full_env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("flag", ["-O", "-OO"])
def test_check_under_O_writes_nothing_into_a_writable_bundle(flag, small_bundle, tree, tmp_path):  # noqa: N802 - Python's -O flag
    """Before the fix ``python -O -m npu_shim check`` wrote .opt-1.pyc files into the bundle, and
    from then on every check and selftest refused it as tampered (extra files)."""
    copy = copy_of(small_bundle, tmp_path / "npu-shim")
    for _attempt in range(2):
        proc = _check_cli(copy, tree, flag)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        report = json.loads(proc.stdout)
        assert report["bundle"]["ok"] and report["shim_active"], report["bundle"]
    assert bundle_verify.verify(str(copy)) == []


EDITED = "import os\nopen(os.environ['EDIT_MARKER'], 'a').write('edited sitecustomize.py ran\\n')\n"


@pytest.mark.parametrize("flag", [None, "-O", "-OO"])
def test_an_edited_sitecustomize_does_not_run_under_any_optimisation_level(flag, small_bundle, tmp_path):
    """The bundle's sitecustomize .pyc is unchecked-hash at every level: before the fix -O and -OO
    found no .pyc of theirs and compiled the edited source, which then ran."""
    copy = copy_of(small_bundle, tmp_path / "npu-shim")
    (copy / "sitecustomize.py").write_text(EDITED)
    marker = tmp_path / "edited"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NPU_SHIM_", "PYTHON"))}
    env.update(PYTHONPATH=str(copy), EDIT_MARKER=str(marker), PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.run([sys.executable] + ([flag] if flag else []) + ["-c", "import sitecustomize"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert not marker.exists()


# A sitecustomize whose .pyc makes any reading of the bundle in its process say "match".
LYING_SITECUSTOMIZE = """
from npu_shim.cli import bundle_verify
bundle_verify.verify = lambda root: []
"""


def test_a_replaced_sitecustomize_pyc_is_named_as_what_check_cannot_prove(small_bundle, tree, tmp_path):
    """A replaced ``__pycache__/sitecustomize.*.pyc`` runs inside check before it reads the bundle
    and can make that reading say "files match its MANIFEST": check now says which process read
    the bundle and gives the proof that runs none of it, which fails here."""
    import py_compile

    copy = copy_of(small_bundle, tmp_path / "npu-shim")
    source = tmp_path / "lying.py"
    source.write_text(LYING_SITECUSTOMIZE)
    py_compile.compile(str(source),
                       cfile=str(copy / "__pycache__" / ("sitecustomize.%s.pyc" % sys.implementation.cache_tag)),
                       invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    report = json.loads(_check_cli(copy, tree, env={"PYTHONDONTWRITEBYTECODE": "1"}).stdout)
    assert report["bundle"]["text"].endswith("files match its MANIFEST")  # the lie, in this process
    assert report["bundle"]["checked_by"].startswith("this process, after the bundle's own "
                                                     "sitecustomize ran in it: it proves the files "
                                                     "intact only if that code is")
    assert report["bundle"]["outside"] == "cd %s && sha256sum -c --quiet SHA256SUMS" % copy
    outside = subprocess.run(["sha256sum", "-c", "--quiet", "SHA256SUMS"], cwd=str(copy),
                             capture_output=True, text=True)
    assert outside.returncode == 1 and "sitecustomize.%s.pyc: FAILED" % sys.implementation.cache_tag in outside.stdout
    # Read by a process that ran none of the bundle's code, the same bundle is "changed".
    changed = "__pycache__/sitecustomize.%s.pyc: changed" % sys.implementation.cache_tag
    assert bundle_verify.verify(str(copy)) == [changed]


# -- property: whatever a MANIFEST holds -------------------------------------------------------------

import tempfile  # noqa: E402 - the property tests' imports, beside them

from hypothesis import given, strategies as st  # noqa: E402 - the property tests' imports, beside them

PATHS = st.one_of(st.text(max_size=20), st.sampled_from(["sitecustomize.py", "../x", "/etc/passwd", "a/../b",
                                                        "npu_shim/__init__.py", "a\0b", "\udcff", ""]))
ENTRY = st.one_of(st.fixed_dictionaries({"path": PATHS, "size": st.integers(-5, 1 << 70),
                                         "sha256": st.text(max_size=64)}),
                  st.dictionaries(st.text(max_size=8), st.one_of(st.none(), st.integers(), st.text(max_size=8))))
MANIFESTS = st.one_of(
    st.binary(max_size=300),
    st.builds(lambda files, name: json.dumps({"npu_shim": name, "files": files}).encode("utf-8", "surrogatepass"),
              st.one_of(st.lists(ENTRY, max_size=5), st.none(), st.text(max_size=5)),
              st.one_of(st.text(max_size=8), st.none(), st.integers())),
)


@given(manifest=MANIFESTS)
def test_any_manifest_is_read_or_refused_in_one_line(manifest):
    """``check``'s first step on a bundle: a MANIFEST of any bytes is read, or refused with one
    reason; verifying against it lists problems, one line each -- never an exception."""
    with tempfile.TemporaryDirectory() as root:
        with open(os.path.join(root, "sitecustomize.py"), "w") as handle:
            handle.write("")
        os.mkdir(os.path.join(root, "npu_shim"))
        with open(os.path.join(root, "MANIFEST"), "wb") as handle:
            handle.write(manifest)
        parsed, why = bundle_verify.read_manifest(root)
        assert (parsed is None) != (why is None)
        problems = bundle_verify.verify(root)
        assert isinstance(problems, list) and problems == [p for p in problems if isinstance(p, str)]
        for problem in problems:
            assert "\n" not in problem
            printable(problem).encode("utf-8")
        if parsed is None:
            assert problems == ["MANIFEST: %s" % why]


from npu_shim.reporting.terminal import printable  # noqa: E402 - the property tests' imports, beside them
