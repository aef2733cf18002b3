"""The bootstrap and the patch framework, each case in a fresh interpreter.

These tests exercise the mechanism (start-up, hooks, switches, install/uninstall, spawn children)
against a minimal package named ``sglang`` written to a temporary directory, with a small test
patch.  The real releases are exercised by tests/test_real_sglang_import.py and tests/patches/.
"""

import json
import os
import re
import subprocess
import sys
import textwrap
import types

import pytest

import npu_shim
from npu_shim.core.loading import all_variables
from npu_shim.patches import zbal as zbal_patch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# every line of a process that saw sglang
TAG = r"\[npu-shim %s sglang 0\.5\.9 pid [0-9]+\]" % re.escape(npu_shim.__version__)

FAKE_COMMON = '''
def get_npu_memory_capacity():
    return 1000

class Scheduler:
    def __init__(self, server_args, gpu_id):
        self.gpu_id = gpu_id

__all__ = ["get_npu_memory_capacity", "Scheduler"]
'''

# The minimal sglang the mechanism tests import: {path below the folder put on PYTHONPATH: text}
# (tests/test_adding_a_patch.py and the deploy tests' fake image use it too).
FAKE_SGLANG = {
    "sglang/__init__.py": "",
    "sglang/version.py": '__version__ = "0.5.9"\n',
    "sglang/srt/__init__.py": "",
    "sglang/srt/utils/__init__.py": "from .common import *\n",
    "sglang/srt/utils/common.py": FAKE_COMMON,
}


def write_fake_sglang(folder):
    """FAKE_SGLANG below ``folder`` (a Path, the folder put on PYTHONPATH)."""
    for path, text in FAKE_SGLANG.items():
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_text(text)

DEMO_PATCH = '''
import os
from npu_shim.core import config, framework
from npu_shim.runtime import targets

def add_one(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs) + 1

def mark_init(wrapped, instance, args, kwargs):
    wrapped(*args, **kwargs)
    instance.patched = True

class DemoPatch(framework.Patch):
    name = "demo"
    upstream = framework.Upstream("sgl-project/sglang#1", "0.5.99", backports=("0.5.0", "0.5.98"))
    # an alias and a variable the real patches use, so messages read like theirs
    switch = config.switch("demo", "test switch", aliases=("NPU_SHIM_DUAL_STREAM",))
    reads = (config.mib("SGLANG_ZBAL_LOCAL_MEM_SIZE", "test size"),
             config.url("SGLANG_ZBAL_BOOTSTRAP_URL", "test url"))
    modules = ("sglang.srt.utils.common",)

    def trigger(self, environ, on_npu):
        return None  # works off an NPU too

    def probe(self, view):
        if view.has("sglang.srt.utils.common", "upstream_has_it"):
            return "upstream_has_it"
        return None

    def targets(self, view, ctx):
        if os.environ.get("DEMO_PATCH_TARGETS_RAISE"):
            raise RuntimeError("boom while listing targets")
        return [
            targets.Wrap("sglang.srt.utils.common", "get_npu_memory_capacity", add_one, [()]),
            targets.Wrap("sglang.srt.utils.common", "Scheduler.__init__", mark_init,
                          [("server_args", "gpu_id")]),
        ]

PATCH = DemoPatch()
'''

# The "image's own" sitecustomize: chained by ours; registers the demo patch in every process.
IMAGE_SITECUSTOMIZE = '''
import os
with open(os.environ["CHAIN_MARKER"], "a") as f:
    f.write("ran\\n")
import npu_shim.core.registry
npu_shim.core.registry.PATCH_MODULES[:] = ["demo"]
'''


@pytest.fixture
def tree(tmp_path):
    """tmp/sglang (fake package), tmp/image (the image's own sitecustomize + demo patch)."""
    write_fake_sglang(tmp_path / "pkgs")
    image = tmp_path / "image"
    image.mkdir()
    (image / "sitecustomize.py").write_text(IMAGE_SITECUSTOMIZE)
    (image / "demo.py").write_text(DEMO_PATCH)
    return tmp_path


