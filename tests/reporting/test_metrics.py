"""reporting/metrics.py: the shim's gauges in sglang's multiprocess Prometheus metrics -- every
state written (0 or 1), never into a directory another user controls, no dead process's or dead
run's values served.  Each case runs in a fresh interpreter: prometheus_client keeps its files per
process."""
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from npu_shim.reporting import metrics

REPO = __import__("pathlib").Path(__file__).resolve().parents[2]
NOBODY = 65534

_PRELUDE = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, sys.argv[1])
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = sys.argv[2]
    import prometheus_client  # as sglang does: after the variable is set
    from prometheus_client import CollectorRegistry, multiprocess
    from prometheus_client.mmap_dict import MmapedDict, mmap_key
    from npu_shim.reporting import metrics

    def scrape():
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        out = {}
        for family in registry.collect():
            for s in family.samples:
                if s.name.startswith("npu_shim"):
                    labels = dict(s.labels)
                    pid = labels.pop("pid")
                    key = "%s %s %s" % (s.name, pid, ",".join("%s=%s" % kv for kv in sorted(labels.items())))
                    out[key] = s.value
        return out

    def left_by_a_dead_run(pid, samples):
        # what an earlier process of this pid left: its own file, written the way prometheus_client writes
        db = MmapedDict(os.path.join(sys.argv[2], "gauge_liveall_%d.db" % pid))
        for name, labels, value in samples:
            db.write_value(mmap_key(name, name, list(labels), list(labels.values()), "old run"), value, 0.0)
        db.close()

    me = os.getpid()
