"""Drop-in on a real sglang (0.5.11, and the editable install) the way an Ascend image holds it:
no wrapt in the environment, the shim as a read-only bundle, sglang installed editable.

The release runs in the test bed's base environment (torch, no wrapt) with the release's layers
on PYTHONPATH (dev/shimdev/envs/realsglang.py); ``wrapt=None`` leaves wrapt out entirely.
"""

import json
import os
import re
import shutil
import subprocess
import textwrap

import npu_shim
from shimdev.envs import realsglang
from shimdev.beds.demo_features import DEMO_ENV
from shimdev.beds.expected_states import expected
from test_drop_in import snapshot

RELEASE = "0.5.11"
SIZE = {"SGLANG_ZBAL_LOCAL_MEM_SIZE": "12288", "SIMNPU_FREE_MIB": "60000"}

REPORT = "import json\nfrom shimdev.beds import drop_in_probe\nprint(json.dumps(drop_in_probe.report()))\n"


def _run(argv, env, code, cwd, readonly=None):
    command = argv + ["-c", code]
    if readonly:
        command = ["unshare", "-m", "sh", "-c",
                   "mount --bind {0} {0} && mount -o remount,ro,bind {0} && exec \"$@\"".format(readonly),
                   "sh"] + command
    return subprocess.run(command, env=env, cwd=str(cwd), capture_output=True, text=True, timeout=600)