def run(tree, code, env=None, shim=True, check=True):
    """Run ``code`` in a fresh interpreter.  PYTHONPATH: repo, image dir, fake sglang -- or, with
    ``shim=False``, the repo last (npu_shim importable, its sitecustomize shadowed by the image's)."""
    paths = [str(tree / "image"), str(tree / "pkgs")]
    return run_python([sys.executable, "-c", textwrap.dedent(code)], tree,
                      [REPO] + paths if shim else paths + [REPO], env, check)


def run_python(command, tree, paths, env=None, check=True, drop=("NPU_SHIM_", "SGLANG_", "DEMO_PATCH_"),
               timeout=120):
    """``command`` (an interpreter's) run in ``tree`` with PYTHONPATH ``paths``: the environment
    without the variables starting with ``drop``, the chain marker, no bytecode written, then
    ``env``.  ``check``: a non-zero exit raises with its output."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    full_env.update({"PYTHONPATH": os.pathsep.join(paths), "CHAIN_MARKER": str(tree / "marker"),
                     "PYTHONDONTWRITEBYTECODE": "1"})
    full_env.update(env or {})
    proc = subprocess.run(command, cwd=str(tree), env=full_env, capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError("exit %d\nstdout:\n%s\nstderr:\n%s" % (proc.returncode, proc.stdout, proc.stderr))
    return proc


#: What a process reports in most tests here: the (patched or not) value and every state.
VALUE_AND_STATES = """
    import json, npu_shim
    from sglang.srt.utils import get_npu_memory_capacity
    print(json.dumps({"value": get_npu_memory_capacity(), "states": npu_shim.states()}))
"""


def last_json(proc):
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_image_sitecustomize_is_chained_exactly_once(tree):
    proc = run(tree, """
        import sys, json
        print(json.dumps({"armed": any(getattr(f, "is_npu_shim_watcher", False) for f in sys.meta_path),
                          "ours": sys.modules["sitecustomize"].__file__,
                          "chained": sys.modules["npu_shim.chained_sitecustomize"].__file__}))
    """)
    out = last_json(proc)
    assert out["armed"]
    assert out["ours"] == os.path.join(REPO, "sitecustomize.py")
    assert out["chained"] == str(tree / "image" / "sitecustomize.py")
    assert (tree / "marker").read_text() == "ran\n"


@pytest.mark.parametrize("form", ["module", "package", "sourceless", "zip file"])
def test_the_next_sitecustomize_is_chained_in_any_form_the_import_system_finds(form, tmp_path, monkeypatch):
    """The chain asks the import system's own PathFinder over the entries after ours: whatever form
    the image's sitecustomize takes there, it runs, past entries that hold none."""
    import marshal
    import zipfile

    from npu_shim import _bootstrap

    ours, empty, entry = tmp_path / "ours", tmp_path / "empty", tmp_path / "entry"
    for folder in (ours, empty, entry):
        folder.mkdir()
    (ours / "sitecustomize.py").write_text("")
    code = "RAN = %r\n" % form
    if form == "module":
        (entry / "sitecustomize.py").write_text(code)
    elif form == "package":
        (entry / "sitecustomize").mkdir()
        (entry / "sitecustomize" / "__init__.py").write_text(code)
    elif form == "sourceless":
        import importlib.util

        header = importlib.util.MAGIC_NUMBER + b"\0" * 12
        (entry / "sitecustomize.pyc").write_bytes(header + marshal.dumps(compile(code, "sitecustomize", "exec")))
    else:
        entry = tmp_path / "entry.zip"
        with zipfile.ZipFile(str(entry), "w") as archive:
            archive.writestr("sitecustomize.py", code)
    monkeypatch.setattr(sys, "path", [str(ours), str(empty), str(entry)])
    monkeypatch.setitem(sys.modules, "sitecustomize", types.ModuleType("sitecustomize"))
    monkeypatch.setitem(sys.modules, "npu_shim.chained_sitecustomize", None)
    try:
        module = _bootstrap.chain_next_sitecustomize(str(ours / "sitecustomize.py"))
        assert module is not None and module.RAN == form
        assert sys.modules["npu_shim.chained_sitecustomize"] is module
    finally:
        for folder in (ours, empty, entry):
            sys.path_importer_cache.pop(str(folder), None)


