"""zbal backport inside the real sglang releases (their venvs, simulated NPU, memfabric-zbal's own
Python layer over its simulated native module).

0.5.9 and 0.5.11 (backported): one subprocess each drives the real wrapped objects --
``Scheduler.__init__`` with its body replaced by a recording stub (the real one needs a model and
ports), the *real* ``ModelRunner.initialize`` body on a runner whose heavy steps (load_model,
init_memory_pool, ...) are stubs that take simulated device memory, the real memory queries, the real
DeepEP module and backend map -- then re-decides in the same process (uninstall/install) for the
"off" and bad-setting cases.  zbal missing gets a fresh process (the error must come at import).
0.5.19 and 0.5.23 (upstream): the patch reports ``upstream`` and nothing is wrapped.  The programs
the processes run: dev/shimdev/programs/zbal_backport.py, zbal_missing.py, zbal_upstream.py.
"""
from __future__ import annotations

import pytest

from shimdev.envs import realsglang

ENV = {"SGLANG_ZBAL_LOCAL_MEM_SIZE": "61440", "SGLANG_ZBAL_BOOTSTRAP_URL": "tcp://10.0.0.1:6789",
       "NPU_SHIM_STRICT": None, "NPU_SHIM_ZBAL": None}

def check_backport(version, out):
    state = out["state"]
    assert state["state"] == "applied", state
    assert state["targets"] and all(state["targets"].values()), state["targets"]
    assert all(out["wrapped"].values()), out["wrapped"]

    mem = out["mem"]
    assert mem["full"] == (10 * (1 << 30) + 5 * (1 << 20)) / (1 << 30)  # zbal heap, GiB
    assert mem["native"] == 1.0                                         # the device says 1 GiB free
    assert mem["full_no_empty_cache_events"] == 0
    assert abs(mem["full_distributed"] - mem["full"]) < 1e-6            # float32 MIN all-reduce
    assert mem["mix"] == mem["native"] == 1.0
    assert (mem["capacity"], mem["capacity_native"]) == (61440, 65536)

    assert out["deepep"] == {"Buffer": True, "Config": True, "use_deepep": True}
    backend = out["backend"]
    assert backend["seen"] == ["zbal", "nccl"] and backend["same_function"] and backend["registered"]
    assert backend["map_npu"] == ("zbal" if version == "0.5.11" else None)

    sched = out["scheduler"]
    full = sched["full_order"]
    assert full.index("zbal_bootstrap") < full.index("body_start") < full.index("alloc")
    (init,) = sched["full_init"]
    assert (init["world_size"], init["device_id"], init["rank_id"]) == (4, 0, 3)
    assert init["device_mem_size"] == 61440 << 20 and init["ip_port"] == "tcp://10.0.0.1:6789"
    mix = sched["mix_order"]
    assert "zbal_bootstrap" not in mix and sched["mix_allocator"] == "pluggable"
    assert mix.index("change_allocator") < mix.index("body_start") < mix.index("alloc")
    assert sched["pp"][0] == "ZbalError" and "only zbal mix mode supports pp_size > 1" in sched["pp"][1]
    assert sched["pp"][2] is False
    name, message, body_ran = sched["init_false"]
    assert name == "ZbalInitError" and body_ran is False
    assert message.startswith("zbal_init failed (full mode, Scheduler start-up): rank 3 of 4, device 0, "
                              "61440 MiB, bootstrap tcp://10.0.0.1:6789")

    runner = out["runner"]
    assert runner["draft_calls"] == []
    assert runner["draft_order"] == ["weights", "kv_cache", "attention_backend", "device_graphs_body"]
    o = runner["order"]
    assert o.index("weights") < o.index("kv_cache") < o.index("attention_backend") \
        < o.index("zbal_bootstrap") < o.index("device_graphs_body")
    (init,) = runner["init"]
    in_use = 65536 - (62000 - 45000)
    assert init["device_mem_size"] == (61440 - in_use) // 128 * 128 << 20 == 12800 << 20
    assert (init["world_size"], init["rank_id"], init["device_id"]) == (1, 0, 0)
    assert init["ip_port"] == "tcp://10.0.0.1:6789"
    assert runner["inits_after_second"] == 1 and runner["full_mode_inits"] == 0
    name, message, graphs = runner["too_small"]
    assert name == "ZbalError" and graphs is False
    assert "SGLANG_ZBAL_LOCAL_MEM_SIZE=40000 MiB configured, 41536 MiB already in use" in message
    assert "of the device's 65536 MiB total" in message

    assert out["off"] == {"state": "inactive", "error": None, "untouched": True}
    assert out["zero"] == {"state": "inactive", "error": None, "untouched": True}
    assert out["switched_off"] == {"state": "disabled", "error": None, "untouched": True}
    for key, words in (("bad_url", "SGLANG_ZBAL_BOOTSTRAP_URL='10.0.0.1:6789' is invalid: expected "
                                   "tcp://HOST:PORT"),
                       ("bad_size", "SGLANG_ZBAL_LOCAL_MEM_SIZE='60G' is invalid: expected a whole "
                                    "number of MiB")):
        assert out[key]["state"] == "failed" and out[key]["untouched"], out[key]
        assert words in out[key]["error"]
    missing = out["missing"]
    assert missing["state"] == "failed" and missing["untouched"], missing
    assert "memfabric-zbal" in missing["error"] and "SGLANG_ZBAL_LOCAL_MEM_SIZE=61440" in missing["error"]
    assert out["again"] == {"state": "applied", "error": None, "untouched": False}


@pytest.mark.parametrize("version", ["0.5.9", "0.5.11"])
def test_backport_in_real_release(version, release_venv):
    release_venv(version)
    out = realsglang.run_program(version, "zbal_backport", env=ENV, zbal=True)
    check_backport(version, out)


def test_zbal_missing_stops_at_the_first_import(release_venv):
    release_venv("0.5.11")
    out = realsglang.run_program("0.5.11", "zbal_missing", env=ENV, zbal=False)
    assert out["error"] is not None, "importing sglang without zbal must fail while the size is set"
    # decided (find_spec, no import) before any target module is patched
    assert out["error"].startswith("npu-shim: zbal was requested but is failed: "
                                   "SGLANG_ZBAL_LOCAL_MEM_SIZE=61440 asks for "
                                   "the zbal allocator, but the Python package 'zbal' is not importable: "
                                   "install memfabric-zbal")
    assert out["allocations"] == 0 and out["scheduler_imported"] is False


@pytest.mark.parametrize("version", ["0.5.19", "0.5.23"])
def test_upstream_release_is_left_alone(version, release_venv):
    release_venv(version)
    out = realsglang.run_program(version, "zbal_upstream", env=ENV, zbal=True)
    state = out["state"]
    assert state["state"] == "upstream" and state["targets"] == {}, state
    assert state["reason"].endswith("has it: Scheduler.init_zbal_on_npu")
    assert out["wrapped"] == [False] * 5
    assert out["own"] == [True, True, True]
    assert out["calls"] == []
