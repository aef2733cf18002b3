"""Hostile inputs: the shim answers each with a clear message, a documented exit code
and never a traceback or a signal.  Where a crash is possible the probe runs in a subprocess.

* tampered target sources read by ``python -m npu_shim status`` (syntax error, coding cookie, BOM,
  renamed, changed signature or body, ``.pyc`` only);
* pickling / copying every wrapped target of a real release (``test_every_wrapped_target_...``);
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from npu_shim.core.loading import all_variables
from npu_shim.patches import zbal as zbal_patch
from shimdev.envs import realsglang, sglang_envs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MLA_PRE = "srt/hardware_backend/npu/attention/mla_preprocess.py"


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NPU_SHIM_", "SGLANG_"))}
    env.update(extra)
    return env


def status(site, *args, **env):
    """``python -m npu_shim status`` with ``site`` (holding ``sglang``) on sys.path."""
    return subprocess.run([sys.executable, "-m", "npu_shim", "status"] + list(args), cwd=str(site),
                          env=clean_env(PYTHONPATH=os.pathsep.join([str(site), REPO]), **env),
                          capture_output=True, timeout=60)


def assert_clean_answer(proc, codes):
    out, err = proc.stdout.decode("utf-8", "replace"), proc.stderr.decode("utf-8", "replace")
    assert proc.returncode in codes, (proc.returncode, out[-2000:], err[-2000:])
    assert "Traceback" not in out + err, err[-3000:]
    assert max(len(line) for line in (out + err).splitlines()) <= 400
    return out, err


def _latin1_cookie(text):
    return ("# -*- coding: latin-1 -*-\n# caf\xe9 au lait\n" + text).encode("latin-1", "replace")


def _rename(text):
    return text.replace("def mlaprolog_preprocess_weight(", "def mlaprolog_prepare_weight(").encode()


# name -> (bytes of the new mla_preprocess.py from its text, mla state, words in the reason)
TAMPERED = {
    # Broken inside the function the patch reads: that function cannot be read on its own, the
    # whole module is parsed and says why.  (Broken elsewhere, Python's import says so itself.)
    "syntax error": (lambda t: t.replace("def mlaprolog_preprocess_weight(self)",
                                         "def mlaprolog_preprocess_weight(self").encode(),
                     "unsupported", "cannot parse"),
    "coding cookie": (_latin1_cookie, "applied", "backport of"),
    "utf-8 bom": (lambda t: b"\xef\xbb\xbf" + t.encode(), "applied", "backport of"),
    "bad utf-8": (lambda t: t.encode() + b"\n# \xff\xfe\n", "unsupported", "cannot decode"),
    "null byte": (lambda t: t.replace('"weight_dq": self.q_a_proj_weight,',
                                      '"weight_dq": self.q_a_proj_weight,\x00').encode(),
                  "unsupported", "cannot parse"),
    "renamed": (_rename, "unsupported", "although this sglang has the mlaprolog path"),
    "signature": (lambda t: t.replace("def mlaprolog_preprocess_weight(self)",
                                      "def mlaprolog_preprocess_weight(self, x=None)").encode(),
                  "unsupported", "has signature (x)"),
    "body": (lambda t: t.replace('"weight_dq": self.q_a_proj_weight,',
                                 '"weight_dq": self.qkv_a_proj.weight,').encode(),
             "unsupported", "fingerprint"),
    "pyc only": (None, "unsupported", "not found"),
    "version file": ("_version.py", "applied", "backport of"),  # undecodable: version unknown
}


@pytest.mark.parametrize("case", sorted(TAMPERED))
def test_tampered_target_source_gets_a_one_line_answer(tmp_path, case):
    make, state, words = TAMPERED[case]
    src = os.path.join(str(sglang_envs.ensure_sources("0.5.11")), "sglang")
    shutil.copytree(src, tmp_path / "sglang", ignore=shutil.ignore_patterns("*.so", "*.pyc"))
    path = tmp_path / "sglang" / MLA_PRE
    if make == "_version.py":
        (tmp_path / "sglang" / make).write_bytes(b"__version__ = '\xff'\n")
    elif make is None:
        import py_compile

        py_compile.compile(str(path), cfile=str(path) + "c")
        path.unlink()
    else:
        path.write_bytes(make(path.read_text()))
    proc = status(tmp_path, "--json")
    out, _ = assert_clean_answer(proc, (0,))
    mla = {p["name"]: p for p in json.loads(out)["patches"]}["mla_weight_release"]
    assert mla["state"] == state and words in mla["reason"], mla
    assert len(mla["reason"]) <= 300 and "\n" not in mla["reason"]
    strict = status(tmp_path, NPU_SHIM_STRICT="1")
    assert_clean_answer(strict, (3,) if state == "unsupported" else (0,))


def test_every_wrapped_target_pickles_and_copies_like_the_plain_function():
    """pickle, copy.deepcopy and dill of each wrapper (functions, methods unbound and bound) work
    and give back the wrapper itself or one around the same function; of a function replaced
    outright (``npu_mla_preprocess``), the very same function."""
    out = realsglang.run_program(
        "0.5.9", "wrapper_pickling", zbal=True,
        env={"SGLANG_ZBAL_LOCAL_MEM_SIZE": "4096", "SGLANG_NPU_USE_MULTI_STREAM": "1"})
    assert set(out["states"].values()) == {"applied"}, out["states"]
    results = out["results"]
    for target in ("sglang.srt.managers.scheduler:Scheduler.__init__ ",
                   "sglang.srt.managers.scheduler:Scheduler.__init__ bound",
                   "sglang.srt.utils.common:get_available_gpu_memory ",
                   "sglang.srt.hardware_backend.npu.attention.mla_preprocess:"
                   "NPUFusedMLAPreprocess.mlaprolog_preprocess_weight bound",
                   "sglang.srt.managers.tp_worker:BaseTpWorker.update_weights_from_disk bound"):
        assert target in results, sorted(results)
    replaced = out["replaced"]
    mla = "sglang.srt.hardware_backend.npu.modules.deepseek_v2_attention_mla_npu:npu_mla_preprocess"
    assert replaced[mla] == {"same_object": True, "over_sglang_s": True}, replaced
    assert "sglang.srt.hardware_backend.npu.attention.mla_preprocess:NPUFusedMLAPreprocess.uses_mlaprolog" in replaced
    assert all(isinstance(r, dict) and r["same_object"] for r in replaced.values()), replaced
    for key, result in results.items():
        assert isinstance(result, dict), (key, result)
        assert result["same_function"] and result["still_wrapped"], (key, result)
        if ":" in key and "." not in key.split(":")[1].split()[0]:
            assert result["global_by_name"], (key, result)  # module-level: the very same object


def test_every_log_line_is_one_line_of_at_most_300_characters(caplog):
    from npu_shim.reporting import log

    with caplog.at_level("INFO", logger="npu_shim"):
        log.error("while patching x: " + "source line\n" * 2000)
    (line,) = caplog.messages
    assert len(line) == log.MAX_LINE == 300 and "\n" not in line and line.endswith("...")


# ------------------------------------------------------------------------------------- values

BAD_VALUES = ["", "   ", "2", "yes please", "-1", str(10 ** 30), "１２２８８", "nan", "inf", "0x10",
              b"\xff\xfe", "\x1b[31m1\x1b[0m", "tcp://-:1", "tcp://...:1", "tcp://[:]:1",
              "tcp://999.999.999.999:1", "tcp://host:６７８９", "tcp://host:0", "tcp://host:65536"]


def _accepted(var, value):
    if isinstance(value, bytes) or value.strip() == "":
        return not isinstance(value, bytes)  # empty or blank: the default
    return var.kind == "MiB" and value == "2"


@pytest.mark.parametrize("value", BAD_VALUES, ids=repr)
def test_every_variable_rejects_each_bad_value_in_one_line(tmp_path, value):
    """Every variable set to the same hostile value at once: ``status`` exits 2 (or 5, no sglang
    here, where the value is acceptable for every variable) and names each invalid variable in
    one line."""

    env = {os.fsencode(k): os.fsencode(v) for k, v in clean_env(PYTHONPATH=REPO).items()}
    raw = value if isinstance(value, bytes) else value.encode()
    env.update({var.name.encode(): raw for var in all_variables()})
    proc = subprocess.run([sys.executable, "-m", "npu_shim", "status"], cwd=str(tmp_path), env=env,
                          capture_output=True, timeout=60)
    rejected = [var for var in all_variables() if not _accepted(var, value)]
    out, _ = assert_clean_answer(proc, (2,) if rejected else (5,))  # 5: no sglang here
    for var in all_variables():
        lines = [line for line in out.splitlines() if "INVALID: %s=" % var.name in line]
        assert len(lines) == (var in rejected), (var.name, lines)
        if lines:
            assert lines[0].split()[0] == var.name and "is invalid: expected" in lines[0]
            assert "\x1b" not in lines[0]  # escapes are shown, not sent to the terminal


def test_sizes_and_urls_accept_exactly_the_documented_forms():
    from npu_shim.core import config

    def url(value):
        return zbal_patch.BOOTSTRAP_URL.read({zbal_patch.BOOTSTRAP_URL.name: value})

    for good in ("tcp://10.0.0.1:6789", "tcp://node-1.cluster.local:1", "tcp://[::1]:65535",
                 "tcp://[2001:db8::7]:29500", "tcp://localhost:80"):
        assert url(good) == good
    assert zbal_patch.LOCAL_MEM_SIZE.read({zbal_patch.LOCAL_MEM_SIZE.name: " 12288 "}) == 12288
    assert zbal_patch.LOCAL_MEM_SIZE.read({zbal_patch.LOCAL_MEM_SIZE.name: str(config.MAX_MIB)}) \
        == config.MAX_MIB == 1024 * 1024
    with pytest.raises(config.ConfigError, match="at most 1048576 MiB"):
        zbal_patch.LOCAL_MEM_SIZE.read({zbal_patch.LOCAL_MEM_SIZE.name: str(config.MAX_MIB + 1)})
    for bad in ("tcp://a_b:1", "tcp://-host:1", "tcp://" + "a" * 64 + ":1", "tcp://1.2.3:1",
                "tcp://[::1]:", "tcp://[::1]", "http://host:1", "tcp://host:1:2", "tcp://:1"):
        with pytest.raises(config.ConfigError):
            url(bad)


# ---------------------------------------------------------------------- not on an NPU

def test_real_release_off_the_npu_changes_nothing():
    """A real sglang process on a machine without an NPU (no simulated one installed): every
    patch that needs the NPU is inactive and wraps nothing, whatever is asked for."""
    out = realsglang.run_program("0.5.11", "off_npu", install_sim=False, zbal=True,
                                 env={"SGLANG_ZBAL_LOCAL_MEM_SIZE": "4096", "SGLANG_NPU_USE_MULTI_STREAM": "1"})
    assert out["npu"] is False and "sglang.srt.utils.common" in out["imported"]
    assert out["wrapped"] is False
    for name, (state, reason, targets) in out["states"].items():
        if state == "upstream":
            continue  # 0.5.11 has dual-stream itself: standing down needs no NPU
        assert state == "inactive" and "not running on an NPU" in reason, (name, state, reason)
        assert targets == {}, name