def test_no_sitecustomize_after_ours_chains_nothing(tmp_path, monkeypatch):
    from npu_shim import _bootstrap

    ours, empty = tmp_path / "ours", tmp_path / "empty"
    for folder in (ours, empty):
        folder.mkdir()
    (ours / "sitecustomize.py").write_text("")
    monkeypatch.setattr(sys, "path", [str(ours), str(empty), str(tmp_path / "missing")])
    try:
        assert _bootstrap.chain_next_sitecustomize(str(ours / "sitecustomize.py")) is None
    finally:
        for folder in (ours, empty, tmp_path / "missing"):
            sys.path_importer_cache.pop(str(folder), None)


def test_failing_image_sitecustomize_is_reported_like_site_py_and_does_not_stop_start_up(tree):
    (tree / "image" / "sitecustomize.py").write_text("raise ValueError('image bug')\n")
    proc = run(tree, "print('alive')")
    assert proc.stdout.strip() == "alive"
    assert "Error in sitecustomize" in proc.stderr and "ValueError: image bug" in proc.stderr


def test_process_that_never_imports_sglang_loads_nothing_heavy(tree):
    proc = run(tree, """
        import sys, json
        print(json.dumps(sorted(m for m in sys.modules
                                if m.split(".")[0] in ("wrapt", "torch", "sglang", "logging", "ast"))))
    """)
    assert last_json(proc) == []


@pytest.mark.parametrize("enabled", ["1", "0"])
def test_an_import_of_sglang_that_finds_nothing_activates_nothing_and_a_later_one_does(tree, enabled):
    """A process with no sglang to import (``try: import sglang`` in a tool of another venv, the
    bundle being on every process's PYTHONPATH) pays nothing and says nothing.  Before the fix
    the failed import activated the shim: wrapt, the patches, logging and ast loaded (~9 MB,
    ~0.1 s), and with NPU_SHIM_ENABLED=0 it said "off: sglang is not patched" for a process without
    sglang."""
    proc = run_python([sys.executable, "-c", textwrap.dedent("""
        import json, os, sys
        try:
            import sglang
        except ImportError:
            pass
        # (the registry: the image's sitecustomize of these tests loads it to register the demo)
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("wrapt", "logging", "ast")
                        or m.startswith(("npu_shim._wrapt", "npu_shim.runtime", "npu_shim.core."))
                        and m != "npu_shim.core.registry")
        quiet = loaded
        sys.stderr.write("-- now sglang is there\\n")
        sys.path.append(os.environ["PKGS"])
        from sglang.srt.utils import get_npu_memory_capacity
        print(json.dumps({"quiet": quiet, "value": get_npu_memory_capacity()}))
    """)], tree, [REPO, str(tree / "image")],
        env={"NPU_SHIM_ENABLED": enabled, "PKGS": str(tree / "pkgs")})
    before, after = proc.stderr.split("-- now sglang is there\n")
    assert last_json(proc) == {"quiet": [], "value": 1001 if enabled == "1" else 1000}
    assert before == ""
    said = "demo=applied" if enabled == "1" else "off (NPU_SHIM_ENABLED=0)"
    assert re.fullmatch(TAG + " " + re.escape(said) + ".*", after.strip()), after


def test_a_finder_that_looks_sglang_up_itself_while_asked_does_not_activate_twice(tree):
    """The watcher asks the finders after it whether sglang is there; one of them that looks it up
    again through importlib while asked (as wrapt's finder does for a module with a post-import
    hook) gets its answer without a second activation: the "off" line is said once.  Without the
    guard on that nested lookup, the line was said twice."""
    proc = run(tree, """
        import importlib.util, sys

        class LooksItUp:
            busy = False

            def find_spec(self, fullname, path=None, target=None):
                if fullname != "sglang" or self.busy:
                    return None
                self.busy = True
                try:
                    return importlib.util.find_spec(fullname)
                finally:
                    self.busy = False

        sys.meta_path.insert(1, LooksItUp())  # after the watcher
        import sglang
        print("imported")
    """, env={"NPU_SHIM_ENABLED": "0"})
    assert proc.stdout.strip() == "imported"
    assert re.fullmatch(TAG + r" off \(NPU_SHIM_ENABLED=0\): sglang is not patched in this process",
                        proc.stderr.strip()), proc.stderr


