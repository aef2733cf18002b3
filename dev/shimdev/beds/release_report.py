"""For maintainers (the command is scripts/release_report.py; this module holds its code, which
tests/dev/test_release_report.py imports), when upstream publishes an sglang release:

    python3 scripts/release_report.py VERSION     # e.g. 0.5.24; "latest" = the newest on PyPI
    python3 scripts/release_report.py --write-docs

For VERSION it

1. fetches the release's wheel (``pip download --no-deps``) and reads its source;
2. decides every patch from that source, exactly as the runtime does (patch switched on, trigger
   assumed set), and compares with the newest older release of the expected table: a probe that
   now says ``upstream``, a target gone, a signature changed, a pinned body whose fingerprint
   changed, a state that moved;
3. builds the release's layers (dev/shimdev/envs/sglang_envs.py) and imports it with the shim on, on the
   simulated NPU, every patch triggered: states, wrapped functions, ``from``-import copies and each
   applied feature's driver, checked as the import matrix checks them
   (dev/shimdev/beds/import_probe.py);
4. compares with what the patches' declarations promise for VERSION (their ``upstream``:
   dev/shimdev/beds/expected_states.py), and prints the release table's row.

Exit status 0 when the import agrees with the source decision and both with the declarations; 1
otherwise (change the patch whose declaration is wrong); 2 on bad usage or when the release
cannot be fetched or built.  ``--write-docs`` (formerly ``--write-readme``) rewrites the generated
tables: the supported releases in docs/releases.md, the environment variables in
docs/configuration.md.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

from shimdev import REPO


from shimdev.beds import expected_states
from shimdev.envs import realsglang, sglang_envs
def say(line=""):
    print(line, flush=True)


def latest_on_pypi() -> str:
    """The newest sglang version on the index pip uses (``pip index versions sglang``)."""
    p = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "sglang"],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=300)
    m = re.search(r"^Available versions: ([^,\s]+)", p.stdout, re.M)
    if p.returncode != 0 or not m:
        raise sglang_envs.EnvError("pip index versions sglang failed: %s" % (p.stderr or p.stdout)[-2000:])
    return m.group(1)


def release_view(version, strict=False):
    """A SourceView of a release's source (its wheel, unpacked once)."""
    from npu_shim.source.codeview import SourceView

    return SourceView(os.path.join(str(sglang_envs.ensure_sources(version, strict=strict)), "sglang"))


def static_decisions(view):
    """{patch: Decision} from the source, each patch switched on and its trigger assumed set."""
    from npu_shim.core import framework
    from npu_shim.core.loading import load_all

    return {p.name: framework.decide(p, view, environ={}, on_npu=None, assume_triggered=True)
            for p in load_all()}


def moved(prev_view, new_view):
    """Lines: what changed for the shim between two releases' sources."""
    from npu_shim.core import framework
    from npu_shim.runtime import targets
    from npu_shim.core.loading import load_all

    lines = []
    for patch in load_all():
        before, after = patch.probe(prev_view), patch.probe(new_view)
        if not before and after:
            lines.append("%s: the probe now says upstream: %s" % (patch.name, after))
        elif before and not after:
            lines.append("%s: the probe no longer finds the upstream feature (was: %s)" % (patch.name, before))
        if before:
            continue  # upstream before: the shim had no targets to compare
        try:
            listed = framework.targets_for(patch, prev_view, {})[1]
        except framework.Verdict:
            continue  # nothing to list for the previous release
        except Exception as exc:  # noqa: BLE001 - a release the patch cannot even list targets for
            lines.append("%s: cannot list the previous release's targets (%r)" % (patch.name, exc))
            continue
        for target in listed:
            if not isinstance(target, targets.Wrap):
                old, new = target.check_source(prev_view), target.check_source(new_view)
                if new and new != old:
                    lines.append("%s: %s" % (patch.name, new))
                continue
            old = prev_view.function(target.module, target.qualname)
            new = new_view.function(target.module, target.qualname)
            if old is None:
                continue
            if new is None:
                lines.append("%s: target gone: %s" % (patch.name, target.describe()))
            elif new.params != old.params:
                lines.append("%s: %s signature (%s) -> (%s)" % (
                    patch.name, target.describe(), ", ".join(old.params), ", ".join(new.params)))
            elif target.own_pin is not None and new.fingerprint != old.fingerprint:
                lines.append("%s: pinned body %s changed: fingerprint %s -> %s (known: %s)" % (
                    patch.name, target.describe(), old.fingerprint, new.fingerprint,
                    ", ".join("%s (%s)" % kv for kv in target.own_pin.items())))
            else:  # the code it relies on elsewhere (pins on other defs, source_has)
                before, after = target.check_source(prev_view), target.check_source(new_view)
                if after and after != before:
                    lines.append("%s: %s" % (patch.name, after))
    return lines


ENV_DOC = "docs/configuration.md"  # the page that shows the variable table, relative to the repository
ENV_START, ENV_END = "<!-- env-table -->", "<!-- /env-table -->"


