"""Session fixtures shared by npu-shim's tests.

* the tests mirror the package: ``tests/<room>/test_<module>.py`` (``core``, ``reporting``, ``source``,
  ``runtime``, ``patches``, ``cli``), the dev tooling's own tests in ``tests/dev/``, the whole
  shim's (drop-in, bootstrap, hostile inputs, the layering) here.  The folders have no
  ``__init__.py``: each is put on sys.path, so a test module imports another's helpers by its
  name (``from test_bootstrap import run``) wherever it lives; names are unique across folders.
* ``dev/`` is put on sys.path: the dev tooling is imported as ``shimdev.<module>`` (simnpu,
  realsglang, ...; dev/shimdev/__init__.py); the zbal layer (memfabric-zbal 1.2.0's own Python
  files over the simulated native module, shimdev/simzbal) only by tests that want ``import zbal``
  (fixture ``zbal_pkg``).
* ``servers``: the qwen2 servers of tests/test_real_server.py (its ``Servers``), one bed per
  worker for the session, so that every module whose tests run in a release's group
  (``xdist_group("server-<release>")``) uses the same ones (tests/dev/test_simnpu_graphs.py's
  graphs-on server is the bed's ``off``).
* after every run, what it cost (shimdev.envs.suitecost): CPU seconds and sglang server starts per
  worker, any server configuration started twice, the tests that cost most.  The tests that start
  servers outside any xdist group are collected first: xdist hands the groups out first (the most
  tests first), then the single tests in collection order, so these long ones do not come last
  and leave the other worker idle; the tests that share a module-scoped fixture of their module
  run on one worker, which makes it once (``module_group``).
* ``release_venv(version)`` builds/reuses a release's layered environment through
  shimdev.envs.sglang_envs and returns the python that runs it; an environment that cannot be built
  FAILS the test (never skips).
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
DEV = TESTS.parent / "dev"
for _folder in [DEV, TESTS] + sorted(p for p in TESTS.iterdir() if p.is_dir() and p.name != "__pycache__"):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

from shimdev.envs import realsglang  # noqa: E402 - after dev/ is put on sys.path
from shimdev.envs import suitecost  # noqa: E402 - after dev/ is put on sys.path

try:  # the property tests' settings (hypothesis is in the runner venv, dev/shimdev/envs/runner.py)
    from hypothesis import HealthCheck, settings as _hypothesis_settings
except ImportError:  # a test that imports hypothesis then fails at its import, as it should
    pass
else:
    # No deadline (the cores are shared: a slow example is no bug) and no example database in the
    # working tree; every run draws new examples, so each run searches further.
    _hypothesis_settings.register_profile("npu-shim", deadline=None, database=None, max_examples=300,
                                          suppress_health_check=[HealthCheck.too_slow])
    _hypothesis_settings.load_profile("npu-shim")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "another_python: runs the shim's code in a Python other than the test's own (a release's, a "
        "bare venv's, one started with -S); mutation runs leave these out, as mutmut's mutants import mutmut "
        "and that Python has none (pyproject.toml [tool.mutmut])")


#: The files whose tests start sglang servers: those of them outside any xdist group go first.
SERVER_MODULES = ("test_real_server.py", "test_real_server_mla.py", "test_real_server_moe.py")
_COST_MARK = pytest.StashKey()
_COSTS = []


def module_group(item):
    """The xdist group of a test that takes a module-scoped fixture of its own module (a release's
    program run, a wheel unpacked, venvs made): ``module:<file>`` and the parameters of those
    fixtures, so that one worker makes each once -- handed out one by one, the module's tests went
    to both workers and each made it.  None where the test takes none, or has a group already.
    (No ``]`` or ``@`` in the name: xdist takes the group from after the last ``@`` of a test's id,
    and only where no ``]`` follows it.)"""
    if item.get_closest_marker("xdist_group") is not None:
        return None
    info = getattr(item, "_fixtureinfo", None)
    shared = sorted(name for name, defs in (info.name2fixturedefs.items() if info else ())
                    if defs and defs[-1].scope == "module" and defs[-1].baseid == item.nodeid.split("::")[0])
    if not shared:
        return None
    params = getattr(getattr(item, "callspec", None), "params", {})
    return "module:%s%s" % (item.nodeid.split("::")[0], "".join(
        ":%s=%s" % (name, re.sub(r"[^\w.-]", "_", str(params[name]))) for name in shared if name in params))


def group_ids(config, items):
    """Each grouped test's id with its group (``<id>@<group>``), where xdist's ``--dist loadgroup``
    runs: the scheduler reads the group from there, and xdist 3.8 writes it to ``_nodeid``, which
    pytest 9 no longer reads (a test's id is ``_id``) -- so no group reached the scheduler, and the
    tests of one release's servers ran on both workers, each starting the servers."""
    if not getattr(config.option, "loadgroup", False):
        return
    from _pytest.nodeid import coerce_node_id

    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})
        if names and hasattr(item, "_id") and "@" not in item.nodeid.rsplit("::", 1)[-1]:
            item._id = coerce_node_id("%s@%s" % (item.nodeid, "_".join(names)))


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """The tests that share a module-scoped fixture in one xdist group (``module_group``), every
    group in its tests' ids (``group_ids``); the server tests that no xdist group holds first, the
    rest in their order."""
    for item in items:
        group = module_group(item)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
    group_ids(config, items)
    first = [item for item in items
             if item.path.name in SERVER_MODULES and item.get_closest_marker("xdist_group") is None]
    if first:
        chosen = set(map(id, first))
        items[:] = first + [item for item in items if id(item) not in chosen]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item.stash[_COST_MARK] = suitecost.now()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if call.when == "teardown" and _COST_MARK in item.stash:
        report.user_properties.append((suitecost.PROPERTY, suitecost.since(item.stash[_COST_MARK])))
    return report


