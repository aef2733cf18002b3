"""The simulated NPU (dev/shimdev/simnpu) is held to the real torch-npu 2.13.0.

The test command fetches the wheel (``wheels.ensure_torch_npu_wheel``) and unpacks it as the
no-CANN layer; its Python files are read here with ``ast``, its C extension is never loaded (it
needs CANN).  Checked against the wheel:

* names: ``torch_npu.npu`` and ``torch_npu.npu.memory`` as the wheel's ``__init__.py`` assembles them
  (its imports, star imports and definitions) are exactly the lists the simulation answers from
  (``simnpu/_api.py``); every name the simulation implements is one of them, with the real
  parameters (names, kinds, defaults); the public members of its Stream, Event and allocator
  classes exist on the real ones;
* behaviours whose source is Python: each row of ``PYTHON_RULES`` quotes the wheel's own code the
  simulated behaviour follows (the quote must be in that function), and the simulation is run to
  show the same behaviour;
* behaviours whose source is C++ (``C_RULES``): the source file in Ascend/pytorch is named, and the
  strings the C++ code registers or raises (a method name, an error message) must be in the wheel's
  ``libtorch_npu.so``.
"""
from __future__ import annotations

import ast
import inspect
import re
import warnings
from pathlib import Path

import pytest
import torch

from shimdev.simnpu import _api, _device

NPU_DIR = "torch_npu/npu"


@pytest.fixture(scope="module")
def library(wheel):
    return (wheel / "torch_npu" / "lib" / "libtorch_npu.so").read_bytes()


# -- reading the wheel's namespace ------------------------------------------------------------------

class Namespace:
    """The names a module of torch_npu.npu binds, each with the file and node that defines it."""

    def __init__(self, root: Path):
        self.root = root / NPU_DIR
        self._trees = {}

    def tree(self, module: str):
        if module not in self._trees:
            path = self.root / f"{module}.py"
            if not path.exists():
                path = self.root / module / "__init__.py"
            self._trees[module] = ast.parse(path.read_bytes()) if path.exists() else None
        return self._trees[module]

    @staticmethod
    def relative(module: str, sub: str) -> str:
        """The module ``from .sub import`` names, seen from ``module`` ("pkg/__init__" is a package)."""
        base = module.rpartition("/")[0]
        if module == "__init__" or module.endswith("/__init__"):
            base = module[:-len("__init__")].rstrip("/")
        return "/".join(p for p in (base, sub.replace(".", "/")) if p)

    def defined(self, module: str) -> dict:
        out = {}
        tree = self.tree(module)
        for node in tree.body if tree is not None else ():
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                out[node.name] = (module, node)
            elif isinstance(node, ast.Assign):
                out.update({t.id: (module, node) for t in node.targets if isinstance(t, ast.Name)})
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                out[node.target.id] = (module, node)
        return out

    def exported(self, module: str) -> list[str]:
        tree = self.tree(module)
        for node in tree.body if tree is not None else ():
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
                return list(ast.literal_eval(node.value))
        return [n for n in self.defined(module) if not n.startswith("_")]

    def names(self, module: str) -> dict:
        """{name: (defining module, node) or "submodule"} for everything ``module`` binds."""
        out = dict(self.defined(module))
        for node in self.tree(module).body:
            if not (isinstance(node, ast.ImportFrom) and node.level == 1):
                continue
            source = self.relative(module, node.module or "__init__")
            if node.module and module == "__init__":
                out[node.module.split(".")[0]] = "submodule"  # importing a submodule binds it
            for alias in node.names:
                if alias.name == "*":
                    out.update({n: self.resolve(source, n) for n in self.exported(source)})
                else:
                    out[alias.asname or alias.name] = self.resolve(source, alias.name)
        return out

    def resolve(self, module: str, name: str):
        """Follow ``from .x import name`` to the module that defines it."""
        here = self.defined(module)
        if name in here:
            return here[name]
        tree = self.tree(module)
        for node in tree.body if tree is not None else ():
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        return self.resolve(self.relative(module, node.module), alias.name)
        return (module, None)

    def public(self, module: str) -> set[str]:
        names = {n for n in self.names(module) if not n.startswith("_")}
        if module == "__init__":
            names.add("npugraph_ex")  # served by the module's __getattr__
        return names