# Every object ever put in sys.meta_path (a list that records what goes in) and, at each step, the
# shim's objects there: only the start-up watcher may ever be one of them.
ONE_FINDER = """
    import importlib, json, sys

    class Recording(list):
        def __init__(self, items):
            super().__init__(items)
            self.ever = list(items)

        def insert(self, index, item):
            self.ever.append(item)
            super().insert(index, item)

        def append(self, item):
            self.ever.append(item)
            super().append(item)

        def extend(self, items):
            items = list(items)
            self.ever.extend(items)
            super().extend(items)

        def __iadd__(self, items):
            self.extend(items)
            return self

        def __setitem__(self, index, item):
            self.ever.extend(item if isinstance(index, slice) else [item])
            super().__setitem__(index, item)

    sys.meta_path = Recording(sys.meta_path)

    def ours(finders):
        return ["watcher" if getattr(f, "is_npu_shim_watcher", False) else repr(f) for f in finders
                if getattr(f, "is_npu_shim_watcher", False)
                or type(f).__module__.startswith(("npu_shim", "sitecustomize"))]

    import npu_shim
    steps = []

    def step(what):
        steps.append([what, ours(sys.meta_path)])

    if %(install_first)r:
        npu_shim.install()
        step("install")
    from sglang.srt.utils import common
    step("import")
    for _ in range(3):
        npu_shim.install()
        step("install")
        importlib.reload(common)
        step("reload %%d" %% common.get_npu_memory_capacity())
        npu_shim.uninstall()
        step("uninstall")
    npu_shim.install()
    step("install")
    print(json.dumps({"steps": steps, "ever": sorted(set(ours(sys.meta_path.ever)))}))
"""


@pytest.mark.parametrize("start", ["armed at start-up", "install after import", "install before import",
                                   "NPU_SHIM_ENABLED=0 then install"])
def test_the_start_up_watcher_is_the_only_object_of_the_shims_ever_in_sys_meta_path(tree, start):
    """Every way a process arms the shim -- at start-up, ``install()`` after or before ``import
    sglang``, switched off at start-up then ``install()`` -- through uninstall()/install() cycles
    and reloads: one finder of the shim's at most, always the watcher, which hands imports on to the
    hook table.  Before, ``install()`` after sglang was imported (or after an ``uninstall()``) put
    the table itself in sys.meta_path, a second finder of the shim's with its own recursion guard."""
    proc = run(tree, ONE_FINDER % {"install_first": start == "install before import"},
               shim=start in ("armed at start-up", "NPU_SHIM_ENABLED=0 then install"),
               env={"NPU_SHIM_ENABLED": "0"} if start.startswith("NPU_SHIM_ENABLED") else None)
    out = last_json(proc)
    assert out["ever"] == ["watcher"]
    # (switched off, an explicit install() decides each patch ``disabled``: nothing is patched)
    value = 1000 if start.startswith("NPU_SHIM_ENABLED") else 1001
    cycle = [["install", ["watcher"]], ["reload %d" % value, ["watcher"]], ["uninstall", []]]
    first = [["install", ["watcher"]]] if start == "install before import" else []
    # switched off at start-up, the watcher stays where it said "off" (it is not in the way)
    imported = ["watcher"] if start != "install after import" else []
    assert out["steps"] == first + [["import", imported]] + cycle * 3 + [["install", ["watcher"]]]


