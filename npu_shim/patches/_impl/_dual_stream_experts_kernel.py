"""dual_stream_experts' kernel checks: whether the image's sgl-kernel-npu
``norm.split_qkv_rmsnorm_rope`` takes the call the fused decode path makes, read from the kernel's
``def`` -- from its file before anything is patched (``kernel_problem``: nothing is imported, so
``status`` runs it too) and from the loaded function at its first use (``load_kernel``).
npu_shim/patches/_impl/dual_stream_experts.py makes the call.

A helper of that implementation module, not a patch's: its name begins with ``_``, which no
patch's name can (``core.framework``), so ``Patch.implementation`` never mistakes it for one."""

import ast
import importlib
import importlib.util
import os

from npu_shim.source.reading import SourceError, parse_source, read_source, unwrap

KERNEL_MODULE = "sgl_kernel_npu.norm.split_qkv_rmsnorm_rope"
KERNEL_NAME = "split_qkv_rmsnorm_rope"

# How ``DualStreamExpertsState._forward_prepare_fused`` calls the kernel (as upstream 0.5.10): these parameters by
# position, then these by keyword.  sgl-kernel-npu's history of the function: 2025-11-19
# (input, sin, cos, q_weight, k_weight, q_hidden_size, ...), full rotation; 2025-12-26 today's
# order, full rotation; 2026-03-05 partial rotation (``rope_dim = sin.shape[-1]``); 2026-05-27
# ``is_neox_style=True`` appended.
KERNEL_POSITIONAL = ("input", "sin", "cos", "q_hidden_size", "kv_hidden_size", "head_dim")
KERNEL_KEYWORDS = ("eps", "q_weight", "k_weight", "q_bias", "k_bias")


def kernel_support(node, where):
    """(problem, partial) for the ``def`` of the kernel: problem is None when the fused path's call
    (KERNEL_POSITIONAL, KERNEL_KEYWORDS) binds as meant (each argument to the parameter of that
    name, every other parameter has a default); partial is True when it rotates only
    ``sin.shape[-1]`` dims of each head (partial rotary) rather than the whole head.  The decision
    and the call-time check both ask this."""
    args = node.args
    positional = [a.arg for a in args.posonlyargs + args.args]
    keywords = set(positional[len(args.posonlyargs):]) | {a.arg for a in args.kwonlyargs}
    for index, name in enumerate(KERNEL_POSITIONAL[1:], 1):
        if index >= len(positional) or positional[index] != name:
            found = positional[index] if index < len(positional) else "nothing"
            return ("%s: parameter %d is %s where the call passes %s (a kernel signature the shim "
                    "was not written for)" % (where, index + 1, found, name)), False
    for name in KERNEL_KEYWORDS:
        if name not in keywords or name in positional[:len(KERNEL_POSITIONAL)]:
            return "%s takes no keyword argument %s" % (where, name), False
    bound = set(positional[:len(KERNEL_POSITIONAL)]) | set(KERNEL_KEYWORDS)
    defaults = positional[len(positional) - len(args.defaults):] if args.defaults else []
    unbound = [a.arg for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is None]
    unbound += [name for name in positional if name not in bound and name not in defaults]
    if unbound:
        return "%s requires %s, which the call does not pass" % (where, ", ".join(unbound)), False
    return None, _reads_width_of(node, positional[1])


def _reads_width_of(node, name):
    """Whether the function reads ``<name>.shape[-1]`` (the rotary width, from sin)."""
    for sub in ast.walk(node):
        if (isinstance(sub, ast.Subscript) and isinstance(sub.value, ast.Attribute)
                and sub.value.attr == "shape" and isinstance(sub.value.value, ast.Name)
                and sub.value.value.id == name and _is_minus_one(sub.slice)):
            return True
    return False


def _is_minus_one(node):
    return (isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub)
            and isinstance(node.operand, ast.Constant) and node.operand.value == 1) or (
        isinstance(node, ast.Constant) and node.value == -1)


def loaded_kernel_support(kernel):
    """``kernel_support`` of the imported kernel, from the source it was loaded from."""
    import inspect
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(unwrap(kernel))))
    except (OSError, TypeError, SyntaxError) as exc:
        return "cannot read the source of the loaded %s to check its signature (%r)" % (
            KERNEL_NAME, exc), False
    node = tree.body[0] if tree.body else None
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return "the loaded %s is not a plain function" % KERNEL_NAME, False
    return kernel_support(node, "the loaded " + KERNEL_NAME)


def load_kernel():
    """(kernel, partial, None): the image's kernel, imported and found to take the fused path's
    call (``partial`` as ``kernel_support`` says), or (None, None, why not)."""
    try:
        kernel = getattr(importlib.import_module(KERNEL_MODULE), KERNEL_NAME)
    except Exception as exc:  # noqa: BLE001 - an image without it keeps the original path
        return None, None, "cannot import %s.%s: %r" % (KERNEL_MODULE, KERNEL_NAME, exc)
    problem, partial = loaded_kernel_support(kernel)
    if problem:
        return None, None, problem
    return kernel, partial, None


# -- kernel availability, decided before anything is patched -------------------------------------

class KernelProblem:
    """Why the fused path cannot be used (``text``; ``str()`` of it); ``absent``: the image has no
    such kernel (an older or no sgl-kernel-npu: nothing to do) rather than one the shim cannot
    call (unsupported)."""

    def __init__(self, text, absent=False):
        self.text = text
        self.absent = absent

    def __str__(self):
        return self.text

    def __repr__(self):
        return "KernelProblem(%r, absent=%r)" % (self.text, self.absent)


def _absent(text):
    return KernelProblem(text, absent=True)


def kernel_problem():
    """None when the image's sgl_kernel_npu provides a usable ``norm.split_qkv_rmsnorm_rope``,
    else why not (a KernelProblem).  A package on disk is read as text (nothing is imported:
    ``status`` runs it)."""
    try:
        top = importlib.util.find_spec("sgl_kernel_npu")
    except (ImportError, ValueError) as exc:
        return KernelProblem("sgl_kernel_npu cannot be located: %r" % (exc,))
    if top is None:
        return _absent("sgl_kernel_npu is not installed")
    for location in list(top.submodule_search_locations or []):
        if not os.path.isdir(location):
            continue
        path = os.path.join(location, "norm", KERNEL_NAME + ".py")
        if not os.path.isfile(path):
            return _absent("sgl_kernel_npu at %s has no norm/%s.py (an older sgl-kernel-npu)"
                           % (location, KERNEL_NAME))
        try:
            tree = parse_source(read_source(path), path)
        except (SourceError, OSError) as exc:
            return KernelProblem(str(exc))
        node = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == KERNEL_NAME),
                    None)
        if node is None:
            return _absent("%s defines no %s()" % (path, KERNEL_NAME))
        problem, partial = kernel_support(node, "%s %s()" % (path, KERNEL_NAME))
        if problem:
            return KernelProblem(problem)
        if not partial:
            return _absent("%s has no partial-rotary support (GLM-4.x rotates half of each head; "
                    "this kernel would rotate all of it)" % path)
        return None
    # Not a directory package (zip, or a finder of its own): ask the import system.
    try:
        spec = importlib.util.find_spec(KERNEL_MODULE)
    except (ImportError, ValueError, AttributeError):
        spec = None
    return None if spec is not None else _absent("sgl_kernel_npu has no norm.%s" % KERNEL_NAME)