@pytest.fixture(scope="module")
def real(wheel):
    return Namespace(wheel)


def real_node(real, module, name):
    found = real.names(module).get(name)
    assert found is not None, f"torch_npu.npu{'' if module == '__init__' else '.' + module} has no {name}"
    assert found != "submodule" and found[1] is not None, f"{name}: no definition found in the wheel"
    return found


def source_of(real, module, name) -> str:
    defining, node = real_node(real, module, name)
    text = (real.root / f"{defining}.py").read_text()
    return ast.get_source_segment(text, node)


# -- names --------------------------------------------------------------------------------------------

def test_the_simulation_answers_exactly_the_real_names(real):
    for module, listed in (("__init__", _api.NPU), ("memory", _api.MEMORY)):
        have = real.public(module)
        assert sorted(have - listed) == [], f"{module}: real names missing from simnpu/_api.py"
        assert sorted(listed - have) == [], f"{module}: simnpu/_api.py lists names torch_npu lacks"


def test_no_simulation_only_names(sim, real):
    """Every name in the simulated modules is one of torch_npu's (the private markers ``_sim_*``
    and ``__simnpu__`` aside; a private name must be one the wheel's module defines); anything
    else is an AttributeError, as there."""
    for module, listed, source in ((torch.npu, _api.NPU, "__init__"), (torch.npu.memory, _api.MEMORY, "memory")):
        names = {n for n in vars(module) if not n.startswith(("__", "_sim"))}
        private = {n for n in names if n.startswith("_")}
        assert sorted(names - private - listed) == [], f"{module.__name__}: simulation-only names"
        assert sorted(private - set(real.names(source))) == [], f"{module.__name__}: private names torch_npu lacks"


def _params(parameters) -> list[tuple]:
    return [(p.name, p.kind.name.replace("POSITIONAL_OR_KEYWORD", "POS"), p.default) for p in parameters]


