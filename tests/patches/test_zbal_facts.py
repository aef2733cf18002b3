"""zbal's report, in this process: ``api_problems`` on zbal package trees written here (complete,
lacking names or parameters, unreadable files), ``ZbalReport.check_facts`` over them (package dir
and version as the reading helpers give them) and ``ZbalReport.summary`` of a record's details."""
import pytest

from npu_shim.core.framework import Details
from npu_shim.patches import zbal as zp
from npu_shim.source import reading

# A zbal package with the whole API, each name provided a different way (def, class, import,
# from-import, an alias, a dotted import), and zbal_init taking its keyword-only parameters too.
COMPLETE = {
    "__init__.py": (
        "from .zbal_module import zbal_init\n"
        "from .allocator import switch as switch_to_allocator\n"
        "import is_mix_alloc.native\n"
        "def mem_get_info():\n"
        "    return 0, 0\n"
        "class Config:\n"
        "    pass\n"),
    "zbal_buffer.py": "class Buffer:\n    pass\n",
    "zbal_module.py": (
        "def helper(a, b):\n"
        "    pass\n"
        "def zbal_init(world_size, device_id, rank_id, *, device_mem_size, ip_port=None):\n"
        "    return True\n"),
}


def write_package(root, files):
    root.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (root / name).write_text(text)
    return str(root)


def package(tmp_path, **changes):
    """COMPLETE with ``changes`` (file name, dots as underscores -> text; None: no such file)."""
    files = dict(COMPLETE)
    for key, text in changes.items():
        name = key.replace("_py", ".py")
        if text is None:
            files.pop(name)
        else:
            files[name] = text
    return write_package(tmp_path / "zbal", files)


# -- api_problems ----------------------------------------------------------------------------------

def test_a_complete_package_has_no_problems(tmp_path):
    assert zp.api_problems(package(tmp_path)) == []


def test_each_missing_name_is_named_with_its_file(tmp_path):
    init = ("import os.path\n"                     # binds 'os', nothing the API needs
            "Config = object\n"                    # an assignment does not count
            "def outer():\n"
            "    def zbal_init():\n"               # nested: not the module's
            "        pass\n"
            "from .m import is_mix_alloc as other\n"  # the alias is what is bound
            "def switch_to_allocator():\n"
            "    pass\n")
    assert zp.api_problems(package(tmp_path, __init___py=init, zbal_buffer_py="def buffer():\n    pass\n")) == [
        "__init__.py has no zbal_init", "__init__.py has no is_mix_alloc",
        "__init__.py has no mem_get_info", "__init__.py has no Config", "zbal_buffer.py has no Buffer"]


def test_a_dotted_import_binds_its_first_name(tmp_path):
    init = COMPLETE["__init__.py"].replace("import is_mix_alloc.native", "import native.is_mix_alloc")
    assert zp.api_problems(package(tmp_path, __init___py=init)) == ["__init__.py has no is_mix_alloc"]


def test_files_are_read_in_their_declared_encoding(tmp_path):
    root = package(tmp_path)
    text = "# -*- coding: latin-1 -*-\nNAME = '\u00e9'\n" + COMPLETE["__init__.py"]
    (tmp_path / "zbal" / "__init__.py").write_bytes(text.encode("latin-1"))
    assert zp.api_problems(root) == []


def test_unreadable_files_are_named_and_the_others_still_checked(tmp_path):
    assert zp.api_problems(package(tmp_path, __init___py="def (:\n", zbal_buffer_py="x = 1\n")) == [
        "__init__.py unreadable (SyntaxError)", "zbal_buffer.py has no Buffer"]
    assert zp.api_problems(package(tmp_path / "b", zbal_buffer_py=None)) == [
        "zbal_buffer.py unreadable (FileNotFoundError)"]
    root = package(tmp_path / "c", __init___py=None)
    (tmp_path / "c" / "zbal" / "__init__.py").mkdir()
    assert zp.api_problems(root) == ["__init__.py unreadable (IsADirectoryError)"]


@pytest.mark.parametrize("module, problems", [
    (None, ["zbal_module.py defines no readable zbal_init"]),
    ("def zbal_init(:\n", ["zbal_module.py defines no readable zbal_init"]),
    ("def other():\n    pass\n", ["zbal_module.py defines no readable zbal_init"]),
    ("class zbal_init:\n    pass\n", ["zbal_module.py defines no readable zbal_init"]),
    ("def zbal_init(world_size, device_id, rank_id, device_mem_size, ip_port):\n    pass\n", []),
    ("def zbal_init(world_size, device_id, device_mem_size, **kw):\n    pass\n",
     ["zbal_init has no parameter rank_id", "zbal_init has no parameter ip_port"]),
    ("def zbal_init(world_size, device_id, rank_id, device_mem_size, /, ip_port=None):\n    pass\n",
     ["zbal_init has no parameter world_size", "zbal_init has no parameter device_id",
      "zbal_init has no parameter rank_id", "zbal_init has no parameter device_mem_size"]),
    ("def zbal_init():\n    pass\n",
     ["zbal_init has no parameter %s" % p for p in zp.ZBAL_INIT_KWARGS]),
])
def test_zbal_init_and_its_parameters(tmp_path, module, problems):
    assert zp.api_problems(package(tmp_path, zbal_module_py=module)) == problems


