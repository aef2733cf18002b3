"""``python -m npu_shim check`` in fresh interpreters against the minimal sglang tree: what it
reports of a real process, where the shim is not active or wrapt is missing, a bundle whose files
changed, a bundle started from its .pyc; and the zbal API check it shows."""

import json
import os
import shutil
import subprocess

import pytest

from npu_shim.cli import bundle, bundle_verify
from test_bootstrap import tree as bootstrap_tree  # noqa: F401 - a fixture
from test_drop_in import REPO, REPORT, bare_venvs, last_json, run, tree  # noqa: F401 - fixtures


# -- check: the truth from a real process ------------------------------------------------------------

def _check(python, tree, first, env=None, *args):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("NPU_SHIM_", "SGLANG_", "PYTHON"))}
    full_env.update({"PYTHONPATH": os.pathsep.join([str(first), str(tree / "image"), str(tree / "pkgs")]),
                     "CHAIN_MARKER": str(tree / "marker"), "PYTHONDONTWRITEBYTECODE": "1"})
    full_env.update(env or {})
    return subprocess.run([python, "-m", "npu_shim", "check"] + list(args), cwd=str(tree),
                          env=full_env, capture_output=True, text=True, timeout=120)


def test_patch_facts_in_an_image_without_their_packages(monkeypatch):
    """What ``check`` shows for zbal and dual_stream_experts where neither memfabric-zbal nor
    sgl-kernel-npu is installed (this interpreter, less what another test of this worker put on its
    path or imported: the zbal layer, the simulated NPU's stub packages)."""
    import os
    import sys

    from npu_shim.patches import dual_stream_experts, zbal as zbal_patch

    packages = ("zbal", "sgl_kernel_npu")
    monkeypatch.setattr(sys, "path", [p for p in sys.path
                                      if not any(os.path.isdir(os.path.join(p or ".", name)) for name in packages)])
    for name in [m for m in sys.modules if m.split(".")[0] in packages]:
        monkeypatch.delitem(sys.modules, name)

    report = dict(zbal_patch.PATCH.report.check_facts(), **dual_stream_experts.PATCH.report.check_facts())
    assert report["zbal"]["found"] is False and report["kernel"]["ok"] is False
    assert (report["zbal"]["label"], report["kernel"]["label"]) == ("zbal", "sgl_kernel_npu")