def _json(proc):
    assert proc.returncode == 0, "exit %d\n%s\n%s" % (proc.returncode, proc.stdout[-3000:], proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _sim(version):
    return "from shimdev import simnpu\nsimnpu.install(release=%r)\n" % version


def test_no_wrapt_each_patch_that_would_apply_fails_in_one_line(tmp_path):
    argv, env = realsglang.release_command(RELEASE, wrapt=None)
    proc = _run(argv, env, _sim(RELEASE) + REPORT, tmp_path)
    out = _json(proc)
    assert out["states"] == {"zbal": "inactive", "mla_weight_release": "failed",
                             "dual_stream_experts": "upstream"}
    assert out["reasons"]["mla_weight_release"].startswith("wrapt is not available: wrapt is not "
                                                          "installed in this image")
    assert out["wrappers"] == [] and out["origin"] is None and out["app_wrapt"] is None
    failed = [line for line in proc.stderr.splitlines()
              if line.startswith("[npu-shim %s " % npu_shim.__version__) and ": failed" in line]
    assert [re.sub(r"^\[[^\]]*\] ", "", line) for line in failed] == [
        "mla_weight_release: failed (%s)" % out["reasons"]["mla_weight_release"]]


def test_no_wrapt_with_a_zbal_size_stops_the_process_with_the_reason(tmp_path):
    argv, env = realsglang.release_command(RELEASE, SIZE, wrapt=None, zbal=True)
    proc = _run(argv, env, _sim(RELEASE) + "import sglang.srt.managers.scheduler\nprint('ran on')", tmp_path)
    assert proc.returncode != 0 and "ran on" not in proc.stdout
    # ZbalError: the ShimError of the zbal patch (framework.Patch.error)
    assert ("ZbalError: npu-shim: zbal was requested but is failed: wrapt is not available: wrapt is "
            "not installed in this image") in proc.stderr


def test_status_without_wrapt_never_says_applied(tmp_path):
    argv, env = realsglang.release_command(RELEASE, SIZE, wrapt=None, zbal=True)
    proc = subprocess.run(argv + ["-m", "npu_shim", "status", "--json"], env=env, cwd=str(tmp_path),
                          capture_output=True, text=True, timeout=120)
    # 3: the zbal size asks for zbal, which cannot apply without wrapt: every process would stop
    assert proc.returncode == 3, proc.stderr
    info = json.loads(proc.stdout)
    assert [p["name"] for p in info["patches"] if p["stops_server"]] == ["zbal"]
    assert info["wrapt"]["source"] == "missing"
    assert {p["name"]: p["state"] for p in info["patches"]} == {
        "zbal": "failed", "mla_weight_release": "failed", "dual_stream_experts": "upstream"}
    assert info["sglang"]["version"] == RELEASE


def test_read_only_bundle_applies_every_applicable_patch_in_parent_and_spawned_child(built_bundle, tmp_path):
    argv, env = realsglang.release_command(RELEASE, dict(SIZE, CHILD_RELEASE=RELEASE), wrapt=None,
                                           zbal=True, shim_root=built_bundle)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    code = _sim(RELEASE) + textwrap.dedent("""
        import json, multiprocessing as mp
        from shimdev.beds import drop_in_probe
        report = drop_in_probe.report()
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        proc = ctx.Process(target=drop_in_probe.spawned_child, args=(queue,))
        proc.start()
        report["child"] = queue.get(timeout=300)
        proc.join()
        print(json.dumps(report))
    """)
    before = snapshot(built_bundle)
    out = _json(_run(argv, env, code, tmp_path, readonly=built_bundle))
    applied = {"zbal": "applied", "mla_weight_release": "applied", "dual_stream_experts": "upstream"}
    assert out["states"] == applied
    assert out["origin"]["source"] == "bundle" and out["origin"]["build"].startswith("cp311-x86_64")
    assert out["app_wrapt"] is None
    assert "sglang.srt.managers.scheduler:Scheduler.__init__" in out["wrappers"]
    assert out["child"] == [applied, "bundle"]
    assert snapshot(built_bundle) == before


def test_image_wrapt_1_14_is_the_one_used(tmp_path):
    argv, env = realsglang.release_command(RELEASE, SIZE, wrapt="1.14.1", zbal=True)
    out = _json(_run(argv, env, _sim(RELEASE) + REPORT, tmp_path))
    assert out["states"] == {"zbal": "applied", "mla_weight_release": "applied",
                             "dual_stream_experts": "upstream"}
    assert out["origin"]["source"] == "image" and out["origin"]["version"] == "1.14.1"
    # the shim's private copy of the image's 1.14.1 has its C extension, and the application's own
    # ``import wrapt`` afterwards still gets the image's wrapt, whole
    assert out["private_c_ext"] is True
    assert out["app_wrapt"] == "1.14.1"


# -- sglang installed editable ---------------------------------------------------------------------

# The image's own sitecustomize, chained by the shim's: the simulated NPU in every process (the
# check process included), as torch_npu would be on an Ascend image.
SIM_SITECUSTOMIZE = "import os\nfrom shimdev import simnpu\nsimnpu.install(release=os.environ['SIM_RELEASE'])\n"


def _on_simulated_npu(env, tmp_path, release):
    image = tmp_path / "image-site"
    image.mkdir()
    (image / "sitecustomize.py").write_text(SIM_SITECUSTOMIZE)
    entries = env["PYTHONPATH"].split(os.pathsep)
    env["PYTHONPATH"] = os.pathsep.join(entries[:1] + [str(image)] + entries[1:])
    env["SIM_RELEASE"] = release
    return env


def _status_and_check(argv, env, cwd):
    status = subprocess.run(argv + ["-m", "npu_shim", "status", "--json"], env=env, cwd=str(cwd),
                            capture_output=True, text=True, timeout=120)
    assert status.returncode == 0, status.stderr
    check = subprocess.run(argv + ["-m", "npu_shim", "check", "--json"], env=env, cwd=str(cwd),
                           capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stdout[-2000:] + check.stderr[-2000:]
    return json.loads(status.stdout), json.loads(check.stdout)


def test_setuptools_editable_install_is_found_by_status_and_check(tmp_path):
    version = realsglang.EDITABLE_VERSION
    release = realsglang.table_release(version)
    argv, env = realsglang.release_command(version, DEMO_ENV, zbal=True)
    status, check = _status_and_check(argv, _on_simulated_npu(env, tmp_path, release), tmp_path)
    assert status["sglang"]["version"] == version and check["sglang"]["version"] == version
    assert status["sglang"]["path"] == check["sglang"]["path"]
    assert status["sglang"]["path"].endswith(os.path.join("src", "sglang"))
    assert {p["name"]: p["state"] for p in status["patches"]} == expected(release)
    assert check["shim_active"] and check["npu"]["npu_available"]
    assert {name: s["state"] for name, s in check["states"].items()} == expected(release)


def test_plain_path_pth_install_with_a_dev_version_is_found_by_status_and_check(tmp_path):
    """sglang as a source tree named by a ``.pth`` line in site-packages, version ``0.0.0.dev0``
    (a checkout without ``.git``)."""
    release = "0.5.11"
    env_info = realsglang.sglang_envs.ensure_release(release, strict=False)
    src = tmp_path / "checkout" / "python"
    shutil.copytree(str(realsglang.sglang_envs.ensure_sources(release) / "sglang"), str(src / "sglang"))
    for name in ("_version.py", "version.py"):
        if (src / "sglang" / name).exists():
            (src / "sglang" / name).unlink()
    (src / "sglang" / "version.py").write_text('__version__ = "0.0.0.dev0"\n')
    venv = tmp_path / "venv"
    subprocess.run([str(env_info.python), "-m", "venv", "--without-pip", str(venv)], check=True,
                   capture_output=True, timeout=120)
    python = str(venv / "bin" / "python")
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    base_site, site = (subprocess.run([py, "-c", purelib], capture_output=True, text=True,
                                      check=True).stdout.strip() for py in (str(env_info.python), python))
    with open(os.path.join(site, "image.pth"), "w") as handle:
        handle.write(base_site + "\n")  # the image's packages (torch, ...)
    with open(os.path.join(site, "sglang-checkout.pth"), "w") as handle:
        handle.write(str(src) + "\n")
    _argv, env = realsglang.release_command(release, DEMO_ENV, zbal=True)
    layer = str(realsglang.sglang_envs.ensure_sglang_layer(release, strict=False))
    env["PYTHONPATH"] = os.pathsep.join(p for p in env["PYTHONPATH"].split(os.pathsep) if p != layer)
    status, check = _status_and_check([python], _on_simulated_npu(env, tmp_path, release), tmp_path)
    assert status["sglang"] == {"path": str(src / "sglang"), "version": "0.0.0.dev0"}
    assert check["sglang"] == {"path": str(src / "sglang"), "version": "0.0.0.dev0"}
    assert {p["name"]: p["state"] for p in status["patches"]} == expected(release)
    assert {name: s["state"] for name, s in check["states"].items()} == expected(release)