def test_hooks_fire_on_sglang_import_and_log_one_summary_line(tree):
    proc = run(tree, """
        import json
        from sglang.srt.utils import get_npu_memory_capacity, Scheduler
        from sglang.srt.utils import common
        import npu_shim
        print(json.dumps({"value": get_npu_memory_capacity(), "patched": Scheduler(None, 0).patched,
                          "common": common.get_npu_memory_capacity(), "states": npu_shim.states()}))
    """)
    out = last_json(proc)
    assert out["value"] == 1001 and out["common"] == 1001 and out["patched"] is True
    assert out["states"]["demo"]["state"] == "applied"
    assert all(out["states"]["demo"]["targets"].values())
    # One line for the process, tagged with versions and pid; the reason is at DEBUG.
    assert re.fullmatch(TAG + r" demo=applied", proc.stderr.strip()), proc.stderr


def test_upstream_probe_stands_down_and_touches_nothing(tree):
    common = tree / "pkgs" / "sglang" / "srt" / "utils" / "common.py"
    common.write_text(FAKE_COMMON + "\ndef upstream_has_it():\n    pass\n")
    proc = run(tree, VALUE_AND_STATES)
    out = last_json(proc)
    assert out["value"] == 1000
    assert out["states"]["demo"]["state"] == "upstream"
    assert "sglang 0.5.9 has it: upstream_has_it" in out["states"]["demo"]["reason"]


def test_unknown_signature_is_unsupported_and_nothing_is_changed(tree):
    common = tree / "pkgs" / "sglang" / "srt" / "utils" / "common.py"
    common.write_text(FAKE_COMMON.replace("def __init__(self, server_args, gpu_id)",
                                          "def __init__(self, server_args, port_args, gpu_id)"))
    proc = run(tree, VALUE_AND_STATES)
    out = last_json(proc)
    assert out["value"] == 1000  # the valid target was not applied either: all or nothing
    assert out["states"]["demo"]["state"] == "unsupported"
    assert "Scheduler.__init__ has signature (server_args, port_args, gpu_id)" in out["states"]["demo"]["reason"]
    assert re.search(TAG + r" demo: unsupported \(", proc.stderr), proc.stderr


def test_exception_inside_a_patch_does_not_break_the_import(tree):
    proc = run(tree, VALUE_AND_STATES, env={"DEMO_PATCH_TARGETS_RAISE": "1"})
    out = last_json(proc)
    assert out["value"] == 1000
    assert out["states"]["demo"]["state"] == "failed"
    assert "boom while listing targets" in out["states"]["demo"]["reason"]
    summary, failure = proc.stderr.strip().splitlines()  # the summary, then the failure at ERROR
    assert re.fullmatch(TAG + " demo=failed", summary), summary
    assert re.fullmatch(TAG + re.escape(" demo: failed (deciding raised RuntimeError('boom while "
                                        "listing targets'))"), failure), failure


def test_strict_mode_raises_on_a_failed_patch(tree):
    proc = run(tree, "import sglang.srt.utils", env={"DEMO_PATCH_TARGETS_RAISE": "1",
                                                     "NPU_SHIM_STRICT": "1"}, check=False)
    assert proc.returncode != 0
    assert "ShimError: npu-shim (strict): demo is failed" in proc.stderr


def test_master_switch_off_leaves_sglang_untouched(tree):
    proc = run(tree, """
        import sys, json
        from sglang.srt.utils import get_npu_memory_capacity
        print(json.dumps({"value": get_npu_memory_capacity(), "wrapt": "wrapt" in sys.modules}))
        import sglang.srt  # a second sglang import says nothing more
    """, env={"NPU_SHIM_ENABLED": "0"})
    assert last_json(proc) == {"value": 1000, "wrapt": False}
    # said once, when the process imports sglang ...
    assert re.fullmatch(TAG + r" off \(NPU_SHIM_ENABLED=0\): sglang is not patched in this process",
                        proc.stderr.strip()), proc.stderr
    # ... and never by a process that does not import it
    quiet = run(tree, "import json, sys; print(json.dumps('npu_shim.runtime.activation' in sys.modules))",
                env={"NPU_SHIM_ENABLED": "0"})
    assert quiet.stderr == "" and last_json(quiet) is False


def test_per_patch_switch_disables_only_that_patch(tree):
    proc = run(tree, VALUE_AND_STATES, env={"NPU_SHIM_DUAL_STREAM": "off"})
    out = last_json(proc)
    assert out["value"] == 1000
    assert out["states"]["demo"]["state"] == "disabled"
    assert out["states"]["demo"]["reason"] == "NPU_SHIM_DUAL_STREAM=0"


