"""One release, imported for real with the shim on (simulated NPU, every patch triggered), and what
must hold of it -- shared by the import matrix (tests/test_real_sglang_import.py) and
``scripts/release_report.py``.

``probe(version)`` runs one subprocess in the release's layered environment (the program
dev/shimdev/programs/release_import.py): it imports every
module a patch targets, records the states, which functions are wrapt wrappers, whether the
``from ... import`` copies are the module's own function, then runs each applied feature's driver
(dev/shimdev/beds/demo_features.py) under the stream sanitizer, and the dual-stream MoE path (the
backport's or upstream's own) through dev/shimdev/beds/stream_races.py.  ``problems(version, out,
table)`` lists everything in that result that differs from the expected states ``table``
({patch: state}); empty = all holds.
"""
from __future__ import annotations

from shimdev.envs import realsglang
from shimdev.beds import stream_races
from shimdev.beds.demo_features import DEMO_ENV

from npu_shim.core.loading import load_all
from npu_shim.runtime import role

# Every module a patch hooks (0.5.7/0.5.8 lack the MLA ones: "failed" is checked against that).
TARGETS = sorted({module for patch in load_all() for module in patch.modules})
MLA_MODULES = {m for patch in load_all() if patch.name == "mla_weight_release" for m in patch.modules}

GIB, MIB = 1 << 30, 1 << 20


def check_zbal(facts):
    """zbal: init order (full / mix mode) in the real Scheduler.__init__ wrapper and the real
    ModelRunner.initialize body; mix-mode heap size; memory queries through zbal."""
    full = facts["full_order"]
    assert full.index("zbal_bootstrap") < full.index("body_start") < full.index("alloc"), full
    assert facts["full_init"] == {"world_size": 4, "rank_id": 3, "device_id": 0,
                                  "ip_port": "tcp://10.0.0.1:6789", "mib": 61440}, facts["full_init"]
    mix = facts["mix_order"]
    assert "zbal_bootstrap" not in mix and mix.index("change_allocator") < mix.index("body_start"), mix
    assert facts["mix_allocator"] == "pluggable", facts["mix_allocator"]
    runner = facts["runner_order"]  # the release's real ModelRunner.initialize body
    assert runner.index("weights") < runner.index("kv_cache") < runner.index("attention_backend") \
        < runner.index("zbal_bootstrap") < runner.index("device_graphs_body"), runner
    assert facts["heap_mib"] == 12800, facts["heap_mib"]  # 61440 - (65536 - (62000 - 45000)), 128 MiB-aligned
    mem = facts["mem"]
    assert mem["avail_gib"] == (10 * GIB + 5 * MIB) / GIB and mem["avail_native_gib"] == 1.0, mem
    assert (mem["capacity_mib"], mem["capacity_native_mib"]) == (61440, 65536), mem


def check_mla(facts):
    """mla_weight_release: decode role frees exactly qkv_a and w_kc; a touch raises clearly."""
    assert facts["freed"] == facts["expected"] and sum(facts["freed"].values()) > 0, facts
    assert facts["kernels"] == ["npu_mla_prolog_v3", "npu_mla_prolog_v3"] and facts["outputs_equal"], facts
    assert (facts["qkv_type"], facts["w_kc_type"]) == ("ReleasedParameter", "ReleasedTensor"), facts
    assert facts["touch"][0] == "ReleasedWeightError" and "w_kc of layer 0" in facts["touch"][1], facts
    assert facts["details"]["layers"] == 1 and facts["details"]["role"] == "decode", facts["details"]


def check_dual_stream(facts):
    """dual_stream_experts: shared experts on the side stream, bitwise the single-stream output."""
    assert facts["wrapped"]["forward_deepep"] == "FunctionWrapper", facts
    assert facts["streams"] == {"shared": "side-1", "gate": "main", "topk": "main", "experts": "main"}, facts
    assert facts["waits"] == [["side-1", "main"], ["main", "side-1"]], facts["waits"]
    assert facts["equal_single_stream"] is True and facts["max_abs"] == 0.0, facts


CHECKS = {"zbal": check_zbal, "mla_weight_release": check_mla, "dual_stream_experts": check_dual_stream}


def probe(version: str, timeout: float = 600) -> dict:
    """The facts of one release (see the module docstring); raises realsglang.ReleaseRunError."""
    return realsglang.run_program(version, "release_import", TARGETS, env=DEMO_ENV, zbal=True, timeout=timeout)