def test_parameter_problems_follow_the_names_missing_before_them(tmp_path):
    module = "def zbal_init(world_size, device_id, rank_id, device_mem_size):\n    pass\n"
    assert zp.api_problems(package(tmp_path, zbal_buffer_py="", zbal_module_py=module)) == [
        "zbal_buffer.py has no Buffer", "zbal_init has no parameter ip_port"]


def test_problems_of_every_file_together(tmp_path):
    assert zp.api_problems(write_package(tmp_path / "zbal", {})) == [
        "__init__.py unreadable (FileNotFoundError)", "zbal_buffer.py unreadable (FileNotFoundError)",
        "zbal_module.py defines no readable zbal_init"]


# -- check_facts -----------------------------------------------------------------------------------

@pytest.fixture
def located(monkeypatch):
    """Where find_package_dir says zbal is (set by the test) and module_version's answers."""
    calls = []
    where = {"dir": None, "version": None}

    def find_package_dir(name):
        calls.append(("find", name))
        return where["dir"]

    def module_version(names, package_dir):
        calls.append(("version", names, package_dir))
        return where["version"]

    monkeypatch.setattr(reading, "find_package_dir", find_package_dir)
    monkeypatch.setattr(reading, "module_version", module_version)
    monkeypatch.delenv(zp.GRAPH_SWITCH, raising=False)
    where["calls"] = calls
    return where


def test_facts_without_zbal(located):
    assert zp.ZbalReport().check_facts() == {"zbal": {
        "label": "zbal", "found": False,
        "text": "not installed (needed only with SGLANG_ZBAL_LOCAL_MEM_SIZE)"}}
    assert located["calls"] == [("find", "zbal")]


def test_facts_of_a_complete_package(located, tmp_path):
    located["dir"], located["version"] = package(tmp_path), "1.2.0"
    assert zp.ZbalReport().check_facts() == {
        "zbal": {"label": "zbal", "found": True, "version": "1.2.0", "path": located["dir"],
                 "api_ok": True, "api_problems": [],
                 "text": "1.2.0 at %s: API as memfabric-zbal 1.1.2/1.2.0" % located["dir"]},
        "zbal_graphs": {"label": "zbal graphs", "hooks": True,
                        "text": "a server that captures NPU graphs: zbal pool hooks "
                                "(ZBAL_ENABLE_GRAPH=1 set by the shim)"}}
    assert located["calls"] == [("find", "zbal"),
                                ("version", ("memfabric-zbal", "memfabric_zbal"), located["dir"])]


def test_facts_of_a_package_whose_api_differs_and_graphs_switched_off(located, tmp_path, monkeypatch):
    located["dir"] = package(tmp_path, zbal_buffer_py="x = 1\n", zbal_module_py=None)
    monkeypatch.setenv(zp.GRAPH_SWITCH, "0")
    facts = zp.ZbalReport().check_facts()
    problems = ["zbal_buffer.py has no Buffer", "zbal_module.py defines no readable zbal_init"]
    assert facts == {
        "zbal": {"label": "zbal", "found": True, "version": None, "path": located["dir"],
                 "api_ok": False, "api_problems": problems,
                 "text": "unknown version at %s: API differs: %s" % (located["dir"], "; ".join(problems))},
        "zbal_graphs": {"label": "zbal graphs", "hooks": False,
                        "text": "a server that captures NPU graphs: unpooled (ZBAL_ENABLE_GRAPH=0 set "
                                "in the environment)"}}


def test_facts_with_the_operator_s_own_graph_switch(located, tmp_path, monkeypatch):
    located["dir"], located["version"] = package(tmp_path), "1.1.2"
    monkeypatch.setenv(zp.GRAPH_SWITCH, "1")
    assert zp.ZbalReport().check_facts()["zbal_graphs"] == {
        "label": "zbal graphs", "hooks": True,
        "text": "a server that captures NPU graphs: zbal pool hooks (ZBAL_ENABLE_GRAPH=1 set in the environment)"}


# -- summary ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("details, words", [
    ({"mode": "mix", "gva_mib": 49152}, ["mix", "49152 MiB"]),
    ({"mode": "full"}, ["full"]),
    ({"gva_mib": 0}, ["0 MiB"]),
    ({"mode": "", "gva_mib": 1}, ["1 MiB"]),
    ({"mode": 3, "gva_mib": -1}, []),
    ({"mode": "full", "gva_mib": True}, ["full"]),
    ({}, []),
])
def test_summary_words(details, words):
    assert zp.ZbalReport().summary(Details(details)) == words
