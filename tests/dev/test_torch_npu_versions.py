"""docs/torch-npu-versions.md: the torch_npu of sglang's NPU images (2.8.0.post2 for 0.5.7-0.5.12,
2.10.0 for 0.5.13-0.5.19) against the 2.13.0 the simulated NPU is held to.

Each wheel is fetched once (``pip download --no-deps``, the test bed's cache) and read, never
loaded: its Python files with ``ast`` (the reader of tests/dev/test_simnpu_conformance.py), its
``libtorch_npu.so`` as bytes.  What is the same in the three versions is what the simulation's
2.13.0 answers may stand for; every difference the page lists is held here in both directions.
"""
from __future__ import annotations

import ast
import re
import zipfile
from pathlib import Path

import pytest

from shimdev.envs import releases, wheels
from shimdev.simnpu import _device

from test_simnpu_conformance import Namespace, _constructor, _real_params

IMAGES = {"2.8.0.post2": ("0.5.7", "0.5.12.post1"), "2.10.0": ("0.5.13", "0.5.19")}
PIN = wheels.TORCH_NPU_PIN.split("==")[1]
VERSIONS = tuple(IMAGES) + (PIN,)
PAGE = Path(__file__).resolve().parents[2] / "docs" / "torch-npu-versions.md"


def _wheel(version):
    if version == PIN:
        return wheels.ensure_torch_npu_wheel()
    return wheels.ensure_pinned_wheel("torch-npu==%s" % version, "torch-npu")


@pytest.fixture(scope="module")
def unpacked(tmp_path_factory):
    """{version: (Namespace of its torch_npu/npu, libtorch_npu.so bytes, root)}."""
    out = {}
    for version in VERSIONS:
        try:
            wheel = _wheel(version)
        except wheels.EnvError as e:
            pytest.fail("cannot get the torch-npu %s wheel: %s" % (version, e), pytrace=False)
        root = tmp_path_factory.mktemp("torch-npu-%s" % version)
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(root, [m for m in zf.namelist() if m.startswith("torch_npu/npu/") and m.endswith(".py")])
            library = zf.read("torch_npu/lib/libtorch_npu.so")
        out[version] = (Namespace(root), library, root / "torch_npu" / "npu")
    return out


def _params(ns, module, name):
    found = ns.names(module).get(name)
    assert found not in (None, "submodule") and found[1] is not None, name
    node = found[1]
    if isinstance(node, ast.ClassDef):
        node = _constructor(node)
    return _real_params(node) if isinstance(node, ast.FunctionDef) else None


def _class(root, name, module="graphs"):
    tree = ast.parse((root / ("%s.py" % module)).read_bytes())
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)


def _method(root, cls, name, module="graphs"):
    return next(f for f in _class(root, cls, module).body if isinstance(f, ast.FunctionDef) and f.name == name)


def _calls(node):
    return {ast.unparse(c.func) for c in ast.walk(node) if isinstance(c, ast.Call)}


# -- the pairing ---------------------------------------------------------------------------------

def test_the_page_pairs_every_release_from_0_5_7_to_0_5_19_with_one_torch_npu():
    text = PAGE.read_text()
    rows = [line for line in text.splitlines() if re.match(r"\| 0\.5\.\d", line)]
    covered = {}
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        first, _, last = cells[0].partition(" – ")
        names = [n.strip() for n in first.split(",")]
        low, high = releases.version_key(names[0]), releases.version_key(last or names[-1])
        listed = [r for r in releases.ALL_RELEASES if low <= releases.version_key(r) <= high]
        torch_npu = re.search(r"2\.\d+\.\d+(?:\.post\d+)?", cells[4]).group(0)
        for release in listed:
            assert release not in covered, release
            covered[release] = torch_npu
    wanted = [r for r in releases.ALL_RELEASES if releases.version_key(r) <= releases.version_key("0.5.19")]
    assert sorted(covered, key=releases.version_key) == wanted
    for version, (low, high) in IMAGES.items():  # the versions this test reads are the page's
        for release in wanted:
            if releases.version_key(low) <= releases.version_key(release) <= releases.version_key(high) \
                    and release not in ("0.5.7", "0.5.8", "0.5.8.post1"):
                assert covered[release] == version, release


# -- the same in every image ---------------------------------------------------------------------

