"""npu_shim/source/inherited.py: a child decides from the answers its parent's source gave, never
from a file that changed since."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from shimdev.envs import realsglang
from npu_shim.core import framework
from npu_shim.source import inherited
from npu_shim.core.loading import load_all


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """A private copy of the real 0.5.11 source (files are touched and edited below)."""
    src = os.path.join(str(realsglang.sglang_envs.ensure_sources("0.5.11")), "sglang")
    dst = tmp_path_factory.mktemp("src") / "sglang"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.so", "*.pyc", "__pycache__"))
    return str(dst)


ENV = {"SGLANG_ZBAL_LOCAL_MEM_SIZE": "12288"}


def decide_all(view):
    return {p.name: (d.state, d.reason) for p in load_all()
            for d in [framework.decide(p, view, environ=ENV, on_npu=True, assume_triggered=True)]}


def parent(tree):
    view = inherited.view(tree, environ={})
    states = decide_all(view)
    environ = {}
    inherited.export(view, environ)
    return states, environ


def test_a_child_decides_the_same_without_parsing_anything(tree):
    states, environ = parent(tree)
    assert states["zbal"][0] == "applied" and states["mla_weight_release"][0] == "applied"
    record = json.loads(environ[inherited.ENV])
    assert record["dir"] == tree and record["answers"] and record["files"]
    assert len(environ[inherited.ENV]) < 16384  # an environment variable, not a file
    child = inherited.view(tree, environ=environ)
    assert child.reused
    assert decide_all(child) == states
    assert child._modules == {}  # no sglang file was read, let alone parsed


def test_a_file_changed_since_is_never_trusted(tree):
    states, environ = parent(tree)
    path = os.path.join(tree, "srt", "utils", "common.py")
    before = os.stat(path)
    with open(path, "ab") as handle:
        handle.write(b"\n# edited\n")
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # mtime put back: ctime tells
    try:
        child = inherited.view(tree, environ=environ)
        assert not child.reused
        assert decide_all(child) == states and child._modules  # read from the source again
    finally:
        with open(path, "rb") as handle:
            data = handle.read()
        with open(path, "wb") as handle:
            handle.write(data[:-len(b"\n# edited\n")])


def test_a_module_that_appeared_since_is_noticed(tree):
    _states, environ = parent(tree)
    record = json.loads(environ[inherited.ENV])
    missing = [d for d, ids in record["files"].items() if ids == [None, None]]
    assert missing, "the decision asked about at least one module this release does not have"
    parts = missing[0].split(".")[1:]
    path = os.path.join(tree, *parts) + ".py"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    open(path, "w").close()
    try:
        assert not inherited.view(tree, environ=environ).reused
    finally:
        os.unlink(path)


@pytest.mark.parametrize("raw", ["", "{", "[]", '{"format": 1}', '{"format": 99, "dir": "x"}', "null"])
def test_anything_odd_in_the_variable_means_reading_the_source(tree, raw):
    view = inherited.view(tree, environ={inherited.ENV: raw})
    assert not view.reused
    assert decide_all(view)["zbal"][0] == "applied"


@pytest.mark.parametrize("odd", [
    {"version": [1]}, {"version": 5}, {"answers": []}, {"files": []},
    {"answers": {"function|sglang.srt.utils.common|get_npu_memory_capacity": 5}},
    {"answers": {"function|sglang.srt.utils.common|f": [[1], None, 3]}},
    {"answers": {"function|sglang.srt.utils.common|f": [["x"], 7, 3]}},
    {"answers": {"function|sglang.srt.utils.common|f": [["x"], None, "3"]}},
    {"answers": {"function|sglang.srt.utils.common|f": [["x"], None]}},
    {"answers": {"has|sglang.srt.utils.common|f": {"a": 1}}},
    {"answers": {"module|sglang.srt.utils": 1}},
    {"answers": {"whatever|sglang.srt.utils": True}},
])
def test_a_record_of_this_tree_and_format_with_odd_contents_means_reading_the_source(tree, odd):
    """A record that names this directory and format but holds what no shim writes (a hand-made
    or damaged ``NPU_SHIM_SOURCE_ANSWERS``) is not used.  Before the fix it was: a version that is
    no text printed a logging traceback at the summary line, and an answer of another shape made
    deciding raise (the patch ``failed``; a patch asked for stopped the process)."""
    # Every module the answers name, and the version's files, are listed as they are: only the odd
    # shape can make the record unused.
    files = {name: inherited._identities(tree, name)
             for name in ("sglang.srt.utils.common", "sglang.srt.utils") + inherited.VERSION_FILES}
    record = dict({"format": inherited.FORMAT, "dir": tree, "version": "0.5.11", "files": files, "answers": {}},
                  **odd)
    view = inherited.view(tree, environ={inherited.ENV: json.dumps(record)})
    assert not view.reused and view.answers == {} and view.version == "0.5.11"
    assert decide_all(view)["zbal"][0] == "applied"
    assert inherited.view(tree, environ={inherited.ENV: json.dumps(dict(record, version="0.5.11", answers={
        "function|sglang.srt.utils.common|f": [["x"], None, 3], "has|sglang.srt.utils.common|f": True,
        "module|sglang.srt.utils": False, "contains|sglang.srt.utils|0123": True}, files=files))}).reused


def test_a_record_without_answers_still_gives_the_version_of_its_files(tree):
    files = {name: inherited._identities(tree, name) for name in inherited.VERSION_FILES}
    record = {"format": inherited.FORMAT, "dir": tree, "version": "9.9.9", "files": files}
    view = inherited.view(tree, environ={inherited.ENV: json.dumps(record)})
    assert view.version == "9.9.9" and view.answers == {} and not view.reused


def test_the_record_is_compact_and_in_a_stable_order(tree, monkeypatch):
    """The same answers give the same bytes (keys sorted), as small as JSON writes them (an
    environment variable every child of the launcher carries); with no environment given, the
    process's own is the one children inherit."""
    view = inherited.view(tree, environ={})
    decide_all(view)
    monkeypatch.delenv(inherited.ENV, raising=False)
    inherited.export(view)
    raw = os.environ[inherited.ENV]
    assert raw == json.dumps(json.loads(raw), separators=(",", ":"), sort_keys=True)
    assert inherited.view(tree).reused  # a child reads the process's own environment by default
    inherited.export(codeview_view(tree))  # a plain view has no answers to hand on: nothing changes
    assert os.environ[inherited.ENV] == raw


