"""``bundle`` on hostile input, through the CLI in a subprocess: targets refused before anything
is downloaded or created, ``--force`` replacing only a previous bundle, SIGTERM during a build.

The builds here bundle the .pyc of one interpreter (this one) and wrapt's x86_64 builds (``FAST``):
what is checked does not depend on how many there are.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from npu_shim import bundle

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
THIS_PYTHON = "%d.%d" % sys.version_info[:2]
FAST = ["--python", sys.executable, "--platform", "x86_64"]


def cli(*args, cwd=REPO, env=None, timeout=600):
    full_env = dict(os.environ, PYTHONPATH=REPO)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "npu_shim"] + [str(a) for a in args], cwd=str(cwd),
                          env=full_env, capture_output=True, text=True, timeout=timeout)


def assert_refused(proc, words):
    """Exit 1 with one error line saying ``words``, before anything was downloaded or built."""
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.startswith("npu-shim bundle: error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert words in proc.stderr, proc.stderr


def listing(folder):
    """Every path under folder, links not followed: (kind, inode, size, mtime) each."""
    found = {}
    for parent, dirs, names in os.walk(str(folder)):
        for name in dirs + names:
            path = os.path.join(parent, name)
            info = os.lstat(path)
            found[os.path.relpath(path, str(folder))] = (info.st_mode, info.st_ino, info.st_size,
                                                         info.st_mtime_ns)
    return found


@pytest.fixture(scope="module")
def small_bundle(tmp_path_factory):
    out = tmp_path_factory.mktemp("small") / "npu-shim"
    proc = cli("bundle", out, *FAST)
    assert proc.returncode == 0, proc.stderr
    return out


def copy_of(small_bundle, dest):
    shutil.copytree(str(small_bundle), str(dest), symlinks=True)
    assert bundle.verify(str(dest)) == []
    return dest


# -- bundle: what is refused, before anything is downloaded or created -----------------------------

@pytest.mark.parametrize("arg, words", [
    ("/", "OUT_DIR / is the root directory"),          # bundle $DEST/ with DEST unset
    ("//", "is the root directory"),
    ("", "OUT_DIR is empty"),                           # bundle "$DEST" with DEST unset
    (".", "is the current directory"),
    ("sub/..", "is the current directory"),
    ("..", "holds the current directory"),
])
def test_bundle_force_refuses_the_root_the_empty_string_and_the_current_directory(
        arg, words, small_bundle, tmp_path):
    """The current directory is a previous bundle here, so only the place itself can refuse it
    (before the fix "/" and "" meant the current directory, which --force deleted)."""
    work = copy_of(small_bundle, tmp_path / "work")
    (work / "sub").mkdir()
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
    assert bundle.verify(str(out)) == []
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
    """One error line, exit 1, nothing created or changed -- and nothing downloaded first (before
    the fix most of these tracebacked, some after a full build or with OUT_DIR already replaced;
    an existing OUT_DIR.tar.gz was overwritten)."""
    out = make(tmp_path / "npu-shim") or tmp_path / "npu-shim"
    before = listing(tmp_path)
    proc = cli("bundle", out, *(["--force"] if force else []), *FAST)
    assert_refused(proc, words.replace("%s", str(tmp_path / "real")))
    assert "downloading" not in proc.stderr
    assert listing(tmp_path) == before


# -- bundle: SIGTERM during the build ---------------------------------------------------------------

# The CLI with pip replaced by a stand-in that writes its pid and waits (bundle._PIP, set in this
# wrapper process only: the seam is a module attribute, never an environment variable).
WRAPPER = """
import sys
from npu_shim import bundle
bundle._PIP = (sys.executable, sys.argv.pop(1))
from npu_shim.__main__ import main
sys.exit(main(sys.argv[1:]))
"""
SLOW_PIP = """
import os, time
with open(os.environ["SLOW_PIP_PID"], "w") as handle:
    handle.write(str(os.getpid()))
time.sleep(300)
"""


def _alive(pid):
    try:
        with open("/proc/%d/stat" % pid) as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_sigterm_during_a_build_kills_pip_and_removes_the_staging_directory(tmp_path):
    slow_pip = tmp_path / "slow_pip.py"
    slow_pip.write_text(SLOW_PIP)
    pid_file, parent = tmp_path / "pip.pid", tmp_path / "target"
    parent.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", WRAPPER, str(slow_pip), "bundle",
                             str(parent / "npu-shim")] + FAST, cwd=REPO,
                            env=dict(os.environ, PYTHONPATH=REPO, SLOW_PIP_PID=str(pid_file)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pip_pid = None
    try:
        deadline = time.monotonic() + 120
        while not pid_file.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pid_file.exists(), "the stand-in pip never ran: %s" % proc.communicate()[1]
        time.sleep(0.2)
        pip_pid = int(pid_file.read_text())
        assert [n for n in os.listdir(str(parent)) if n.startswith(".npu-shim-bundle-")]
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=60)
        assert proc.returncode == 128 + signal.SIGTERM, err
        assert err.splitlines()[-1] == ("npu-shim bundle: stopped by SIGTERM; pip and the staging "
                                        "directory are gone"), err
        assert "Traceback" not in err
        assert os.listdir(str(parent)) == []  # no staging directory, no OUT_DIR
        assert not _alive(pip_pid)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if pip_pid and _alive(pip_pid):
            os.kill(pip_pid, signal.SIGKILL)