def _real_params(node) -> list[tuple]:
    a = node.args
    defaults = [None] * (len(a.args) - len(a.defaults)) + [ast.literal_eval(d) for d in a.defaults]
    out = [(x.arg, "POS", inspect.Parameter.empty if d is None and i < len(a.args) - len(a.defaults) else d)
           for i, (x, d) in enumerate(zip(a.args, defaults))]
    if a.vararg:
        out.append((a.vararg.arg, "VAR_POSITIONAL", inspect.Parameter.empty))
    out += [(x.arg, "KEYWORD_ONLY", ast.literal_eval(d) if d is not None else inspect.Parameter.empty)
            for x, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg:
        out.append((a.kwarg.arg, "VAR_KEYWORD", inspect.Parameter.empty))
    return out


def _constructor(node: ast.ClassDef):
    return next((f for f in node.body if isinstance(f, ast.FunctionDef) and f.name in ("__new__", "__init__")), None)


@pytest.mark.parametrize("module, names", [("__init__", _device.NPU_NAMES), ("memory", _device.MEMORY_NAMES)])
def test_parameters_are_the_real_ones(sim, real, module, names):
    target = torch.npu if module == "__init__" else torch.npu.memory
    for name in names:
        _defining, node = real_node(real, module, name)
        ours = getattr(target, name)
        if isinstance(node, ast.ClassDef):
            node, ours = _constructor(node), ours.__dict__.get("__new__") or ours.__init__
        real_params, sim_params = _real_params(node), _params(inspect.signature(ours).parameters.values())
        if isinstance(node, ast.FunctionDef) and real_params and real_params[0][0] in ("self", "cls"):
            real_params, sim_params = real_params[1:], sim_params[1:]
        assert sim_params == real_params, f"{name}: parameters differ from torch_npu's"


#: Members of the C++ bases (torch_npu/csrc/npu/Stream.cpp, Event.cpp; Module.cpp for the
#: allocator): each must be a string of libtorch_npu.so, or an attribute of torch's own base class.
CPP_MEMBERS = {"Stream": ("device", "npu_stream", "priority", "stream_id", "device_type", "device_index",
                          "query", "synchronize", "set_data_preprocess_stream"),
               "Event": ("npu_event", "query", "synchronize", "elapsed_time")}


@pytest.mark.parametrize("cls, base", [("Stream", torch.Stream), ("Event", None)])
def test_stream_and_event_members_exist_on_the_real_classes(real, library, cls, base):
    _defining, node = real_node(real, "__init__", cls)
    python = {f.name for f in node.body if isinstance(f, ast.FunctionDef)}
    ours = {n for n in dir(getattr(_device, cls)) if not n.startswith("_")}
    for name in ours - python:
        assert name in CPP_MEMBERS[cls], f"{cls}.{name} is neither Python nor C++ member of torch_npu's"
        assert name.encode() in library or hasattr(base, name), f"{cls}.{name} not found in the wheel"
    if cls == "Stream":  # so that Stream.wait_event(a_stream) raises
        assert "wait" not in python and not hasattr(torch.Stream, "wait") and "wait" not in ours


def test_allocator_setters_are_the_ones_torch_npu_binds(library):
    for name in _device.ALLOCATOR_SETTERS:
        assert name.encode() + b"\x00" in library, name


# -- behaviours ----------------------------------------------------------------------------------------

def _initialises(call) -> bool:
    from shimdev import simnpu

    simnpu.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        call(torch.npu)
    done = torch.npu.is_initialized()
    simnpu.reset()
    return done


#: (function, the wheel's code it follows, initialises the device?, how to call the simulation)
PYTHON_RULES = [
    ("__init__", "current_device", "torch_npu.npu._lazy_init()", True, lambda n: n.current_device()),
    ("__init__", "device", "torch_npu.npu._lazy_init()", True, lambda n: n.device(0).__enter__()),
    ("__init__", "device", "self.idx = _get_device_index(device, optional=True)", True, lambda n: n.device(None)),
    ("__init__", "synchronize", "torch_npu.npu._lazy_init()", True, lambda n: n.synchronize()),
    ("__init__", "current_stream", "torch_npu.npu._lazy_init()", True, lambda n: n.current_stream()),
    ("__init__", "mem_get_info", "device = torch_npu.npu.current_device()", True, lambda n: n.mem_get_info()),
    ("__init__", "init", "torch_npu.npu._lazy_init()", True, lambda n: n.init()),
    ("__init__", "Stream", "with torch_npu.npu.device(device):", True, lambda n: n.Stream()),
    ("__init__", "StreamContext", "self.idx = _get_device_index(None, True)", True, lambda n: n.stream(None)),
    ("memory", "empty_cache", "if is_initialized():", False, lambda n: n.empty_cache()),
    ("memory", "memory_stats_as_nested_dict", "if not is_initialized():\n        return {}", False,
     lambda n: n.memory_allocated()),
    ("__init__", "device_count", "if _initialized:", False, lambda n: n.device_count()),
    ("__init__", "get_device_capability", 'capability_env = os.getenv("TORCH_NPU_DEVICE_CAPABILITY")',
     False, lambda n: n.get_device_capability()),
]


@pytest.mark.parametrize("module, name, quote, initialises, call", PYTHON_RULES,
                         ids=[f"{r[1]}-{i}" for i, r in enumerate(PYTHON_RULES)])
def test_what_initialises_the_device_follows_the_wheel(sim, real, module, name, quote, initialises, call):
    assert quote in source_of(real, module, name), f"torch_npu's {name} no longer reads as quoted"
    assert _initialises(call) is initialises


def test_wait_event_hands_the_argument_its_own_wait(sim, real):
    stream_class = source_of(real, "__init__", "Stream")
    assert "def wait_event(self, event):" in stream_class and "event.wait(self)" in stream_class
    with pytest.raises(AttributeError, match="has no attribute 'wait'"):
        torch.npu.current_stream().wait_event(torch.npu.Stream())


def test_get_device_capability_is_none_unless_configured(sim, real, monkeypatch):
    assert "return None" in source_of(real, "__init__", "get_device_capability")
    monkeypatch.delenv("TORCH_NPU_DEVICE_CAPABILITY", raising=False)
    with pytest.warns(UserWarning):
        assert torch.npu.get_device_capability() is None
    monkeypatch.setenv("TORCH_NPU_DEVICE_CAPABILITY", "8.0")
    assert torch.npu.get_device_capability() == (8, 0)


def test_pluggable_allocator_opens_the_library(sim, real):
    body = source_of(real, "memory", "NPUPluggableAllocator")
    for quote in ("ctypes.CDLL(path_to_so_file)", "getattr(allocator, alloc_fn_name)",
                  "getattr(allocator, free_fn_name)"):
        assert quote in body
    with pytest.raises(OSError):
        torch.npu.memory.NPUPluggableAllocator("/nonexistent/liballoc.so", "m", "f")


def test_version_is_the_wheel_s(sim, wheel):
    import torch_npu

    text = (wheel / "torch_npu" / "version.py").read_text()
    assert f"__version__ = '{torch_npu.__version__}'" in text


#: (what, the C++ source it follows, strings that code registers or raises, found in libtorch_npu.so)
C_RULES = [
    ("a second allocator swap", "torch_npu/csrc/npu/NPUPluggableAllocator.cpp: createCustomAllocator "
     "initialises the new allocator, changeCurrentAllocator refuses an initialised one",
     ("Can't swap an already initialized allocator", "_npu_customAllocator", "_npu_changeCurrentAllocator")),
    ("set_device initialises", "torch_npu/csrc/npu/Module.cpp: THNPModule_setDevice_wrap runs "
     "npu_lazy_init", ("_npu_setDevice",)),
    ("Stream keywords", "torch_npu/csrc/npu/Stream.cpp: THNPStream_pynew's kwlist", _device.STREAM_KEYWORDS),
    ("Stream.device is a torch.device", "torch_npu/csrc/npu/Stream.cpp: THNPStream_get_device returns "
     "THPDevice_New(...)", ("npu_stream",)),
    ("Stream.priority refuses", "torch_npu/csrc/npu/Stream.cpp: THNPStream_get_priority",
     ("NPU dose not support Stream.get_priority() currently.",)),
]


@pytest.mark.parametrize("what, source, strings", C_RULES, ids=[r[0] for r in C_RULES])
def test_cpp_behaviours_name_their_source(library, what, source, strings):
    assert source.startswith("torch_npu/csrc/")
    for text in strings:
        assert text.encode() in library, f"{what}: {text!r} is not in libtorch_npu.so ({source})"


# -- the operators of the server's dense path (simnpu/_ops/) ---------------------------------------

def test_npu_op_schemas_are_the_wheel_s(library):
    from shimdev.simnpu import _ops

    for name, schema in _ops.NPU_SCHEMAS.items():
        assert (name + schema).encode() in library, name


#: The tokens of those manglings (``S7_``, ``S8_``: substitutions of const Tensor& and Tensor& in
#: the functor's context).
_MANGLED = {"RKN2at6TensorE": "Tensor", "S7_": "Tensor", "RS5_": "Tensor(a!)", "S8_": "Tensor(a!)",
            "RKSt8optionalIS5_E": "Tensor?", "l": "int", "d": "float", "b": "bool"}


def _mangled_types(text):
    """The parameter types of one ``void(...)`` in the functor's mangling context."""
    out = []
    while text:
        for token, kind in _MANGLED.items():
            if text.startswith(token):
                out.append(kind)
                text = text[len(token):]
                break
        else:
            raise AssertionError("unknown mangled token at %r" % text)
    return out


def _schema_types(schema):
    args = schema[1:schema.index(") ->")].split(", ")
    return [re.sub(r"\((?:a|b)!\)", "(a!)", a.split()[0]) for a in args if a != "*"]


def test_atb_op_argument_types_are_those_of_the_cpp_functions_torch_npu_registers(wheel):
    """libop_plugin_atb.so assembles its schema strings at run time; what it holds whole is the
    C++ function each registration wraps (``WrapFunctionIntoFunctor_<void(...), &atb::name>``)."""
    from shimdev.simnpu import _ops

    atb = (wheel / "torch_npu" / "lib" / "libop_plugin_atb.so").read_bytes().decode("latin-1")
    api = (wheel / "torch_npu" / "op_plugin" / "atb" / "_atb_ops.py").read_text()
    for name, schema in _ops.ATB_SCHEMAS.items():
        assert "'%s'," % name in api, name  # bound as torch_npu.<name> = torch.ops.atb.<name>
        match = re.search(r"CompileTimeFunctionPointerIFv(\w+?)EXadL_ZN3atb%d%sE" % (len(name), name), atb)
        assert match, name
        assert _mangled_types(match.group(1)) == _schema_types(schema), name


def test_the_custom_mla_prolog_v3_is_the_wheel_s_npu_op_less_its_dtype_arguments(library):
    """sglang 0.5.9 - 0.5.19 call ``torch.ops.custom.npu_mla_prolog_v3`` (the CANN custom-ops
    package's namespace, not torch_npu's); its schema is torch_npu 2.13.0's ``npu::`` one without the
    five trailing ``int? *_dtype`` arguments."""
    from shimdev.simnpu import _ops

    assert ("npu_mla_prolog_v3" + _ops.NPU_MLA_PROLOG_V3).encode() in library
    custom = _ops.CUSTOM_SCHEMAS["npu_mla_prolog_v3"]
    assert custom != _ops.NPU_MLA_PROLOG_V3
    assert custom == _ops.NPU_MLA_PROLOG_V3.replace(_ops._DTYPE_ARGS, "")
    assert custom.endswith("float kc_scale=1.0) -> (Tensor, Tensor, Tensor, Tensor, Tensor)")


def test_every_op_quotes_where_its_schema_is_from():
    from shimdev.simnpu import _ops

    for namespace, name, schema, source in _ops._schemas():
        assert source and ("2.13.0" in source or "sgl-kernel-npu" in source or "cann-recipes" in source), name


# -- NPU graphs (simnpu/_graphs.py) --------------------------------------------------------------------

#: Each message the simulated graphs raise as torch_npu does: (constant, where it is in the wheel).
GRAPH_MESSAGES = [
    ("MSG_DEFAULT_STREAM", "lib"), ("MSG_ALREADY_CAPTURED", "lib"), ("MSG_TASK_QUEUE", "lib"),
    ("MSG_END_STREAM", "lib"), ("MSG_REPLAY", "lib"), ("MSG_POOL", "lib"), ("MSG_UNJOINED", "lib"),
    ("MSG_SEED", "lib"), ("MSG_ACLOP", "lib"), ("MSG_CAPTURE_MODE", "lib"), ("MSG_TASK_QUEUE_VALUE", "lib"),
    ("MSG_UPDATE", "graphs"), ("MSG_SET_TASK_QUEUE", "utils"),
    ("MSG_NOT_CAPTURING", "lib"), ("CAPTURE_STATUS_ACTIVE", "lib"), ("MSG_GENERATOR_DEVICE", "lib"),
]


def _python_strings(path):
    """Every string constant of a Python file (adjacent literals joined, as Python joins them)."""
    return {n.value for n in ast.walk(ast.parse(path.read_bytes())) if isinstance(n, ast.Constant)
            and isinstance(n.value, str)}


@pytest.mark.parametrize("name, where", GRAPH_MESSAGES, ids=[m[0] for m in GRAPH_MESSAGES])
def test_graph_messages_are_the_wheel_s(wheel, library, name, where):
    from shimdev.simnpu import _graphs

    text = getattr(_graphs, name)
    if where == "lib":
        assert text.encode() in library, f"{name}: {text!r} is not in libtorch_npu.so"
    else:
        assert text in _python_strings(wheel / NPU_DIR / f"{where}.py"), f"{name} is not in {where}.py"


#: Messages the compiler builds at run time rather than keeping whole: the std::string handed to
#: ``assertNotCapturing`` is stored with 16-byte SSE constants (``movdqa`` from .rodata.cst16) and,
#: for a tail under 16 bytes, a ``movabs`` immediate (``48 ba`` + 8 bytes), pieces that may overlap
#: (objdump of the wheel's NPUGeneratorImpl constructor, 0x13d8b3a-0x13d8b72, and of clone_impl:
#: length 0x27 and 0x3e).  (constant, [(offset, piece, how it is stored)]).
BUILT_MESSAGES = [
    ("MSG_NEW_GENERATOR", [(0, "Cannot construct", "const16"), (16, " a new NPUGenera", "const16"),
                           (31, "atorImpl", "movabs")]),
    ("MSG_CLONE_GENERATOR", [(0, "Cannot call NPUG", "const16"), (16, "eneratorImpl::cl", "const16"),
                             (32, "one_impl while i", "const16"), (46, " in capture mode", "const16")]),
]


@pytest.mark.parametrize("name, pieces", BUILT_MESSAGES, ids=[m[0] for m in BUILT_MESSAGES])
def test_messages_built_from_pieces_are_the_wheel_s(library, name, pieces):
    from shimdev.simnpu import _graphs

    text = getattr(_graphs, name)
    covered = set()
    for offset, piece, stored in pieces:
        assert text[offset:offset + len(piece)] == piece, (name, offset, piece)
        needle = piece.encode() if stored == "const16" else b"\x48\xba" + piece.encode()
        assert needle in library, f"{name}: {piece!r} is not in libtorch_npu.so as a {stored}"
        covered.update(range(offset, offset + len(piece)))
    assert covered == set(range(len(text))), f"{name}: pieces do not cover the message"


def test_mempool_s_refusal_is_the_allocator_base_s_message_with_the_pluggable_name(library):
    """NPUAllocator::createOrIncrefPool: TORCH_CHECK(false, name(), " does not yet support ...")
    (NPUCachingAllocator.h); NPUPluggableAllocator's name() returns "pluggable"
    (NPUPluggableAllocator.cpp, tag v26.2.0-beta.1-pytorch2.13.0).  The text after the name is a
    string of libtorch_npu.so; "pluggable" is not found in the file as a string, so the name is held
    to the cited source only."""
    from shimdev.simnpu import _graphs

    name, _, rest = _graphs.MSG_MEMPOOL.partition(" ")
    assert name == "pluggable"
    assert (" " + rest).encode() in library


def test_the_graphs_module_answers_the_wheel_s_names(sim, real):
    exported = set(real.exported("graphs"))
    assert exported == set(_api.GRAPHS)
    assert set(_device.GRAPHS_NAMES) - {"_GraphDispatchMode"} <= exported
    assert "_GraphDispatchMode" in real.defined("graphs")
    assert torch.npu.graphs.NPUGraph is torch.npu.NPUGraph


def _methods(node):
    return {f.name: f for f in node.body if isinstance(f, ast.FunctionDef)}


def test_npugraph_s_methods_take_the_real_parameters(sim, real):
    from shimdev.simnpu import _graphs

    _defining, node = real_node(real, "__init__", "NPUGraph")
    real_methods = _methods(node)
    for name in ("capture_begin", "capture_end", "replay", "reset", "pool", "update"):
        ours = inspect.signature(getattr(_graphs.NPUGraph, name)).parameters.values()
        assert _params(ours) == _real_params(real_methods[name]), name
    for cls, names in (("ExternalEvent", ("record", "wait", "reset")),):
        _defining, node = real_node(real, "__init__", cls)
        for name in names:
            ours = inspect.signature(getattr(_graphs.ExternalEvent, name)).parameters.values()
            assert _params(ours) == _real_params(_methods(node)[name]), (cls, name)


def test_graph_enter_follows_the_wheel(sim, real):
    """graph.__enter__ synchronises, empties both caches, enters the stream and the dispatch mode,
    then capture_begin -- the simulation logs the same order."""
    from shimdev import simnpu

    enter = _methods(real_node(real, "__init__", "graph")[1])["__enter__"]
    body = ast.get_source_segment((real.root / "graphs.py").read_text(), enter)
    order = ["torch.npu.synchronize()", "torch.npu.empty_cache()", "torch_npu.npu.host_empty_cache()",
             "self.stream_ctx.__enter__()", "self.npu_graph.graph_dispatch_mode.__enter__()",
             "self.npu_graph.capture_begin("]
    positions = [body.index(quote) for quote in order]
    assert positions == sorted(positions)
    simnpu.reset()
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g, stream=torch.npu.Stream(), auto_dispatch_capture=True):
        assert g.graph_dispatch_mode._sim_entered
    kinds = [e[0] for e in simnpu.EVENTS if e[0] in ("synchronize", "empty_cache", "host_empty_cache",
                                                      "stream_enter", "capture_begin")]
    assert kinds == ["synchronize", "empty_cache", "host_empty_cache", "stream_enter", "capture_begin"]
    g.reset()
    simnpu.reset()