def test_check_reports_what_happened_in_a_real_process(bare_venvs, built_bundle, tree):
    proc = _check(bare_venvs("3.11"), tree, built_bundle, None, "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["shim_active"] and report["sitecustomize"] == str(built_bundle / "sitecustomize.py")
    assert report["states"]["demo"]["state"] == "applied"
    assert report["wrapped"] == {"sglang.srt.utils.common:get_npu_memory_capacity": True,
                                 "sglang.srt.utils.common:Scheduler.__init__": True}
    assert report["wrapt"]["source"] == "bundle" and report["wrapt"]["build"] == "cp311-x86_64-glibc2.5"
    assert report["bundle"] == {"is_bundle": True, "ok": True, "problems": [],
                                "text": "%s: files match its MANIFEST" % built_bundle,
                                "checked_by": report["bundle"]["checked_by"],
                                "outside": "cd %s && sha256sum -c --quiet SHA256SUMS" % built_bundle}
    assert report["bundle"]["checked_by"].startswith("this process, after the bundle's own sitecustomize ran")
    assert report["sglang"] == {"path": str(tree / "pkgs" / "sglang"), "version": "0.5.9"}
    # Only the registered patches say something about the image (here: the demo patch, nothing);
    # zbal's and dual_stream_experts' own facts: test_patch_facts_in_an_image_without_their_packages.
    assert report["patch_facts"] == []
    assert report["npu"]["npu_available"] is False
    assert report["seconds"] < 60
    text = _check(bare_venvs("3.11"), tree, built_bundle).stdout
    assert "  wrapt: bundle %s [cp311-x86_64-glibc2.5]\n" % bundle.WRAPT_VERSION in text
    assert "wrapped: sglang.srt.utils.common:get_npu_memory_capacity" in text


def test_check_fails_where_the_shim_is_not_active_or_wrapt_is_missing(bare_venvs, tree):
    proc = _check(bare_venvs("3.11"), tree, REPO, None, "--json")
    report = json.loads(proc.stdout)
    assert proc.returncode == 0  # active, but no wrapt: every patch says so, as it would in a server
    assert report["states"]["demo"]["state"] == "failed" and report["wrapt"]["source"] == "missing"
    assert report["wrapped"] == {}  # nothing could be wrapped
    strict = _check(bare_venvs("3.11"), tree, REPO, {"NPU_SHIM_STRICT": "1"})
    assert strict.returncode == 3
    off = _check(bare_venvs("3.11"), tree, REPO, {"NPU_SHIM_ENABLED": "0"})
    assert off.returncode == 4
    assert "shim active at start-up: NO" in off.stdout


@pytest.mark.parametrize("edited", ["npu_shim/reporting/log.py", "sitecustomize.py"])
def test_check_fails_on_a_bundle_whose_files_changed(edited, bare_venvs, built_bundle, tree, tmp_path):
    """sitecustomize.py too: its .pyc is unchecked-hash, so an edit of it does not run, and check
    is where the operator learns of it."""
    copy = tmp_path / "npu-shim"
    shutil.copytree(str(built_bundle), str(copy))
    with open(str(copy / edited), "a") as handle:
        handle.write("\nraise SystemExit('the edited file ran')\n" if edited == "sitecustomize.py"
                     else "\n# edited in place\n")
    proc = _check(bare_venvs("3.11"), tree, copy)
    assert proc.returncode == 4
    assert "1 files differ from its MANIFEST: %s: changed" % edited in proc.stdout
    assert "the edited file ran" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("how", ["tar -xzf", "cp -r"])
def test_unpacked_or_copied_bundle_starts_from_its_pyc(how, bare_venvs, built_bundle, tree, tmp_path):
    """The .pyc are checked-hash: valid after a tar extraction and after a copy that lost every
    mtime, so no process compiles the shim (and none could write a .pyc on a read-only mount)."""
    dest = tmp_path / "shim"
    dest.mkdir()
    if how == "tar -xzf":
        subprocess.run(["tar", "-xzf", str(built_bundle) + ".tar.gz", "-C", str(dest)], check=True)
        root = dest / built_bundle.name
    else:
        root = dest / "npu-shim"
        subprocess.run(["cp", "-r", str(built_bundle), str(root)], check=True)  # new mtimes
    assert bundle_verify.verify(str(root)) == []
    proc = run(bare_venvs("3.11"), tree, REPORT, root, env={"PYTHONVERBOSE": "1"}, readonly=root)
    out = last_json(proc)
    assert out["state"] == "applied" and out["origin"]["source"] == "bundle" and out["c_ext"]
    def loaded_from_pyc(module):
        folder, name = os.path.split(module)
        pyc = os.path.join(str(root), folder, "__pycache__", name + ".cpython-311.pyc")
        return "code object from '%s'" % pyc in proc.stderr

    for module in ("sitecustomize", "npu_shim/__init__", "npu_shim/runtime/activation",
                   "npu_shim/runtime/wrapt_loader"):
        assert loaded_from_pyc(module), module
    assert "matches %s" % os.path.join(str(root), "sitecustomize.py") in proc.stderr
    # sitecustomize.py is the bootstrap itself: the file is not loaded a second time by its own name.
    assert not loaded_from_pyc("npu_shim/_bootstrap")
    assert "npu_shim/_bootstrap.py" not in proc.stderr


# -- the zbal package check uses ----------------------------------------------------------------------

def test_zbal_api_check_accepts_the_real_wheel_and_names_what_a_package_lacks(tmp_path):
    import zipfile

    from shimdev.envs import realsglang
    from npu_shim.patches import zbal as zbal_patch

    with zipfile.ZipFile(str(realsglang.sglang_envs.ensure_zbal_wheel())) as wheel:
        wheel.extractall(str(tmp_path / "real"), [n for n in wheel.namelist() if n.startswith("zbal/")])
    real = str(tmp_path / "real" / "zbal")
    assert zbal_patch.api_problems(real) == []
    broken = tmp_path / "broken"
    shutil.copytree(real, str(broken))
    init = (broken / "__init__.py").read_text().replace("from .zbal_module import mem_get_info\n", "")
    (broken / "__init__.py").write_text(init)
    module = (broken / "zbal_module.py").read_text().replace("              ip_port: str = \"\"):", "):")
    (broken / "zbal_module.py").write_text(module)
    os.remove(str(broken / "zbal_buffer.py"))
    assert zbal_patch.api_problems(str(broken)) == [
        "__init__.py has no mem_get_info", "zbal_buffer.py unreadable (FileNotFoundError)",
        "zbal_init has no parameter ip_port"]