def _check(problems, what, fn, *args):
    try:
        fn(*args)
    except AssertionError as exc:
        problems.append("%s: %s" % (what, exc or "assertion failed"))
    except (KeyError, ValueError, TypeError) as exc:  # a fact missing from the driver's output
        problems.append("%s: %s: %s" % (what, type(exc).__name__, exc))


def problems(version: str, out: dict, table: dict) -> list:
    """What in ``out`` (from probe) contradicts the expected states ``table``; [] when all holds."""
    found = []
    allowed_missing = MLA_MODULES if table.get("mla_weight_release") in ("inactive", "unsupported") else set()
    bad = {m: e for m, e in out["failed"].items()
           if m not in allowed_missing or not e.startswith("ModuleNotFoundError")}
    if bad:
        found.append("modules failed to import: %s" % bad)
    if out["is_npu"] is not True:
        found.append("is_npu() is %r under the simulated NPU" % out["is_npu"])
    if not out["version"] == version == out["dist_version"]:
        found.append("sglang reports version %r (metadata %r), expected %r" % (
            out["version"], out["dist_version"], version))
    states = {name: s["state"] for name, s in out["states"].items()}
    if states != table:
        found += ["%s: %s, expected %s (%s)" % (name, states.get(name), table.get(name),
                                                  out["states"].get(name, {}).get("reason"))
                  for name in sorted(set(states) | set(table)) if states.get(name) != table.get(name)]
    # Exactly the targets of applied patches are wrapped, each where the patch says, and the
    # shim's own target (npu_shim/runtime/role.py).
    wrappers = set()
    for name, record in out["states"].items():
        if record["state"] == "applied":
            if not (record["targets"] and all(record["targets"].values())):
                found.append("%s applied but not every target was patched: %s" % (name, record["targets"]))
            wrappers |= set(record["wrappers"])
        elif any(record["targets"].values()):
            found.append("%s is %s but patched %s" % (name, record["state"], record["targets"]))
    if role.MODULE in out["wrapped"]:  # and the shim's own: the scheduler's role
        wrappers.add("%s:%s" % (role.MODULE, role.ENTRY))
    wrapped = {"%s:%s" % (module, name) for module, names in out["wrapped"].items() for name in names}
    if wrapped != wrappers:
        found.append("wrapped functions %s, the applied patches' wrappers and the shim's own %s" % (
            sorted(wrapped), sorted(wrappers)))
    # from-import copies (sglang.srt.utils star-import, model_runner's from-import) are the
    # module's own function: the wrapper where zbal is applied, the original elsewhere.
    if out["copies_are_the_module_function"] != {"sglang.srt.utils": True,
                                                 "sglang.srt.model_executor.model_runner": True}:
        found.append("from-import copies differ from the module function: %s"
                     % out["copies_are_the_module_function"])
    if out["gpu_memory_is_wrapped"] is not (states.get("zbal") == "applied"):
        found.append("get_available_gpu_memory wrapped: %s, zbal %s" % (out["gpu_memory_is_wrapped"],
                                                                       states.get("zbal")))
    # One driver per applied feature, on the release's real code.
    applied = sorted(name for name, state in states.items() if state == "applied")
    if sorted(out["drivers"]) != applied:
        found.append("drivers ran for %s, applied: %s" % (sorted(out["drivers"]), applied))
    for name in applied:
        facts = out["drivers"].get(name) or {}
        if "error" in facts:
            found.append("%s driver failed: %s\n%s" % (name, facts["error"], facts.get("traceback")))
        else:
            _check(found, "%s driver" % name, CHECKS[name], facts)
            found += ["%s driver: stream sanitizer: %s" % (name, r["message"]) for r in facts["sanitizer"]]
    found += _race_problems(out, states.get("dual_stream_experts"))
    return found


def _race_problems(out, state):
    """The dual-stream races against what stream_races.EXPECTED says for the backport (applied)
    or for upstream's own code."""
    if state not in ("applied", "upstream"):
        return []
    if "races" not in out:
        return ["dual-stream races were not run (dual_stream_experts is %s)" % state]
    who = "backport" if state == "applied" else "upstream"
    return ["dual-stream races (%s): %s" % (who, p) for p in stream_races.problems(out["races"], who)]
