#!/usr/bin/env python3
"""npu-shim demo: the real sglang of one release, with the shim, on a SIMULATED NPU.

    python3 scripts/demo.py [--release 0.5.11 [--release 0.5.9 ...]]

Builds (or reuses) the environment of a real sglang release (dev/shimdev/envs/sglang_envs.py: a base venv
with torch, the release's sglang and dependency layers, a wrapt layer), then

1. runs ``python -m npu_shim status`` there with the shim on PYTHONPATH;
2. starts one Python process there with the shim and the simulated NPU (dev/shimdev/
   simnpu: torch.npu on the CPU; memfabric-zbal's own Python layer over a simulated native
   library, dev/shimdev/simzbal; pure-torch stand-ins for the NPU kernels), imports
   the real sglang modules and drives each patch on a small synthetic model
   (dev/shimdev/beds/demo_features.py);
3. prints the patch states in that process and one short summary per feature, checking each
   against what the release should do (dev/shimdev/beds/expected_states.py).

Exit status: 0 when every check holds, 1 otherwise (with the reason), 2 on bad usage.
Any releases of the import matrix; by default 0.5.11 (it needs backports of zbal and
mla_weight_release and already has dual_stream_experts upstream) in full, then 0.5.9 (all three
backported) briefly: a patch in the same state as on 0.5.11 is checked as fully but takes one line.
Each patch is shown by its entry in DISPLAYS (keyed by patch name), from what its driver in
shimdev.beds.demo_features.DRIVERS measured; a patch with neither is shown generically (state, reason,
details), so a new patch needs no change here.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "dev"), str(REPO)]  # shimdev (dev/shimdev/__init__.py), npu_shim

from shimdev.beds import demo_features  # noqa: E402  (stdlib only at import)
from shimdev.beds import expected_states  # noqa: E402 - after dev/ is put on sys.path
from shimdev.envs import realsglang  # noqa: E402 - after dev/ is put on sys.path

RULE = "=" * 100
SIMULATED = ("SIMULATED NPU: torch.npu runs on the CPU (dev/shimdev/simnpu), zbal's native library is "
             "simulated (dev/shimdev/simzbal;\n  its Python layer is memfabric-zbal 1.2.0's own), NPU "
             "kernels are pure-torch stand-ins; the sglang code is REAL (release {v}, installed from "
             "PyPI wheels).")
SNIPPET = "from shimdev.beds import demo_features\nemit(demo_features.run_all({v!r}))\n"
#: 0.5.11 needs backports of zbal and mla_weight_release and has dual_stream_experts upstream;
#: 0.5.9 needs all three backported.
DEFAULT_RELEASES = ("0.5.11", "0.5.9")


class DemoFailure(Exception):
    pass


def say(line=""):
    print(line, flush=True)


def ensure_env(version, step="1/3"):
    """The python that runs the release; progress lines while its layers build."""
    step = "1/3" if step == "3/3" else step
    if realsglang.sglang_envs.release_is_built(version):
        python = realsglang.release_python(version)
        say(f"[{step}] sglang {version} environment: reused ({python})")
        return python
    say(f"[{step}] sglang {version} environment: not built yet -- building it (about 2-3 min, once)")
    t0 = time.monotonic()
    done = threading.Event()

    def ticker():
        while not done.wait(15):
            say(f"      ... still building ({time.monotonic() - t0:.0f} s)")

    threading.Thread(target=ticker, daemon=True).start()
    try:
        python = realsglang.sglang_envs.ensure_release(version, log=lambda s: say("      " + s)).python
    except Exception as exc:  # noqa: BLE001 - EnvError and pip failures
        raise DemoFailure(f"could not build the sglang {version} environment: {exc}") from None
    finally:
        done.set()
    say(f"      built in {time.monotonic() - t0:.0f} s: {python}")
    return python


def show_status(python, version, quiet=False):
    """Run ``python -m npu_shim status`` in the release; print it (``quiet``: its patch states in
    one line); return {patch: state}."""
    if not quiet:
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
        if not quiet:
            say("  | " + line)
    if quiet:
        say("  python -m npu_shim status there: " + ", ".join(f"{n} {s}" for n, s in states.items()))
    else:
        say(f"  | {'':30} ({len(defaults)} more at their defaults: {', '.join(defaults)})")
    return states


def check(ok, what, failures):
    if not ok:
        failures.append(what)
    return ok


#: How the demo shows a patch's driver facts, keyed by patch name (``@display(name)``).  A patch
#: without an entry (or without a driver in shimdev.beds.demo_features.DRIVERS) gets show_generic().
DISPLAYS = {}


def display(name):
    def register(fn):
        DISPLAYS[name] = fn
        return fn
    return register


def show_generic(name, facts, state, version, failures):
    """Any patch: its state and reason, then its details / its driver's facts, one line each."""
    if facts is None and state["state"] != "applied":
        say(f"  - {name}: {state['state']} -- sglang {version}'s own code is used, the shim "
            f"touches nothing ({state['reason']})")
        return
    say(f"  - {name}: {state['state']} ({state['reason']})")
    for key, value in sorted(dict(state.get("details") or {}, **(facts or {})).items()):
        say(f"    {key}: {json.dumps(value, default=repr)[:200]}")