def env_table():
    """ENV_DOC's environment-variable table (between ENV_START and ENV_END)."""
    from npu_shim.core.loading import all_variables

    lines = ["| variable | type | default | meaning |", "|---|---|---|---|"]
    lines += ["| `%s` | %s | `%r` | %s |" % (v.name, v.kind, v.default, v.doc) for v in all_variables()]
    return "\n".join(lines)


def _replace_between(text, start, end, body):
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return "%s%s\n%s\n%s%s" % (head, start, body, end, tail)


def _rewrite(relpath, start, end, body) -> bool:
    path = REPO / relpath
    text = path.read_text(encoding="utf-8")
    new = _replace_between(text, start, end, body)
    if new != text:
        path.write_text(new, encoding="utf-8")
    return new != text


def write_docs() -> bool:
    """Rewrite the generated tables: supported releases (from the patches' declarations) in
    expected_states.DOC, environment variables (from ``all_variables()``) in ENV_DOC; True when
    either changed."""
    releases = _rewrite(expected_states.DOC, expected_states.TABLE_START, expected_states.TABLE_END,
                        expected_states.render_table())
    variables = _rewrite(ENV_DOC, ENV_START, ENV_END, env_table())
    return releases or variables


def report(version: str) -> int:
    table = expected_states.EXPECTED
    known = version in table
    older = [v for v in table if sglang_envs.version_key(v) < sglang_envs.version_key(version)]
    previous = older[-1] if older else None
    wheel = sglang_envs.ensure_wheel(version, strict=False)
    view = release_view(version)
    say("sglang %s (%s)%s" % (version, wheel.name, ", in the expected table" if known else ", NEW"))
    if view.version != version:
        say("  ! the wheel's source reports version %r" % view.version)
        return 1

    say("\n1. every patch decided from the release's source (switched on, trigger assumed set):")
    decisions = static_decisions(view)
    states = {name: d.state for name, d in decisions.items()}
    for name, d in decisions.items():
        say("  %-20s %-12s %s" % (name, d.state, d.reason))

    say("\n2. what moved since %s (the table's previous row: %s):" % (
        previous, ", ".join(table[previous].values()) if previous else "-"))
    lines = moved(release_view(previous), view) if previous else []
    if previous:
        lines += ["%s: %s -> %s" % (name, old, states[name])
                  for name, old in table[previous].items() if old != states[name]]
    for line in lines or ["nothing the shim reads"]:
        say("  - " + line)

    say("\n3. imported with the shim on (simulated NPU, every patch triggered; building its layers "
        "if needed):")
    from shimdev.beds import import_probe

    sglang_envs.ensure_release(version, strict=False, log=lambda s: say("    " + s))
    out = import_probe.probe(version)
    found = import_probe.problems(version, out, states)
    say("  states      %s" % ", ".join("%s %s" % (n, s["state"]) for n, s in out["states"].items()))
    say("  wrapped     %s" % (", ".join(sorted("%s:%s" % (m, n) for m, ns in out["wrapped"].items()
                                                   for n in ns)) or "nothing"))
    say("  drivers     %s" % (", ".join("%s %s" % (n, "FAILED" if "error" in f else "ran")
                                       for n, f in out["drivers"].items()) or "none (nothing applied)"))
    for line in found:
        say("  ! " + line)
    say("  %s" % ("agrees with the source decision: states, wrapped targets, from-import copies, drivers"
                  if not found else "DISAGREES with the source decision (above)"))

    promised = expected_states.expected(version)
    agree = promised == states
    say("\n4. what the patches' declarations promise (upstream.backports, upstream.release):")
    say("   the table has %s: %s" % (", ".join(promised.values()), "agrees" if agree else "DIFFERS"))
    for name in (n for n in states if promised[n] != states[n]):
        say("   ! %s: declared %s, decided %s: fix %s's declaration (or the code)"
            % (name, promised[name], states[name], name))
    say("   its row in %s (python3 scripts/release_report.py --write-docs):" % expected_states.DOC)
    say("   " + expected_states.row(version, states))
    if not known:
        say("   new release: add it to RELEASES (or POST_RELEASES) in dev/shimdev/envs/releases.py, then "
            "--write-docs")
    return 0 if agree and not found else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="release_report.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("version", nargs="?", help='an sglang version on PyPI, or "latest"')
    ap.add_argument("--write-docs", "--write-readme", dest="write_docs", action="store_true",
                    help="rewrite the supported-release table (%s) and the variable table (%s)"
                         % (expected_states.DOC, ENV_DOC))
    a = ap.parse_args(argv)
    if a.write_docs:
        say("generated tables in %s and %s %s" % (expected_states.DOC, ENV_DOC,
                                                  "rewritten" if write_docs() else "already up to date"))
        if not a.version:
            return 0
    if not a.version:
        ap.error("give a VERSION (or --write-docs)")
    try:
        version = latest_on_pypi() if a.version == "latest" else a.version
        return report(version)
    except (sglang_envs.EnvError, realsglang.ReleaseRunError) as exc:
        say("release_report: error: %s" % exc)
        return 2