#: The names the simulation implements (2.13.0's) that an image's torch_npu lacks or calls otherwise;
#: none is called by the shim or by sglang's NPU path (test_names_absent_... below, and the page).
DIFFERENT = {
    "2.8.0.post2": {("__init__", "MemPool"): "params", ("memory", "MemPool"): "params",
                    ("__init__", "host_empty_cache"): "absent", ("memory", "host_empty_cache"): "absent",
                    ("__init__", "set_task_queue_enable"): "absent", ("__init__", "get_task_queue_enable"): "absent"},
    "2.10.0": {("__init__", "MemPool"): "params", ("memory", "MemPool"): "params",
               ("__init__", "set_task_queue_enable"): "absent", ("__init__", "get_task_queue_enable"): "absent"},
}


def test_every_name_the_simulation_implements_has_the_same_parameters_in_each_image_but_those_listed(unpacked):
    pinned = unpacked[PIN][0]
    for version in IMAGES:
        ns = unpacked[version][0]
        found = {}
        for module, names in (("__init__", _device.NPU_NAMES), ("memory", _device.MEMORY_NAMES)):
            for name in names:
                if name not in ns.names(module):
                    found[(module, name)] = "absent"
                elif _params(ns, module, name) != _params(pinned, module, name):
                    found[(module, name)] = "params"
        listed = {key: why for key, why in DIFFERENT[version].items() if key[1] in (
            _device.NPU_NAMES if key[0] == "__init__" else _device.MEMORY_NAMES)}
        assert found == listed, version


def test_mempool_takes_only_an_allocator_in_the_images(unpacked):
    for version in VERSIONS:
        params = [n for n, _k, _d in _params(unpacked[version][0], "memory", "MemPool")]
        assert params == (["self", "allocator", "use_on_oom", "no_split"] if version == PIN else ["self", "allocator"])


GRAPH_API = ("NPUGraph", "graph", "graph_pool_handle", "is_current_stream_capturing")


def test_the_graph_api_sglang_calls_is_the_same_in_each_image(unpacked):
    for version in VERSIONS:
        ns, _library, root = unpacked[version]
        assert set(GRAPH_API) <= ns.public("__init__"), version
        graph = _real_params(_constructor(_class(root, "graph")))
        assert [(n, d) for n, _k, d in graph[1:]] == [
            ("npu_graph", graph[1][2]), ("pool", None), ("stream", None), ("auto_dispatch_capture", False),
            ("capture_error_mode", "global")], version
        begin = _real_params(_method(root, "NPUGraph", "capture_begin"))
        assert [(n, d) for n, _k, d in begin[1:]] == [("pool", None), ("capture_error_mode", "global")], version
        methods = {f.name for f in _class(root, "NPUGraph").body if isinstance(f, ast.FunctionDef)}
        assert {"capture_begin", "capture_end", "replay", "reset", "update"} <= methods, version
        # one dict for every recorded op: what sglang's runners pass
        update = ast.unparse(_method(root, "_GraphDispatchMode", "update_capture_record"))
        assert "if len(cpu_update_input) == 1:" in update, version


DECODE_OPS = ("npu_fused_infer_attention_score", "npu_fused_infer_attention_score.out",
              "_npu_paged_attention.default", "npu_multi_head_latent_attention.out")


def _handled_ops(root):
    """The op names whose calls a capture with auto_dispatch_capture records for update."""
    handlers = root / "_npugraph_handlers"
    if handlers.is_dir():
        names = set()
        for path in handlers.glob("*.py"):
            for node in ast.walk(ast.parse(path.read_bytes())):
                if isinstance(node, ast.Call) and ast.unparse(node.func) == "register_npu_graph_handler" \
                        and node.args and isinstance(node.args[0], ast.List):
                    names.update(ast.literal_eval(node.args[0]))
        return names
    dispatch = _method(root, "_GraphDispatchMode", "__torch_dispatch__")
    names = set()
    for node in ast.walk(dispatch):
        if isinstance(node, ast.Compare) and isinstance(node.comparators[0], ast.List):
            names.update(ast.literal_eval(node.comparators[0]))
    return names


def test_the_ops_sglang_s_decode_records_for_update_are_handled_in_each_image(unpacked):
    handled = {v: _handled_ops(unpacked[v][2]) for v in VERSIONS}
    for version, names in handled.items():
        assert set(DECODE_OPS) <= names, (version, set(DECODE_OPS) - names)
    # the only additions after the images' versions: FlashAttention-3's handlers
    assert handled["2.8.0.post2"] <= handled["2.10.0"] == handled[PIN] - {
        n for n in handled[PIN] if "fusion_attention" in n or "flash_attention" in n or "fa3" in n.lower()}
    assert handled[PIN] - handled["2.10.0"], "2.13.0's FA3 handlers are not found"