def pytest_runtest_logreport(report):
    if report.when == "teardown":
        node = getattr(report, "node", None)  # the xdist worker that ran it (on the controller)
        worker = node.gateway.id if node is not None else "main"
        _COSTS.extend((report.nodeid, worker, value) for name, value in report.user_properties
                      if name == suitecost.PROPERTY)


def pytest_terminal_summary(terminalreporter):
    if _COSTS and not hasattr(terminalreporter.config, "workerinput"):
        terminalreporter.write_sep("-", "cost: CPU seconds and sglang server starts (shimdev.envs.suitecost)")
        for line in suitecost.summary(_COSTS):
            terminalreporter.write_line(line)


@pytest.fixture(autouse=True)
def _environ_restored():
    """Each test leaves ``os.environ`` as it found it.  The shim writes to the environment by design
    (zbal's ``ZBAL_ENABLE_GRAPH``) and the servers the suite starts
    inherit this process's environment, so a variable one test's shim left behind would change what a
    later server in the same worker does."""
    saved = dict(os.environ)
    yield
    for name in [k for k in os.environ if k not in saved]:
        del os.environ[name]
    for name, value in saved.items():
        if os.environ.get(name) != value:
            os.environ[name] = value


@pytest.fixture(scope="session")
def release_venv():
    """Callable ``release_venv(version) -> Path`` of the release's python (built once per session)."""
    cache: dict[str, Path] = {}

    def get(version: str) -> Path:
        if version not in cache:
            try:
                cache[version] = realsglang.release_python(version)
            except realsglang.sglang_envs.EnvError as e:
                pytest.fail(f"could not provide the sglang {version} environment: {e}", pytrace=False)
        return cache[version]

    return get


@pytest.fixture(scope="session")
def servers(tmp_path_factory):
    """The qwen2 servers of tests/test_real_server.py's checks (its ``Servers``), started on first
    use and shared by every test of the worker; stopped at the end of the session."""
    from test_real_server import Servers

    bed = Servers(tmp_path_factory.mktemp("servers"))
    yield bed
    bed.stop_all()


@pytest.fixture(scope="session")
def wheel():
    """The unpacked torch-npu 2.13.0 wheel (the no-CANN layer; its C extension is never loaded):
    its root directory."""
    try:
        return realsglang.sglang_envs.ensure_torch_npu_layer()
    except realsglang.sglang_envs.EnvError as e:
        pytest.fail(f"cannot get the real torch-npu wheel: {e}", pytrace=False)


@pytest.fixture(scope="session")
def sim():
    """simnpu installed in this (outer) test process; state reset by ``simnpu_clean``."""
    from shimdev import simnpu

    if simnpu.installed() is None:
        simnpu.install()
    return simnpu


@pytest.fixture
def simnpu_clean(sim):
    sim.reset()
    yield sim
    sim.reset()


@pytest.fixture(scope="session")
def zbal_pkg(sim):
    """``zbal`` imported in this process (after simnpu): the wheel's Python files from the zbal
    layer, its native module the simulated one (``shimdev.simzbal`` drives it)."""
    import os

    try:
        layer = realsglang.sglang_envs.ensure_zbal_layer()
    except realsglang.sglang_envs.EnvError as e:
        pytest.fail(f"could not build the zbal layer: {e}", pytrace=False)
    if str(layer) not in sys.path:
        sys.path.insert(0, str(layer))
    os.environ.update(realsglang.sglang_envs.zbal_env(layer))
    import zbal

    assert Path(zbal.__file__).parent == layer / "zbal", f"'import zbal' did not give the layer's: {zbal!r}"
    return zbal


@pytest.fixture(scope="session")
def built_bundle(tmp_path_factory):
    """A bundle built once per test run by the real command (``python -m npu_shim bundle``, wrapt
    wheels from PyPI), shared by the xdist workers (their base temp dirs are siblings), or the one
    the test command built beside the first tests (shimdev.envs.testbundle)."""
    from shimdev.envs import testbundle

    shared = os.environ.get(testbundle.ENV)
    if shared:
        shared = Path(shared)
    else:
        shared = tmp_path_factory.getbasetemp()
        if os.environ.get("PYTEST_XDIST_WORKER"):
            shared = shared.parent
    out, error = testbundle.ensure(sys.executable, shared)
    if error:
        pytest.fail(error, pytrace=False)
    return out
