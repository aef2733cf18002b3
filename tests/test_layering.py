"""The package's rooms and the one way imports go between them.

Every module under ``npu_shim/`` (the vendored wrapt left out) is parsed with ``ast``; every
``import`` in it counts, those inside functions included (they run too, only later).  Layers,
lowest first -- a module may import its own layer and the ones below, never one above, and no
import may close a circle, inside a layer or across:

0. leaves: ``_version``, ``_paths`` (where the package is);
1. ``core``: the variables, the patch model and deciding, the registry (the patches' module names: a
   list), loading the registered patches;
2. ``reporting``: logging, process identity, sglang's metrics, the summary line, text for a terminal;
3. ``source``: reading sglang's code without importing it (view, fast scan);
4. ``runtime``: one process's activation, finder, wrapt, targets and wrappers, install();
5. ``patches``: the feature modules;
6. ``cli``: ``python -m npu_shim``'s commands;
7. the entry points: ``npu_shim`` (install/uninstall/states), ``__main__``, ``_bootstrap``.

A layer is made of whole rooms (sub-packages) and top-level modules, never of one module taken out
of a room that sits elsewhere.  A parent package is imported implicitly with its modules: that is
not counted, and every sub-package ``__init__`` must be empty (nothing loads with it; memory in
every sglang process).

Imports by string count too: ``importlib.import_module`` of a constant (or a module-level name
bound to one) is an import like any other.  A name built at run time is allowed only where this
file lists it (``BUILT_NAMES``): the plug-in loads of the registered patches (their modules by the
registry's names and the convention: ``core.loading``: the one import that goes up, by design,
and so in neither check) and imports of modules outside the package.
"""

import ast
import os

import pytest

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "npu_shim")
LAYERS = [
    ("npu_shim._version", "npu_shim._paths"),
    ("npu_shim.core",),
    ("npu_shim.reporting",),
    ("npu_shim.source",),
    ("npu_shim.runtime",),
    ("npu_shim.patches",),
    ("npu_shim.cli",),
    ("npu_shim", "npu_shim.__main__", "npu_shim._bootstrap"),
]
SUBPACKAGES = ("core", "reporting", "source", "runtime", "patches", "cli")


def modules():
    """{dotted name: path} of every module of the package (not the vendored wrapt)."""
    found = {}
    for folder, dirs, files in os.walk(PACKAGE):
        dirs[:] = sorted(d for d in dirs if d not in ("_vendor", "__pycache__"))
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path[:-3], os.path.dirname(PACKAGE)).replace(os.sep, ".")
                found[dotted[:-len(".__init__")] if dotted.endswith(".__init__") else dotted] = path
    return found


# (module, function) that import a module whose name is built at run time, and what they import.
PLUGIN_LOADS = {("npu_shim.core.loading", "load"), ("npu_shim.core.loading", "selftest_step")}
BUILT_NAMES = PLUGIN_LOADS | {
    ("npu_shim.cli.check", "import_target_modules"),        # sglang's modules the patches target
    ("npu_shim.runtime.wrapt_loader", "_c_wrappers"),       # wrapt's, under its private name
    ("npu_shim.runtime.wrapt_loader", "_load_private"),
}


def _constants(tree):
    """{module-level name: string} of a module's constant assignments."""
    return {target.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
            for target in node.targets if isinstance(target, ast.Name)}


def string_imports(tree):
    """([module names imported by constant string], [function importing a name built at run time])."""
    constants, named, built = _constants(tree), [], []
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and node.args and (
                (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                or (isinstance(node.func, ast.Name) and node.func.id in ("import_module", "__import__")))):
            continue
        arg = node.args[0]
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            named.append(arg.value)
        elif isinstance(arg, ast.Name) and arg.id in constants:
            named.append(constants[arg.id])
        else:
            inside = [f.name for f in functions if f.lineno <= node.lineno <= (f.end_lineno or f.lineno)]
            built.append(inside[-1] if inside else "<module>")
    return named, built


