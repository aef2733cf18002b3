"""``python -m npu_shim status`` as a pre-launch gate, on the real 0.5.11 source (static: nothing is
imported), run the way an operator runs it: with the server's environment."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from shimdev.envs import realsglang

REPO = str(realsglang.REPO)


@pytest.fixture(scope="module")
def source():
    return str(realsglang.sglang_envs.ensure_sources("0.5.11"))


def status(source, env=None, *args, extra_path=(), before=()):
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("NPU_SHIM_", "SGLANG_"))}
    clean["PYTHONPATH"] = os.pathsep.join(list(before) + [REPO, source] + list(extra_path))
    clean.update(env or {})
    return subprocess.run([sys.executable, "-m", "npu_shim", "status"] + list(args), env=clean,
                          capture_output=True, text=True, timeout=120, cwd=REPO)


def rows(proc):
    return {p["name"]: p for p in json.loads(proc.stdout)["patches"]}


def test_zbal_size_without_memfabric_zbal_is_failed_and_fails_the_gate(source):
    proc = status(source, {"SGLANG_ZBAL_LOCAL_MEM_SIZE": "12288"}, "--json")
    zbal = rows(proc)["zbal"]
    assert zbal["state"] == "failed" and zbal["stops_server"] is True
    assert "'zbal' is not importable: install memfabric-zbal" in zbal["reason"]
    assert proc.returncode == 3
    text = status(source, {"SGLANG_ZBAL_LOCAL_MEM_SIZE": "12288"})
    assert "requested explicitly: every sglang process will stop at import" in text.stdout


def test_zbal_size_with_the_package_present_is_applied(source):
    proc = status(source, {"SGLANG_ZBAL_LOCAL_MEM_SIZE": "12288"}, "--json",
                  extra_path=[str(realsglang.sglang_envs.ensure_zbal_layer())])
    assert rows(proc)["zbal"]["state"] == "applied" and proc.returncode == 0


def test_master_switch_off_makes_every_row_disabled(source):
    proc = status(source, {"NPU_SHIM_ENABLED": "0", "SGLANG_ZBAL_LOCAL_MEM_SIZE": "12288"}, "--json")
    assert {n: (r["state"], r["reason"]) for n, r in rows(proc).items()} == {
        n: ("disabled", "NPU_SHIM_ENABLED=0") for n in ("zbal", "mla_weight_release", "dual_stream_experts")}
    assert proc.returncode == 0


def test_allow_list_turns_on_one_patch_at_a_time(source):
    proc = status(source, {"NPU_SHIM_PATCHES": "mla_weight_release"}, "--json")
    got = {n: (r["state"], r["reason"]) for n, r in rows(proc).items()}
    assert got["zbal"] == ("disabled", "not in NPU_SHIM_PATCHES")
    assert got["dual_stream_experts"] == ("disabled", "not in NPU_SHIM_PATCHES")
    assert got["mla_weight_release"][0] == "applied"
    bad = status(source, {"NPU_SHIM_PATCHES": "mla"})
    assert bad.returncode == 2 and "NPU_SHIM_PATCHES='mla' is invalid" in bad.stdout


def test_mla_row_says_where_memory_is_freed(source):
    reason = rows(status(source, {}, "--json"))["mla_weight_release"]["reason"]
    assert "only where the disaggregation role is prefill (qkv_a) or decode (qkv_a, w_kc)" in reason
    assert "not with LoRA, weight updates or speculative decoding" in reason


def test_switch_named_after_the_patch_and_its_older_name(source):
    for name in ("NPU_SHIM_DUAL_STREAM_EXPERTS", "NPU_SHIM_DUAL_STREAM"):
        proc = status(source, {name: "0"})
        assert proc.returncode == 0
        assert "dual_stream_experts  disabled     %s=0" % name in proc.stdout
    assert "(set as NPU_SHIM_DUAL_STREAM, its older name)" in status(source, {"NPU_SHIM_DUAL_STREAM": "0"}).stdout


def test_a_typo_in_a_shim_variable_is_named_and_fails_the_gate(source):
    proc = status(source, {"NPU_SHIM_ENABLE": "0"})
    assert proc.returncode == 2
    assert ("NPU_SHIM_ENABLE                UNKNOWN: not a variable npu-shim reads (ignored); did you "
            "mean NPU_SHIM_ENABLED?") in proc.stdout


def test_a_sitecustomize_that_shadows_ours_is_named(source, tmp_path):
    (tmp_path / "sitecustomize.py").write_text("")
    proc = status(source, {}, before=[str(tmp_path)])
    line = [line for line in proc.stdout.splitlines() if "active in this interpreter" in line][0]
    assert ("no: another sitecustomize (%s) was loaded first and shadows npu-shim's; put %s before %s "
            "on PYTHONPATH" % (tmp_path / "sitecustomize.py", REPO, tmp_path)) in line


def test_env_lists_every_variable_as_json():
    from npu_shim.core.loading import all_variables

    proc = subprocess.run([sys.executable, "-m", "npu_shim", "env", "--json"], capture_output=True,
                          text=True, timeout=60, cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO))
    got = {v["name"]: v for v in json.loads(proc.stdout)}
    assert list(got) == [v.name for v in all_variables()]
    assert got["NPU_SHIM_DUAL_STREAM_EXPERTS"]["aliases"] == ["NPU_SHIM_DUAL_STREAM"]
    assert got["SGLANG_ZBAL_LOCAL_MEM_SIZE"] == {
        "name": "SGLANG_ZBAL_LOCAL_MEM_SIZE", "kind": "MiB", "default": 0, "aliases": [],
        "doc": all_variables()[[v.name for v in all_variables()].index("SGLANG_ZBAL_LOCAL_MEM_SIZE")].doc}


@pytest.mark.parametrize("flag, words", [
    ("-S", "no: Python was started with -S (no site module, so no sitecustomize runs); a server "
           "started so is not patched"),
    ("-E", "no: Python was started with -E, so PYTHONPATH is ignored; a server started so is not "
           "patched (npu_shim.install() in its code still patches it)"),
])
def test_a_flag_that_stops_sitecustomize_is_named_not_pythonpath(source, flag, words):
    """Before the fix ``python -S -m npu_shim status`` told the user to put on PYTHONPATH what was
    already there.  (-E: npu_shim found by the command's own sys.path, as an install would be.)"""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("NPU_SHIM_", "SGLANG_"))}
    clean["PYTHONPATH"] = os.pathsep.join([REPO, source])
    code = ("import sys; sys.path[:0] = %r; from npu_shim.__main__ import run; sys.exit(run(['status']))"
            % [REPO, source])
    proc = subprocess.run([sys.executable, flag, "-c", code], env=clean, capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert "  active in this interpreter: %s\n" % words in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize("raw", ["+4096", "4_096", "\uff14\uff10\uff19\uff16", "2097152"])
def test_on_a_release_with_zbal_upstream_its_size_is_upstreams_to_read(raw):
    """sglang 0.5.12 reads SGLANG_ZBAL_LOCAL_MEM_SIZE with int(): the shim stands down -- zbal is
    ``upstream``, the gate passes (exit 0), the reason says how the backport would have read it;
    on 0.5.11, which the shim backports to, the same value fails the gate."""
    upstream = str(realsglang.sglang_envs.ensure_sources("0.5.12"))
    proc = status(upstream, {"SGLANG_ZBAL_LOCAL_MEM_SIZE": raw}, "--json")
    zbal = rows(proc)["zbal"]
    assert (proc.returncode, zbal["state"], zbal["stops_server"]) == (0, "upstream", False), proc.stdout
    assert "upstream reads SGLANG_ZBAL_LOCAL_MEM_SIZE itself (to the backport, " in zbal["reason"]
    (var,) = [v for v in json.loads(proc.stdout)["env"] if v["name"] == "SGLANG_ZBAL_LOCAL_MEM_SIZE"]
    assert (var["error"], var["read_by_sglang"]) == (None, True)
    text = status(upstream, {"SGLANG_ZBAL_LOCAL_MEM_SIZE": raw}).stdout
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("SGLANG_ZBAL_LOCAL_MEM_SIZE"))
    assert "INVALID" not in line and line.endswith("%r: read by sglang itself (the patch that reads it is "
                                                    "upstream here)" % raw), line
    backport = status(str(realsglang.sglang_envs.ensure_sources("0.5.11")), {"SGLANG_ZBAL_LOCAL_MEM_SIZE": raw})
    assert backport.returncode == 2, backport.stdout
    assert "SGLANG_ZBAL_LOCAL_MEM_SIZE" in backport.stdout and "INVALID" in backport.stdout


def test_a_variable_of_sglangs_is_judged_while_any_patch_that_reads_it_is_not_upstream():
    from npu_shim.cli import exit_codes
    from npu_shim.core import config

    size = config.mib("SGLANG_X_SIZE", "a size")
    own = config.boolean("NPU_SHIM_X_FORCE", False, "a knob")
    patches = [type("P", (), {"name": name, "reads": reads})
               for name, reads in (("a", (size, own)), ("b", (size,)), ("c", ()))]
    assert exit_codes.stood_down_variables(patches, {"a": "upstream", "b": "upstream", "c": "applied"}) == {
        "SGLANG_X_SIZE"}  # never the shim's own variables
    assert exit_codes.stood_down_variables(patches, {"a": "upstream", "b": "applied"}) == set()
    assert exit_codes.stood_down_variables(patches, {}) == set()