def _update_specs(wheel, filename, cls):
    tree = ast.parse((wheel / NPU_DIR / "_npugraph_handlers" / filename).read_bytes())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    for item in node.body:
        if isinstance(item, ast.Assign) and item.targets[0].id == "UPDATE_SPECS":
            return {k: [tuple(x) for x in v] for k, v in ast.literal_eval(item.value).items()}
    raise AssertionError(cls)


def test_the_update_handlers_are_the_wheel_s_for_the_simulated_ops(wheel):
    """The handlers' update specs are torch_npu's (for the ops the simulation defines: not
    ``npu_multi_head_latent_attention.out``, the v2 and FA3 ops); the ops each registers are."""
    from shimdev.simnpu import _graphs

    simple = _update_specs(wheel, "simple_handler.py", "_SimpleGraphHandler")
    ifa = _update_specs(wheel, "ifa_handler.py", "_IFAv1DefaultHandler")
    assert _graphs._SimpleGraphHandler.UPDATE_SPECS == {k: v for k, v in simple.items() if k.startswith("_npu_paged")}
    assert _graphs._IFAv1DefaultHandler.UPDATE_SPECS == ifa
    registered = {n for n, h in _graphs._NPU_GRAPH_OP_HANDLERS.items()}
    assert registered == {"_npu_paged_attention.default"} | set(ifa)
    source = (wheel / NPU_DIR / "_npugraph_handlers" / "ifa_handler.py").read_text()
    for quote in ("torch_npu._npu_fused_infer_attention_score_get_max_workspace(", "out_args = [args[0], args[2]]",
                  'kwargs["out"] = [output, softmax_lse]', "func_out = torch_npu.npu_fused_infer_attention_score.out"):
        assert quote in source, quote


def test_the_graph_only_op_schemas_are_the_wheel_s(library):
    from shimdev.simnpu import _ops

    for name, schema in _ops.GRAPH_SCHEMAS.items():
        assert (name + schema).encode() in library, name
    # .out's list of outputs carries no write annotation in the registered string
    assert "Tensor[] out)" in _ops.GRAPH_SCHEMAS["npu_fused_infer_attention_score.out"]


def test_pool_ids_and_hooks_follow_the_cpp(library):
    """MemPool::graph_pool_handle(true) gives (0, n), a capture without a pool (n, 0)
    (NPUGraph.cpp capture_begin); the hooks are the setters torch_npu binds."""
    for text in ("NPUGRAPH Capture begin done: model_ri=%p, capture_dev=%d, mempool_id=(%lu,%lu)",
                 "set_begin_allocate_to_pool", "set_end_allocate_to_pool_fn", "set_release_pool"):
        assert text.encode() in library