def codeview_view(tree):
    from npu_shim.source import codeview

    return codeview.SourceView(tree)


def test_another_sglang_directory_does_not_use_the_record(tree, tmp_path):
    _states, environ = parent(tree)
    assert not inherited.view(str(tmp_path), environ=environ).reused


@pytest.mark.parametrize("record", [
    {"format": inherited.FORMAT, "dir": "/elsewhere", "files": {}},  # another directory
    {"format": inherited.FORMAT - 1, "files": {}},                   # another format, this dir
])
def test_a_record_of_another_directory_or_format_is_never_used(tree, record):
    """Each alone is enough: no file identity is left to tell the record is not this tree's (the
    record lists its module's and the version's files as they are here)."""
    files = {name: inherited._identities(tree, name) for name in ("sglang.srt.nothing",) + inherited.VERSION_FILES}
    record = dict({"dir": tree, "version": "9.9.9", "answers": {"module|sglang.srt.nothing": True}},
                  **dict(record, files=files))
    view = inherited.view(tree, environ={inherited.ENV: json.dumps(record)})
    assert not view.reused and view.answers == {} and view.version != "9.9.9"
    good = dict(record, format=inherited.FORMAT, dir=tree)
    good_view = inherited.view(tree, environ={inherited.ENV: json.dumps(good)})
    assert good_view.reused and good_view.version == "9.9.9"


@pytest.fixture(scope="module")
def tree_0512():
    return os.path.join(str(realsglang.sglang_envs.ensure_sources("0.5.12")), "sglang")


def test_answers_without_their_files_are_read_from_the_source(tree, tree_0512):
    """0.5.11's answers in a record of 0.5.12's directory that lists no files: before the fix they
    were used as is -- zbal ``applied`` on top of 0.5.12's own zbal, set up twice.  Now each
    question is read from 0.5.12's source: ``upstream``."""
    _states, environ = parent(tree)
    record = dict(json.loads(environ[inherited.ENV]), dir=tree_0512, files={})
    view = inherited.view(tree_0512, environ={inherited.ENV: json.dumps(record)})
    assert not view.reused and view.answers == {}
    assert view.version == "0.5.12"  # not the record's 0.5.11: its files are not listed either
    assert decide_all(view)["zbal"][0] == "upstream"
    assert decide_all(inherited.view(tree_0512, environ={}))["zbal"][0] == "upstream"


def test_only_the_answers_of_listed_files_are_used(tree):
    """A record that lists some modules' files: their answers are used, the others' dropped and
    asked again of the source (a forged "no" about a module it does not list changes nothing)."""
    _states, environ = parent(tree)
    record = json.loads(environ[inherited.ENV])
    scheduler = "sglang.srt.managers.scheduler"
    assert record["answers"]["has|%s|Scheduler.init_zbal_on_npu" % scheduler] is False
    del record["files"][scheduler]
    record["answers"]["has|%s|Scheduler.__init__" % scheduler] = False  # forged
    view = inherited.view(tree, environ={inherited.ENV: json.dumps(record)})
    assert view.reused
    assert not [key for key in view.answers if key.split("|")[1] == scheduler]
    assert view.answers["module|sglang.srt.utils.common"] is True  # a listed module's answer stays
    assert view.has(scheduler, "Scheduler.__init__") is True and scheduler in view._modules