@pytest.mark.parametrize("name, value, message", [
    ("NPU_SHIM_ENABLED", "maybe",
     "shim off: NPU_SHIM_ENABLED='maybe' is invalid: expected a boolean: one of 1/0, true/false, yes/no, on/off"),
    ("NPU_SHIM_DUAL_STREAM", "maybe",
     "demo: failed (NPU_SHIM_DUAL_STREAM='maybe' is invalid: expected a boolean"),
    ("SGLANG_ZBAL_LOCAL_MEM_SIZE", "12GB",
     "demo: failed (SGLANG_ZBAL_LOCAL_MEM_SIZE='12GB' is invalid: expected a whole number of MiB, "
     "e.g. 12288 for 12 GiB (no unit suffix; ASCII digits))"),
    ("SGLANG_ZBAL_LOCAL_MEM_SIZE", "-5",
     "demo: failed (SGLANG_ZBAL_LOCAL_MEM_SIZE='-5' is invalid: expected a whole number of MiB >= 0"),
    ("NPU_SHIM_LOG_LEVEL", "LOUD",
     "NPU_SHIM_LOG_LEVEL='LOUD' is invalid: expected one of DEBUG, INFO, WARNING, ERROR (using INFO)"),
])
def test_bad_env_values_give_one_clear_message(tree, name, value, message):
    proc = run(tree, "import sglang.srt.utils; print('imported')", env={name: value})
    assert proc.stdout.strip() == "imported"
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.count(message.split(" (")[0]) == 1  # the summary line says "demo=failed"


def test_bad_bootstrap_url_message():
    from npu_shim.core import config

    with pytest.raises(config.ConfigError) as info:
        zbal_patch.BOOTSTRAP_URL.read({"SGLANG_ZBAL_BOOTSTRAP_URL": "10.0.0.1:6789"})
    assert str(info.value) == ("SGLANG_ZBAL_BOOTSTRAP_URL='10.0.0.1:6789' is invalid: expected "
                               "tcp://HOST:PORT with a port in 1..65535, e.g. tcp://10.0.0.1:6789 "
                               "(HOST: a hostname, IPv4 or [IPv6] address; ASCII digits)")
    assert zbal_patch.BOOTSTRAP_URL.read({"SGLANG_ZBAL_BOOTSTRAP_URL": "tcp://10.0.0.1:6789"}) == \
        "tcp://10.0.0.1:6789"


def test_install_twice_is_a_no_op_and_uninstall_restores_originals_and_copies(tree):
    proc = run(tree, """
        import json, npu_shim
        from sglang.srt.utils import common, Scheduler
        from sglang.srt.utils import get_npu_memory_capacity as copy
        original_init = Scheduler.__dict__["__init__"]
        before = (common.get_npu_memory_capacity(), copy())
        again = npu_shim.install()
        npu_shim.uninstall()
        after = (common.get_npu_memory_capacity(), copy(), Scheduler.__dict__["__init__"] is original_init,
                 type(Scheduler.__dict__["__init__"]).__name__)
        print(json.dumps({"before": before, "again": again, "after": after, "states": npu_shim.states()}))
    """)
    out = last_json(proc)
    assert out["before"] == [1001, 1001]
    assert out["again"] is False
    assert out["after"] == [1000, 1000, False, "function"]
    assert out["states"] == {}


def test_programmatic_install_after_import_rebinds_from_import_copies(tree):
    proc = run(tree, """
        import json
        from sglang.srt.utils import get_npu_memory_capacity as early_copy
        import sglang.srt.utils as utils_pkg
        before = early_copy()
        import npu_shim
        first = npu_shim.install()
        second = npu_shim.install()
        from sglang.srt.utils import get_npu_memory_capacity as late_copy
        result = {"before": before, "first": first, "second": second,
                  "early": early_copy(), "pkg": utils_pkg.get_npu_memory_capacity(), "late": late_copy()}
        npu_shim.uninstall()
        result["restored"] = [early_copy(), utils_pkg.get_npu_memory_capacity(), late_copy()]
        print(json.dumps(result))
    """, shim=False)
    out = last_json(proc)
    assert out == {"before": 1000, "first": True, "second": False, "early": 1001, "pkg": 1001,
                   "late": 1001, "restored": [1000, 1000, 1000]}