REFUSALS = (b"Do not support TASK_QUEUE_ENABLE = 2 during NPU graph capture",
            b"This NPUGraph instance already owns a captured graph",
            b"NPU graphs must be captured on a non-default stream",
            b"Capture must end on the same stream it began on.",
            b"Called NPUGraph::replay without a preceding successful capture.",
            b"Cannot run aclop operators during NPU graph capture",
            b"during NPU graph capture. If you need this call to be captured, please file an issue.",
            b"The current graph configuration does not support update")


def test_the_capture_refusals_are_the_same_in_each_image(unpacked):
    for version in VERSIONS:
        library = unpacked[version][1]
        missing = [m for m in REFUSALS if m not in library and m not in _python_text(unpacked[version][2])]
        assert missing == [], (version, missing)


def _python_text(root):
    return b"".join(p.read_bytes() for p in root.rglob("*.py"))


# -- the differences, each in both directions -----------------------------------------------------

def test_only_2_13_0_empties_the_host_cache_when_a_capture_begins(unpacked):
    for version in VERSIONS:
        calls = _calls(_method(unpacked[version][2], "graph", "__enter__"))
        assert "torch.npu.synchronize" in calls and "torch.npu.empty_cache" in calls, version
        assert ("torch_npu.npu.host_empty_cache" in calls) == (version == PIN), version
    assert "host_empty_cache" not in unpacked["2.8.0.post2"][0].public("__init__")
    assert "host_empty_cache" in unpacked["2.10.0"][0].public("__init__")


def test_only_2_13_0_refuses_a_mempool_under_a_pluggable_allocator(unpacked):
    for version in VERSIONS:
        library = unpacked[version][1]
        assert (b" does not yet support createOrIncrefPool." in library) == (version == PIN), version
    assert {"MemPoolContext" in unpacked[v][0].public("__init__") for v in IMAGES} == {True}
    assert "MemPoolContext" not in unpacked[PIN][0].public("__init__")


def test_only_2_13_0_names_a_stream_that_never_joined_the_capture(unpacked):
    for version in VERSIONS:
        found = b"Did you use a stream without making it depend upon the original stream used for capture?" \
            in unpacked[version][1]
        assert found == (version == PIN), version


def test_2_8_0_post2_makes_a_new_generator_in_a_capture_and_spells_the_seed_refusal_otherwise(unpacked):
    """From 2.10.0 on NPUGeneratorImpl's constructor calls assertNotCapturing("Cannot construct a new
    NPUGeneratorImpl"), a string the compiler builds from pieces (test_simnpu_conformance.py's
    BUILT_MESSAGES); 2.8.0.post2's constructor calls nothing of the kind (objdump: the GeneratorImpl
    base, then the state) and its set_current_seed refusal reads "cann be called"."""
    from shimdev.simnpu import _graphs

    for version in VERSIONS:
        library = unpacked[version][1]
        built = b"Cannot construct" in library and b" a new NPUGenera" in library
        assert built == (version != "2.8.0.post2"), version
        assert (_graphs.MSG_SEED.encode() in library) == (version != "2.8.0.post2"), version
        misspelt = _graphs.MSG_SEED.replace(" can be ", " cann be ").encode()
        assert (misspelt in library) == (version == "2.8.0.post2"), version
        # clone_state's refusal is in all three
        assert all(p.encode() in library for p in ("Cannot call NPUG", "eneratorImpl::cl", "one_impl while i")), version


def test_2_8_0_post2_does_not_refuse_an_update_list_of_the_wrong_length(unpacked):
    for version in VERSIONS:
        text = ast.unparse(_method(unpacked[version][2], "_GraphDispatchMode", "update_capture_record"))
        self_compared = "len(self.graph_dispatch_records) != len(self.graph_dispatch_records)" in text
        checked = "len(cpu_update_input) != len(self.graph_dispatch_records)" in text
        assert (self_compared, checked) == ((True, False) if version == "2.8.0.post2" else (False, True)), version


def test_names_absent_from_the_images_are_ones_the_shim_does_not_call(unpacked):
    import npu_shim

    pinned = unpacked[PIN][0].public("__init__")
    absent = {v: pinned - unpacked[v][0].public("__init__") for v in IMAGES}
    assert {"set_task_queue_enable", "get_task_queue_enable", "ExternalStream"} <= absent["2.10.0"]
    assert absent["2.10.0"] <= absent["2.8.0.post2"]
    assert {"host_empty_cache", "super_kernel_scope_begin", "super_kernel_scope_end"} <= absent["2.8.0.post2"]
    source = "\n".join(p.read_text() for p in Path(npu_shim.__file__).parent.rglob("*.py"))
    used = {name for name in absent["2.8.0.post2"] if re.search(r"\bnpu\.%s\b" % re.escape(name), source)}
    assert used == set()