def show_features(out, version, failures, same_as=None):
    """Print the in-process states and one summary per patch; collect failed checks.  ``same_as``:
    (release, {patch: state}) shown before -- a patch in the same state there is checked as fully
    but summarised in one line."""
    expected = expected_states.expected(version)
    order = [n for n in expected_states.PATCH_ORDER if n in out["states"]]
    out["states"] = {n: out["states"][n] for n in order + sorted(set(out["states"]) - set(order))}
    say("  in-process npu_shim.states():")
    for name, st in out["states"].items():
        want = expected.get(name)
        flag = "" if check(st["state"] == want, f"{name}: state {st['state']!r}, "
                           f"expected {want!r} ({st['reason']})", failures) else "  <-- UNEXPECTED"
        say(f"    {name:20} {st['state']:10} {st['reason']}{flag}")
    say("  what each patch does here (synthetic model, real sglang code):")
    repeated = []
    for name, state in out["states"].items():
        facts = out["facts"].get(name)
        if isinstance(facts, dict) and "error" in facts:
            failures.append(f"{name}: the driver raised {facts['error']}")
            say(f"  - {name}: FAILED: {facts['error']}")
            say("    " + facts["traceback"].rstrip().replace("\n", "\n    "))
            continue
        if isinstance(facts, dict):  # every driver runs under the simulated NPU's stream sanitizer
            check(not facts.get("sanitizer"), f"{name}: the stream sanitizer reported: "
                  + "; ".join(r["message"] for r in facts.get("sanitizer") or []), failures)
        shown = DISPLAYS.get(name) if facts is not None else None
        if same_as and same_as[1].get(name) == state["state"]:
            checks = []
            if shown:
                with contextlib.redirect_stdout(io.StringIO()):
                    shown(facts, state, version, checks)
            failures.extend(checks)
            repeated.append(f"{name} ({'checks held' if not checks else 'CHECKS FAILED'})")
        elif shown:
            shown(facts, state, version, failures)
        else:
            show_generic(name, facts, state, version, failures)
    if repeated:
        say(f"  - {', '.join(repeated)}: as on {same_as[0]} above")


def _arrow(order, names):
    """The events of ``order`` as "a -> b -> c", renamed by ``names`` (others dropped)."""
    return " -> ".join(names[e] for e in order if e in names)