""")


def child(tmp_path, directory, body, env=None):
    """(the JSON the body printed last, stderr) of a fresh interpreter running the prelude then ``body``."""
    full = dict(os.environ, NPU_SHIM_LOG_LEVEL="DEBUG", **(env or {}))
    full.pop("prometheus_multiproc_dir", None)
    p = subprocess.run([sys.executable, "-c", _PRELUDE + textwrap.dedent(body), str(REPO), str(directory)],
                       capture_output=True, text=True, timeout=120, env=full, cwd=str(tmp_path))
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1]), p.stderr


def private_dir(tmp_path, name="metrics"):
    path = tmp_path / name
    path.mkdir(mode=0o700)
    return path


def state_row(scraped, pid, patch):
    """{state: value} of one patch in one process."""
    prefix = "npu_shim_patch_state %s patch=%s,state=" % (pid, patch)
    return {k[len(prefix):]: v for k, v in scraped.items() if k.startswith(prefix)}


def test_details_follow_later_changes_and_only_numbers_are_published(tmp_path):
    got, _ = child(tmp_path, private_dir(tmp_path), """
        records = {"zbal": {"state": "applied", "details": {"mode": "mix", "draft_worker_skipped": True}},
                   "dual_stream_experts": {"state": "applied", "details": {
                       "counts": {"fused_python_calls": 0}, "side_streams": {"a": "b"}}}}
        metrics.start(lambda: records)
        records["zbal"]["details"]["gva_mib"] = 128          # the lazy heap, later
        records["dual_stream_experts"]["details"]["counts"]["fused_python_calls"] = 7
        metrics.publish()
        print(json.dumps({"me": me, "scraped": scrape()}))
    """)
    pid, scraped = got["me"], got["scraped"]
    details = {k: v for k, v in scraped.items() if k.startswith("npu_shim_patch_detail")}
    assert details == {"npu_shim_patch_detail %s detail=gva_mib,patch=zbal" % pid: 128,
                       "npu_shim_patch_detail %s detail=fused_python_calls,patch=dual_stream_experts" % pid: 7}


def test_every_state_is_written_so_a_state_left_reads_0_and_uninstall_leaves_none_at_1(tmp_path):
    """Before the fix only the current state was set to 1: after a revert (a reload of changed
    code) ``applied`` stayed 1 beside ``failed``, and after uninstall() every patch read applied."""
    got, _ = child(tmp_path, private_dir(tmp_path), """
        records = {"zbal": {"state": "applied", "details": {}}, "mla_weight_release": {"state": "inactive"}}
        source = {"now": records}
        metrics.start(lambda: source["now"])
        first = scrape()
        records["zbal"]["state"] = "failed"      # reverted: the reload brought code that differs
        metrics.publish()
        reverted = scrape()
        source["now"] = {}                       # uninstall(): no records any more
        metrics.publish()
        print(json.dumps({"me": me, "first": first, "reverted": reverted, "gone": scrape()}))
    """)
    pid = got["me"]
    zeros = dict.fromkeys(("applied", "upstream", "disabled", "inactive", "unsupported", "failed"), 0.0)
    assert state_row(got["first"], pid, "zbal") == dict(zeros, applied=1.0)
    assert state_row(got["first"], pid, "mla_weight_release") == dict(zeros, inactive=1.0)
    assert state_row(got["reverted"], pid, "zbal") == dict(zeros, failed=1.0)
    assert state_row(got["gone"], pid, "zbal") == zeros
    assert state_row(got["gone"], pid, "mla_weight_release") == zeros


def test_a_restarted_process_under_a_reused_pid_shows_none_of_the_dead_runs_values(tmp_path):
    """A kept directory, a pid reused (pid 1 in every fresh container): before the fix the live
    process reported the dead run's ``disabled``=1 and its details beside its own state."""
    got, err = child(tmp_path, private_dir(tmp_path), """
        left_by_a_dead_run(me, [
            ("npu_shim_patch_state", {"patch": "zbal", "state": "disabled"}, 1.0),
            ("npu_shim_patch_state", {"patch": "old_patch", "state": "failed"}, 1.0),
            ("npu_shim_patch_detail", {"patch": "mla_weight_release", "detail": "released_bytes"}, 5.0)])
        before = scrape()
        metrics.start(lambda: {"zbal": {"state": "applied", "details": {}}})
        print(json.dumps({"me": me, "before": before, "after": scrape()}))
    """)
    pid = got["me"]
    assert got["before"]["npu_shim_patch_state %s patch=zbal,state=disabled" % pid] == 1  # the old run's
    after = got["after"]
    assert {k: v for k, v in after.items() if v} == {"npu_shim_patch_state %s patch=zbal,state=applied" % pid: 1}
    assert not any("old_patch" in k or "released_bytes" in k for k in after)
    assert "metrics: deleted 1 file(s) of processes gone: gauge_liveall_%d.db" % pid in err


def _dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_files_of_dead_processes_and_dead_runs_are_deleted_and_live_ones_kept(tmp_path):
    """sglang never marks a process dead: before the fix every pid that ever ran stayed in
    ``/metrics``, a dead process's ``failed`` firing alerts for ever."""
    directory = private_dir(tmp_path)
    dead = _dead_pid()
    files = {name: directory / ("gauge_liveall_%d.db" % pid) for name, pid in (
        ("dead", dead), ("live", os.getpid()), ("reused", os.getppid()))}
    for path in files.values():
        path.write_bytes(b"\0" * 8)
    sglangs = directory / ("gauge_mostrecent_%d.db" % dead)  # sglang's own: not the shim's to touch
    sglangs.write_bytes(b"\0" * 8)
    an_hour_before = time.time() - 3600 - time.clock_gettime(time.CLOCK_BOOTTIME)
    os.utime(files["reused"], (an_hour_before, an_hour_before))  # older than the process of that pid
    got, err = child(tmp_path, directory, """
        metrics.start(lambda: {})
        print(json.dumps(sorted(os.listdir(sys.argv[2]))))
    """)
    assert got == sorted([files["live"].name, sglangs.name])
    assert "metrics: deleted 2 file(s) of processes gone" in err