def test_multiprocessing_spawn_child_is_patched(tree):
    script = tree / "image" / "spawn_main.py"
    script.write_text(textwrap.dedent("""
        import json, multiprocessing as mp

        def child(queue):
            from sglang.srt.utils import get_npu_memory_capacity
            import npu_shim
            queue.put((get_npu_memory_capacity(), npu_shim.states()["demo"]["state"]))

        if __name__ == "__main__":
            ctx = mp.get_context("spawn")
            queue = ctx.Queue()
            proc = ctx.Process(target=child, args=(queue,))
            proc.start()
            print(json.dumps(queue.get(timeout=60)))
            proc.join()
    """))
    proc = run(tree, "import runpy; runpy.run_path(%r, run_name='__main__')" % str(script))
    assert last_json(proc) == [1001, "applied"]


def test_status_without_sglang(tree):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NPU_SHIM_", "SGLANG_"))}
    env["PYTHONPATH"] = REPO
    proc = subprocess.run([sys.executable, "-m", "npu_shim", "status", "--json"], cwd=str(tree),
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 5, proc.stderr  # its own exit code: a gate must not pass here
    info = json.loads(proc.stdout)
    assert info["sglang"] == {"path": None, "version": None}
    assert info["sitecustomize_active"] is True and info["master_switch"] is True
    assert {p["name"]: p["state"] for p in info["patches"]} == {
        "zbal": "unsupported", "mla_weight_release": "unsupported", "dual_stream_experts": "unsupported"}
    assert all(p["reason"] == "sglang not found" for p in info["patches"])


def test_status_reports_invalid_env_with_exit_code_2(tree):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NPU_SHIM_", "SGLANG_"))}
    env.update(PYTHONPATH=REPO, SGLANG_ZBAL_LOCAL_MEM_SIZE="12GB")
    proc = subprocess.run([sys.executable, "-m", "npu_shim", "status"], cwd=str(tree), env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "SGLANG_ZBAL_LOCAL_MEM_SIZE     INVALID: SGLANG_ZBAL_LOCAL_MEM_SIZE='12GB' is invalid" in proc.stdout


def test_env_command_lists_every_variable():
    proc = subprocess.run([sys.executable, "-m", "npu_shim", "env"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0
    for var in all_variables():
        assert var.name in proc.stdout and var.doc in proc.stdout


def test_children_decide_from_the_source_as_the_parent_does(tree):
    """The processes the launcher starts (spawn: a fresh interpreter that inherits the environment)
    read sglang's source themselves and reach the parent's states; the parent's deciding adds
    nothing to the environment they inherit, and a file changed since is read as it is now."""
    proc = run(tree, """
        import json, os, subprocess, sys
        before = {k: v for k, v in os.environ.items() if k.startswith("NPU_SHIM_")}
        from sglang.srt.utils import common
        from npu_shim.runtime import activation
        after = {k: v for k, v in os.environ.items() if k.startswith("NPU_SHIM_")}
        child = ("import json, sys; from sglang.srt.utils import common; from npu_shim.runtime import activation; "
                 "print(json.dumps([activation.RUNTIME.states()['demo']['state'], "
                 "'npu_shim.source.codeview' in sys.modules]))")
        first = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True).stdout
        os.utime(common.__file__)  # the file changed (as far as anyone can tell)
        second = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True).stdout
        print(json.dumps({"parent": activation.RUNTIME.states()["demo"]["state"], "env": before == after,
                          "first": json.loads(first), "second": json.loads(second)}))
    """)
    out = last_json(proc)
    assert out["parent"] == "applied" and out["env"] is True
    assert out["first"][0] == out["second"][0] == "applied"
    assert out["first"][1] is True and out["second"][1] is True  # each child read the source itself