@display("zbal")
def show_zbal(z, state, version, failures):
    full, init = z["full_order"], z["full_init"]
    check(full.index("zbal_bootstrap") < full.index("body_start") < full.index("alloc"),
          f"zbal: full-mode init order {full}", failures)
    check(init["mib"] == 61440 and (init["world_size"], init["rank_id"]) == (4, 3),
          f"zbal: zbal_init arguments {init}", failures)
    steps = {"zbal_bootstrap": f"zbal bootstrap({init['mib']} MiB, rank {init['rank_id']}/"
                               f"{init['world_size']}, {init['ip_port']})",
             "change_allocator": "allocator swapped to zbal", "body_start": "Scheduler body",
             "alloc": "1st allocation"}
    say(f"  - zbal full mode, Scheduler.__init__: {_arrow(full, steps)}")
    mix = z["mix_order"]
    check("zbal_bootstrap" not in mix and mix.index("change_allocator") < mix.index("body_start")
          < mix.index("alloc") and z["mix_allocator"] == "pluggable", f"zbal: mix-mode order {mix}",
          failures)
    say(f"  - zbal mix mode, Scheduler.__init__: {_arrow(mix, steps)} (no heap yet)")
    run = z["runner_order"]
    check(run.index("attention_backend") < run.index("zbal_bootstrap") < run.index("device_graphs_body")
          and z["heap_mib"] == 12800, f"zbal: lazy heap {z['heap_mib']} MiB, order {run}", failures)
    in_use = z["device_total_mib"] - z["device_free_mib"]
    runner = {"weights": "weights", "kv_cache": "KV cache", "attention_backend": "attn backend",
              "zbal_bootstrap": f"zbal bootstrap(GVA heap {z['heap_mib']} MiB)", "device_graphs_body": "graphs"}
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


@display("mla_weight_release")
def show_mla_weight_release(r, state, version, failures):
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


@display("dual_stream_experts")
def show_dual_stream_experts(d, state, version, failures):
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


def run_release(version, failures, step, same_as=None):
    """One release: its environment, ``npu_shim status`` there, one process driving each patch.
    Returns {patch: in-process state}.  ``same_as`` (release, states): a release shown before; then
    the status table is checked but not printed, and patches in the same state take one line."""
    python = ensure_env(version, step if same_as is None else f"{step}a")
    status = show_status(python, version, quiet=same_as is not None)
    for name, want in expected_states.expected(version).items():
        check(status.get(name) == want, f"status: {name} is {status.get(name)!r}, expected {want!r}",
              failures)
    say(f"[{step if same_as is None else step + 'b'}] one process in the {version} environment: "
        "import the real sglang modules, drive each patch")
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
    show_features(out, version, failures, same_as)
    return {name: st["state"] for name, st in out["states"].items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--release", action="append", choices=realsglang.IMPORT_MATRIX,
                        help="sglang release to run; repeat for more (default: %s)" % " and ".join(DEFAULT_RELEASES))
    args = parser.parse_args(argv)
    releases = args.release or list(DEFAULT_RELEASES)
    shown = releases[0] if len(releases) == 1 else ", then ".join(releases)
    t0 = time.monotonic()
    say(RULE)
    say("npu-shim demo -- " + SIMULATED.format(v=shown))
    say(RULE)
    failures = []
    first = None
    for number, version in enumerate(releases):
        try:
            if first is None:
                states = run_release(version, failures, "3/3")
                first = (version, states)
            else:
                what = ", ".join(n for n, st in expected_states.expected(version).items()
                                 if st != first[1].get(n))
                say(f"[{number + 3}] sglang {version}: the same, briefly (differs from {first[0]} in: "
                    f"{what or 'nothing'})")
                run_release(version, failures, str(number + 3), same_as=first)
        except DemoFailure as exc:
            failures.append(str(exc))
    say(RULE)
    if failures:
        say(f"DEMO FAILED ({len(failures)} problem{'s' * (len(failures) > 1)}):")
        for f in failures:
            say("  * " + f)
        say("Reminder: " + SIMULATED.format(v=shown))
        say(RULE)
        return 1
    say(f"All checks passed in {time.monotonic() - t0:.0f} s.  Reminder: " + SIMULATED.format(v=shown))
    say(RULE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