def imports_of(name, path, known):
    """The package's modules ``name`` imports (anywhere in it, by a constant string too), each once."""
    with open(path, encoding="utf-8") as handle:
        tree = ast.parse(handle.read(), path)
    is_package = path.endswith("__init__.py")
    targets = set()
    named, _built = string_imports(tree)
    for dotted in named:
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        if dotted and dotted != name:
            targets.add(dotted)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            wanted = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")[:None if is_package else -1]
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            wanted = ["%s.%s" % (base, alias.name) for alias in node.names] + [base]
            # "from pkg import module" imports the module; "from module import name" the module
            wanted = [w for w in wanted[:-1] if w in known] or [wanted[-1]]
        else:
            continue
        for target in wanted:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                targets.add(target)
    return targets


def layer_of(name):
    best = None
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if name == prefix or (name.startswith(prefix + ".") and prefix != "npu_shim"):
                if best is None or len(prefix) > best[1]:
                    best = (index, len(prefix))
    return best[0] if best else None


def graph():
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def cycle_in(edges):
    """One import circle as a list of modules, or None."""
    state = {}

    def visit(node, stack):
        state[node] = "open"
        stack.append(node)
        for target in sorted(edges.get(node, ())):
            if state.get(target) == "open":
                return stack[stack.index(target):] + [target]
            if target not in state:
                found = visit(target, stack)
                if found:
                    return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(edges):
        if node not in state:
            found = visit(node, [])
            if found:
                return found
    return None


def test_every_module_has_a_layer():
    assert [name for name in modules() if layer_of(name) is None] == []


def test_no_import_goes_up_a_layer():
    wrong = sorted("%s (layer %d) imports %s (layer %d)" % (name, layer_of(name), target, layer_of(target))
                   for name, targets in graph().items() for target in targets
                   if layer_of(target) > layer_of(name))
    assert wrong == []


def test_no_import_circle():
    assert cycle_in(graph()) is None


def test_a_module_name_built_at_run_time_is_imported_only_where_listed():
    found = set()
    for name, path in modules().items():
        with open(path, encoding="utf-8") as handle:
            found |= {(name, function) for function in string_imports(ast.parse(handle.read(), path))[1]}
    assert found == BUILT_NAMES


def test_imports_by_string_are_seen():
    """A module imported by a dotted string (a constant, or a module-level name bound to one) is
    an import; a name built at run time is reported by the function that imports it."""
    tree = ast.parse('IMPL = "npu_shim.patches._impl.p"\n'
                     'def f():\n    import importlib\n    return importlib.import_module(IMPL)\n'
                     'def g(name):\n    return importlib.import_module("npu_shim." + name)\n')
    assert string_imports(tree) == (["npu_shim.patches._impl.p"], ["g"])


@pytest.mark.parametrize("sub", SUBPACKAGES)
def test_subpackage_inits_are_empty(sub):
    with open(os.path.join(PACKAGE, sub, "__init__.py"), encoding="utf-8") as handle:
        assert handle.read() == ""


def test_the_checks_see_a_circle_and_an_upward_import():
    """The checker itself: a circle through a function-level import is found."""
    assert cycle_in({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle_in({"a": {"b"}, "b": set()}) is None
    assert layer_of("npu_shim.core.config") < layer_of("npu_shim.reporting.log") < layer_of("npu_shim.cli.check")
    assert layer_of("npu_shim.core.registry") == layer_of("npu_shim.core.loading") < layer_of("npu_shim.patches.zbal")


def test_a_layer_holds_whole_rooms_and_top_level_modules():
    """No layer takes one module out of a room that sits elsewhere: the registry once sat in layer 0
    as ``patches.registry`` while ``patches`` was layer 5, so the core's imports of it went up in
    all but this list's say (it lives in ``core`` now)."""
    assert [prefix for prefixes in LAYERS for prefix in prefixes if prefix.count(".") > 1] == []
    rooms = ["npu_shim." + sub for sub in SUBPACKAGES]
    assert sorted(prefix for prefixes in LAYERS for prefix in prefixes if prefix in rooms) == sorted(rooms)