def test_the_version_is_used_only_with_the_files_it_is_read_from(tree):
    _states, environ = parent(tree)
    record = json.loads(environ[inherited.ENV])
    assert set(inherited.VERSION_FILES) <= set(record["files"])
    forged = dict(record, version="9.9.9")
    assert inherited.view(tree, environ={inherited.ENV: json.dumps(forged)}).version == "9.9.9"  # its files: as read
    for name in inherited.VERSION_FILES:
        files = {k: v for k, v in record["files"].items() if k != name}
        view = inherited.view(tree, environ={inherited.ENV: json.dumps(dict(forged, files=files))})
        assert view.reused and view.version == "0.5.11"


def test_a_fingerprint_deciding_read_is_known_when_applying_without_reading_the_file(tmp_path,
                                                                                   monkeypatch):
    """The loaded code is checked against the fingerprint deciding read while its file is the one
    read (``reading.remember``, keyed by the file's path): applying reads nothing again."""
    import inspect

    from npu_shim.source import reading

    package = tmp_path / "sglang"
    (package / "srt").mkdir(parents=True)
    path = package / "srt" / "a.py"
    path.write_text("def f(x):\n    return x + 1\n")
    view = inherited.view(str(package), environ={})
    fingerprint = view.function("sglang.srt.a", "f").fingerprint
    loaded = {}
    exec(compile(path.read_text(), str(path), "exec"), loaded)  # as the import would load it

    def unread(*args, **kwargs):
        raise AssertionError("the file was read again")

    monkeypatch.setattr(reading, "read_source", unread)
    monkeypatch.setattr(inspect, "getsource", unread)
    assert reading.live_fingerprint(loaded["f"]) == fingerprint


def test_a_child_takes_the_version_from_the_record_without_reading_it(tree, monkeypatch):
    from npu_shim.source import codeview

    _states, environ = parent(tree)

    def unread(package_dir):
        raise AssertionError("the version was read again")

    monkeypatch.setattr(codeview, "read_version", unread)
    child = inherited.view(tree, environ=environ)
    assert child.reused and child.version == "0.5.11"


def test_an_answer_whose_key_names_no_module_is_dropped(tree):
    """``module`` alone is a key of a known kind that names no module: the record is used, the
    answer is not (every answer needs its module's files listed)."""
    _states, environ = parent(tree)
    record = json.loads(environ[inherited.ENV])
    record["answers"]["module"] = True
    view = inherited.view(tree, environ={inherited.ENV: json.dumps(record)})
    assert view.reused and "module" not in view.answers


def test_each_question_has_its_own_answer_in_the_parent_and_in_the_child(tmp_path):
    """Two patterns asked of one module, a module that is there and one that is not: each answer
    is its own, in the view that read the source and in the child that answers from the record."""
    package = tmp_path / "sglang"
    (package / "srt").mkdir(parents=True)
    (package / "srt" / "a.py").write_text("def f(x):\n    return x + 1\n")
    parent_view = inherited.view(str(package), environ={})
    environ = {}
    for view in (parent_view, None):
        if view is None:
            inherited.export(parent_view, environ)
            view = inherited.view(str(package), environ=environ)
            assert view.reused
        assert view.module("sglang.srt.missing") is None
        module = view.module("sglang.srt.a")
        assert module is not None
        assert module.contains(r"return x \+ 1") is True
        assert module.contains(r"return x \+ 2") is False
        assert view.has("sglang.srt.a", "f") and not view.has("sglang.srt.a", "g")
        assert view.function("sglang.srt.a", "f").params == ("x",)
        assert view.function("sglang.srt.a", "g") is None
        assert view.function("sglang.srt.missing", "f") is None
        assert not view.has("sglang.srt.missing", "f")
    assert view._modules == {}  # the child read nothing


def test_a_package_module_s_init_file_changed_since_is_noticed(tmp_path):
    package = tmp_path / "sglang"
    (package / "srt").mkdir(parents=True)
    init = package / "srt" / "__init__.py"
    init.write_text("def f(x):\n    return x\n")
    parent_view = inherited.view(str(package), environ={})
    assert parent_view.function("sglang.srt", "f").params == ("x",)
    environ = {}
    inherited.export(parent_view, environ)
    assert inherited.view(str(package), environ=environ).reused
    init.write_text("def f(x, y):\n    return x\n")
    child = inherited.view(str(package), environ=environ)
    assert not child.reused and child.function("sglang.srt", "f").params == ("x", "y")