def test_a_process_deletes_its_own_file_at_a_clean_exit(tmp_path):
    directory = private_dir(tmp_path)
    got, _ = child(tmp_path, directory, """
        metrics.start(lambda: {"zbal": {"state": "applied", "details": {}}})
        print(json.dumps({"me": me, "files": sorted(os.listdir(sys.argv[2]))}))
    """)
    assert got["files"] == ["gauge_liveall_%d.db" % got["me"]]
    assert os.listdir(directory) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="making a directory another user's takes root")
def test_a_directory_another_user_made_first_gets_nothing_and_one_warning(tmp_path):
    """Before the fix a root process created a 64 KiB file wherever a link planted by the owner of
    the directory pointed, at start-up, before sglang itself wrote anything."""
    secret = tmp_path / "root-only"
    secret.mkdir(mode=0o700)
    theirs = tmp_path / "prom"
    theirs.mkdir(mode=0o755)
    os.chown(str(theirs), NOBODY, NOBODY)
    got, err = child(tmp_path, theirs, """
        os.symlink(os.path.join(sys.argv[2], "..", "root-only", "planted.db"),
                   os.path.join(sys.argv[2], "gauge_liveall_%d.db" % me))
        metrics.start(lambda: {"zbal": {"state": "applied", "details": {"gva_mib": 1}}})
        metrics.publish()
        print(json.dumps({"scraped": scrape(), "gauges": metrics._gauges}))
    """)
    assert os.listdir(secret) == [] and got == {"scraped": {}, "gauges": {}}
    warnings = [line for line in err.splitlines() if "writes no metrics" in line]
    assert len(warnings) == 1
    said = ("npu-shim writes no metrics into PROMETHEUS_MULTIPROC_DIR: it belongs to uid %d; sglang's own "
            "files go there too (prometheus_client): use a directory only this user can write (mkdir -m "
            "0700) or unset it: %s" % (NOBODY, theirs))
    line = warnings[0].split("] ", 1)[1]
    # a line is cut at log.MAX_LINE characters: only the path, which comes last, may be cut
    assert line == said or (line.endswith("...") and said.startswith(line[:-3]) and "or unset it: " in line)


def test_a_directory_others_may_write_or_a_symlink_to_one_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(str(shared), 0o777)
    assert metrics.directory_problem(str(shared)) == "may be written to by others"
    os.chmod(str(shared), 0o775)
    assert metrics.directory_problem(str(shared)) == "may be written to by its group"
    mine = private_dir(tmp_path)
    link = tmp_path / "link"
    link.symlink_to(mine)
    assert metrics.directory_problem(str(link)).startswith("is a symlink or no directory at %s (" % link)
    assert metrics.directory_problem(str(mine)) is None
    below = shared / "inner"
    below.mkdir(mode=0o700)
    os.chmod(str(shared), 0o777)  # its parent: anyone may rename it away and put their own
    assert metrics.directory_problem(str(below)) == "is below %s, which others may write to" % shared
    os.chmod(str(shared), 0o1777)  # sticky, as /tmp: only its owner renames it
    assert metrics.directory_problem(str(below)) is None
    assert metrics.directory_problem("relative/dir") == "is not an absolute path"
    assert metrics.directory_problem(str(mine / "gone" / "deeper")) == "does not exist (no %s/gone)" % mine


def test_nothing_is_published_before_sglang_made_its_collector(monkeypatch):
    """publish() before start(): no prometheus_client import, no gauge."""
    monkeypatch.setattr(metrics, "_gauges", None)
    monkeypatch.setattr(metrics, "_source", None)
    before = "prometheus_client" in sys.modules
    metrics.publish()
    assert ("prometheus_client" in sys.modules) == before
    assert metrics._gauges is None


def test_a_source_that_raises_never_reaches_the_application(monkeypatch):
    monkeypatch.setattr(metrics, "_gauges", {"state": None})
    monkeypatch.setattr(metrics, "_source", lambda: 1 / 0)
    monkeypatch.setitem(sys.modules, "prometheus_client", sys.modules.get("prometheus_client") or object())
    metrics.publish()  # no exception
