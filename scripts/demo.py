#!/usr/bin/env python3
"""npu-shim demo: the real sglang of one release, with the shim, on a SIMULATED NPU.

    python3 scripts/demo.py [--release 0.5.11]

Builds (or reuses) the environment of a real sglang release (scripts/sglang_envs.py: a base venv
with torch, the release's sglang and dependency layers, a wrapt layer), then

1. runs ``python -m npu_shim status`` there with the shim on PYTHONPATH;
2. starts one Python process there with the shim and the simulated NPU (tests/support/
   simnpu: torch.npu on the CPU, a fake zbal, pure-torch stand-ins for the NPU kernels), imports
   the real sglang modules and drives each patch on a small synthetic model
   (tests/support/demo_features.py);
3. prints the patch states in that process and one short summary per feature, checking each
   against what the release should do (tests/support/expected_states.py).

Exit status: 0 when every check holds, 1 otherwise (with the reason), 2 on bad usage.
Any release of the import matrix (0.5.11 by default: it needs backports of zbal and
mla_weight_release and already has dual_stream_experts upstream).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests" / "support"), str(REPO)]  # the tooling; npu_shim (declarations)

import demo_features  # noqa: E402  (stdlib only at import)
import expected_states  # noqa: E402
import realsglang  # noqa: E402

RULE = "=" * 100
SIMULATED = ("SIMULATED NPU: torch.npu runs on the CPU (tests/support/simnpu), zbal is a fake "
             "(tests/support/fake_zbal),\n  NPU kernels are pure-torch stand-ins; the sglang code is "
             "REAL (release {v}, installed from its wheel).")
SNIPPET = "import demo_features\nemit(demo_features.run_all({v!r}))\n"


class DemoFailure(Exception):
    pass


def say(line=""):
    print(line, flush=True)


def ensure_env(version):
    """The python that runs the release; progress lines while its layers build."""
    if realsglang.sglang_envs.release_is_built(version):
        python = realsglang.release_python(version)
        say(f"[1/3] sglang {version} environment: reused ({python})")
        return python
    say(f"[1/3] sglang {version} environment: not built yet -- building it (about 2-3 min, once)")
    t0 = time.monotonic()
    done = threading.Event()

    def ticker():
        while not done.wait(15):
            say(f"      ... still building ({time.monotonic() - t0:.0f} s)")

    threading.Thread(target=ticker, daemon=True).start()
    try:
        python = realsglang.sglang_envs.ensure_release(version, log=lambda s: say("      " + s)).python
    except Exception as exc:  # EnvError and pip failures
        raise DemoFailure(f"could not build the sglang {version} environment: {exc}") from None
    finally:
        done.set()
    say(f"      built in {time.monotonic() - t0:.0f} s: {python}")
    return python


def show_status(python, version):
    """Run ``python -m npu_shim status`` in the release; print it; return {patch: state}."""
    say(f"[2/3] python -m npu_shim status   (in the {version} environment, same PYTHONPATH and env)")
    argv, env = realsglang.release_command(version, demo_features.DEMO_ENV, zbal=True)
    with tempfile.TemporaryDirectory(prefix="npu-shim-demo-") as cwd:
        p = subprocess.run(argv + ["-m", "npu_shim", "status"], cwd=cwd, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=120)
    if p.returncode != 0:
        raise DemoFailure(f"`python -m npu_shim status` exited {p.returncode}:\n{p.stdout}{p.stderr}")
    states, defaults, in_patches = {}, [], False
    for line in p.stdout.rstrip().splitlines():
        words = line.split()
        if words[:3] == ["patch", "state", "reason"]:
            in_patches = True
        elif not words:
            in_patches = False
        elif in_patches:
            states[words[0]] = words[1]
        if line.endswith("(default)"):
            defaults.append(words[0])
            continue
        say("  | " + line)
    say(f"  | {'':30} ({len(defaults)} more at their defaults: {', '.join(defaults)})")
    return states


def check(ok, what, failures):
    if not ok:
        failures.append(what)
    return ok


def show_features(out, version, failures):
    """Print the in-process states and one summary per feature; collect failed checks."""
    expected = expected_states.expected(version)
    say("  in-process npu_shim.states():")
    for name in expected_states.PATCH_ORDER:
        st = out["states"][name]
        flag = "" if check(st["state"] == expected[name], f"{name}: state {st['state']!r}, "
                           f"expected {expected[name]!r} ({st['reason']})", failures) else "  <-- UNEXPECTED"
        say(f"    {name:20} {st['state']:10} {st['reason']}{flag}")
    say("  what each patch does here (synthetic model, real sglang code):")
    for name in expected_states.PATCH_ORDER:
        facts = out.get(name)
        if isinstance(facts, dict) and "error" in facts:
            failures.append(f"{name}: the driver raised {facts['error']}")
            say(f"  - {name}: FAILED: {facts['error']}")
            say("    " + facts["traceback"].rstrip().replace("\n", "\n    "))
            continue
        if facts is None:
            st = out["states"][name]
            say(f"  - {name}: {st['state']} -- sglang {version}'s own code is used, the shim "
                f"touches nothing ({st['reason']})")
            continue
        globals()["_show_" + name](facts, out["states"][name], version, failures)


def _arrow(order, names):
    """The events of ``order`` as "a -> b -> c", renamed by ``names`` (others dropped)."""
    return " -> ".join(names[e] for e in order if e in names)


def _show_zbal(z, state, version, failures):
    full, init = z["full_order"], z["full_init"]
    check(full.index("zbal_init") < full.index("body_start") < full.index("alloc"),
          f"zbal: full-mode init order {full}", failures)
    check(init["mib"] == 61440 and (init["world_size"], init["rank_id"]) == (4, 3),
          f"zbal: zbal_init arguments {init}", failures)
    steps = {"zbal_init": f"zbal_init({init['mib']} MiB, rank {init['rank_id']}/{init['world_size']}, "
                          f"{init['ip_port']})",
             "switch_to_allocator": "switch_to_allocator", "body_start": "Scheduler body",
             "alloc": "1st allocation"}
    say(f"  - zbal full mode, Scheduler.__init__: {_arrow(full, steps)}")
    mix = z["mix_order"]
    check("zbal_init" not in mix and mix.index("switch_to_allocator") < mix.index("body_start")
          < mix.index("alloc") and z["mix_allocator"] == "pluggable", f"zbal: mix-mode order {mix}",
          failures)
    say(f"  - zbal mix mode, Scheduler.__init__: {_arrow(mix, steps)} (no heap yet)")
    run = z["runner_order"]
    check(run.index("attention_backend") < run.index("zbal_init") < run.index("device_graphs_body")
          and z["heap_mib"] == 12800, f"zbal: lazy heap {z['heap_mib']} MiB, order {run}", failures)
    in_use = z["device_total_mib"] - z["device_free_mib"]
    runner = {"weights": "weights", "kv_cache": "KV cache", "attention_backend": "attn backend",
              "zbal_init": f"zbal_init(GVA heap {z['heap_mib']} MiB)", "device_graphs_body": "graphs"}
    say(f"    ModelRunner.initialize: {_arrow(run, runner)}")
    say(f"    heap on a simulated 64 GB device with {in_use} MiB in use: 61440 configured - {in_use} = "
        f"{61440 - in_use}, aligned down to 128 MiB")
    mem = z["mem"]
    check(mem["avail_native_gib"] == 1.0 and abs(mem["avail_gib"] - 10.0048828125) < 1e-9
          and (mem["capacity_mib"], mem["capacity_native_mib"]) == (61440, 65536),
          f"zbal: memory queries {mem}", failures)
    say(f"  - zbal memory (full mode): get_available_gpu_memory = {mem['avail_gib']:.2f} GiB (zbal heap "
        f"free; device alone: {mem['avail_native_gib']:.2f}),")
    say(f"    get_npu_memory_capacity = {mem['capacity_mib']} MiB (device alone: "
        f"{mem['capacity_native_mib']})")


def _show_mla_weight_release(r, state, version, failures):
    mib = 1 << 20
    check(r["freed"] == r["expected"] and r["details"].get("role") == "decode"
          and r["kernels"] == ["npu_mla_prolog_v3"] * 2 and r["outputs_equal"],
          f"mla_weight_release: freed {r['freed']}, expected {r['expected']}, kernels {r['kernels']}",
          failures)
    say(f"  - mla_weight_release: decode role, {r['model'].upper()} MLA layer at TP{r['tp']}: released "
        f"{sum(r['freed'].values()) / mib:.2f} MiB (qkv_a_proj {r['freed']['qkv_a'] / mib:.2f} + w_kc "
        f"{r['freed']['w_kc'] / mib:.2f}) after step 1;")
    say("    both steps ran npu_mla_prolog_v3 (on the preprocessor's own weight copies)")
    touch = r["touch"]
    check(bool(touch) and touch[0] == "ReleasedWeightError", f"mla_weight_release: touch {touch}",
          failures)
    message = (touch[1] if touch else "nothing raised").split(";")[0]
    say(f"    touching the released w_kc raises {touch[0] if touch else 'NOTHING'}:")
    say(f"      {message}")


def _show_dual_stream_experts(d, state, version, failures):
    s = d["streams"]
    check(s.get("shared") not in (None, "main") and {s.get(k) for k in ("gate", "topk", "experts")}
          == {"main"} and d["equal_single_stream"],
          f"dual_stream_experts: streams {s}, equal to single-stream {d['equal_single_stream']}", failures)
    side = (f"shared experts on {s.get('shared')}, gate/topk/routed experts on main, waits "
            f"{' / '.join(a + '<-' + b for a, b in d['waits'])}")
    same = (f"    output == single-stream output: {d['equal_single_stream']} "
            f"(max |diff| {d['max_abs']:g})")
    if d["wrapped"]["forward_deepep"] == "FunctionWrapper":
        say("  - dual_stream_experts: backported Glm4MoeSparseMoeBlock.forward_deepep (wrapped) ran")
    else:
        say(f"  - dual_stream_experts: {state['state']} -- the shim stands down; sglang {version}'s own "
            f"forward_deepep ran")
    say(f"    extend batch: {side}")
    say(same)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--release", default="0.5.11", choices=realsglang.IMPORT_MATRIX,
                        help="sglang release to run (default 0.5.11)")
    args = parser.parse_args(argv)
    version = args.release
    t0 = time.monotonic()
    say(RULE)
    say("npu-shim demo -- " + SIMULATED.format(v=version))
    say(RULE)
    failures = []
    try:
        python = ensure_env(version)
        status = show_status(python, version)
        for name, want in expected_states.expected(version).items():
            check(status.get(name) == want, f"status: {name} is {status.get(name)!r}, expected {want!r}",
                  failures)
        say(f"[3/3] one process in the {version} environment: import the real sglang modules, drive each patch")
        t1 = time.monotonic()
        try:
            out = realsglang.run_in_release(version, SNIPPET.format(v=version),
                                            env=demo_features.DEMO_ENV, zbal=True)
        except realsglang.ReleaseRunError as exc:
            raise DemoFailure(f"the sglang {version} process failed:\n{exc}") from None
        say(f"  (sglang imported from {out['sglang_file'].rsplit('/sglang/', 1)[0]}; "
            f"{time.monotonic() - t1:.1f} s)")
        if out["missing_modules"]:
            say(f"  note: not in this release: {', '.join(out['missing_modules'])}")
        show_features(out, version, failures)
    except DemoFailure as exc:
        failures.append(str(exc))
    say(RULE)
    if failures:
        say(f"DEMO FAILED ({len(failures)} problem{'s' * (len(failures) > 1)}):")
        for f in failures:
            say("  * " + f)
        say("Reminder: " + SIMULATED.format(v=version))
        say(RULE)
        return 1
    say(f"All checks passed in {time.monotonic() - t0:.0f} s.  Reminder: " + SIMULATED.format(v=version))
    say(RULE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
