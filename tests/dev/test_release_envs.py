"""The layered release environments (dev/shimdev/envs/sglang_envs.py, dev/shimdev/envs/realsglang.py).

One base venv (torch, the common pins, no wrapt -- a real Ascend image has none), each release's
sglang and its differing pins as thin ``--target`` layers on PYTHONPATH, wrapt as a layer of its
own chosen per run (``wrapt=None``: none at all), any directory first on PYTHONPATH in place of the
repo root (``shim_root``), and the editable install through setuptools' own ``pip install -e``.
"""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path


from shimdev.envs import realsglang
from shimdev.envs import sglang_envs

REPO = Path(__file__).resolve().parents[2]

#: The program a release process runs (its sys.path as ``-c`` has it): dev/shimdev/programs/release_facts.py.
FACTS = "import runpy; runpy.run_module('shimdev.programs.release_facts', run_name='__main__')"


def facts(version, **kw):
    argv, env = realsglang.release_command(version, **kw)
    p = subprocess.run(argv + ["-c", FACTS], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True, timeout=300, cwd="/")
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_base_has_torch_and_no_wrapt(release_venv):
    python = release_venv("0.5.11")
    assert python == sglang_envs.base_python()
    out = facts("0.5.11", wrapt=None)
    assert out["wrapt_spec"] is False and out["wrapt"] is None  # as on a real Ascend image
    assert out["torch"].split("+")[0] == sglang_envs.TORCH_PIN.split("==")[1]
    # the release itself is importable without wrapt, in this process and in its children
    assert out["sglang"] == out["child_sglang"]
    assert out["sglang"].startswith(str(sglang_envs.layered_dir() / "sglang-0.5.11"))
    assert out["sglang_version"] == "0.5.11" and out["transformers"] == "5.6.0"


def test_default_wrapt_layer_and_an_old_wrapt(release_venv):
    release_venv("0.5.11")
    default = facts("0.5.11")
    assert default["wrapt"] == realsglang.WRAPT_DEFAULT == "2.5.2"
    assert default["wrapt_file"].startswith(str(sglang_envs.ensure_wrapt("2.5.2")))
    old = facts("0.5.11", wrapt="1.14.1")
    assert old["wrapt"] == "1.14.1"
    assert old["wrapt_file"].startswith(str(sglang_envs.ensure_wrapt("1.14.1")))
    # order: shim root, dev/ (shimdev), the wrapt layer, then the release's layers
    layers = [str(p) for p in sglang_envs.ensure_release("0.5.11").layers]
    assert old["pythonpath"] == [str(REPO), str(realsglang.DEV), str(sglang_envs.ensure_wrapt("1.14.1"))] \
        + layers


def test_shim_root_replaces_the_repo_root(tmp_path, release_venv):
    release_venv("0.5.11")
    bundle = tmp_path / "bundle"
    shutil.copytree(REPO / "npu_shim", bundle / "npu_shim", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "sitecustomize.py", bundle / "sitecustomize.py")
    out = facts("0.5.11", shim_root=bundle, wrapt=None)
    assert out["pythonpath"][0] == str(bundle) and str(REPO) not in out["pythonpath"]
    assert out["shim_file"] == str(bundle / "npu_shim" / "__init__.py")


def test_release_layers_are_thin_and_shared(release_venv):
    release_venv("0.5.9")
    release_venv("0.5.8")
    a, b = sglang_envs.ensure_release("0.5.9"), sglang_envs.ensure_release("0.5.8")
    assert a.python == b.python == sglang_envs.base_python()  # one base for every release
    assert a.layers[1] == b.layers[1]  # same pins (transformers 4.57.1 ...) -> one dependency layer
    for rel in (a, b):
        sglang_layer, deps_layer = rel.layers
        assert {p.name for p in sglang_layer.iterdir() if not p.name.endswith(".dist-info")} <= {
            "sglang", "bin", "npu-shim-stamp.json"}
        names = {p.name.lower() for p in deps_layer.iterdir()}
        assert "torch" not in names and "wrapt" not in names, names
        assert "transformers" in names
        size = sum(f.stat().st_size for f in deps_layer.rglob("*") if f.is_file())
        assert size < 200 << 20, size  # the base holds torch (~0.9 GB)
    stamp = json.loads((a.layers[1] / "npu-shim-stamp.json").read_text())
    assert "transformers==4.57.1" in stamp["installed"]


def test_editable_install_is_setuptools_own(release_venv):
    version = realsglang.EDITABLE_VERSION
    python = release_venv(version)
    rel = sglang_envs.ensure_release(version)
    assert rel.editable and python == rel.python != sglang_envs.base_python()
    site = next((python.parent.parent / "lib").glob("python3*/site-packages"))
    finders = list(site.glob("__editable___sglang_*_finder.py"))
    pth = list(site.glob("__editable__.sglang-*.pth"))
    assert finders and pth, sorted(p.name for p in site.iterdir())
    assert "install()" in pth[0].read_text()  # the .pth installs the meta-path finder
    assert not (site / "sglang").exists()      # the tree is not copied
    (dist,) = site.glob("sglang-*.dist-info")
    assert dist.name == "sglang-%s.dist-info" % version
    direct = json.loads((dist / "direct_url.json").read_text())
    assert direct["dir_info"] == {"editable": True}
    out = facts(version, wrapt=None)
    assert out["sglang_version"] == version
    assert out["sglang"].endswith("/src/sglang/__init__.py") and out["child_sglang"] == out["sglang"]
    assert out["torch"].split("+")[0] == "2.13.0" and out["wrapt_spec"] is False
