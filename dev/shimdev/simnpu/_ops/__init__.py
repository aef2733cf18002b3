"""torch_npu's operators on the paths of a real sglang server, in pure torch on the CPU: one module
per family (``schemas``; ``common``; ``dense``; ``dsa_mla``; ``attention``; ``speculative``;
``moe``; ``triton``), registered here.  Each op and table is named once, in its family module:
``kernel`` and ``_ops.<name>`` find it there (``lookup``).

Each is defined with ``torch.library`` under the schema torch_npu 2.13.0 registers, so sglang's
calls are parsed and checked as on a device (a wrong keyword, a missing argument or a tensor where
an int belongs fails here as there), in the namespace torch_npu registers it in:

* ``npu::`` -- the schemas are strings of the wheel's ``torch_npu/lib/libtorch_npu.so``, copied
  here verbatim (tests/dev/test_simnpu_conformance.py finds each one there);
* ``atb::`` -- registered by ``torch_npu/lib/libop_plugin_atb.so`` (``torch_npu/op_plugin/atb/
  _atb_ops.py`` lists the names and binds ``torch_npu.<name> = torch.ops.atb.<name>``).  That
  library assembles its schema strings at run time, so they are not in the file whole: the argument
  types here are those of the C++ function its registration names (the mangled
  ``atb::<name>(...)`` symbol, which the conformance test matches type for type) and the argument
  names are the ones sglang passes by keyword;
* ``custom::npu_mla_prolog_v3`` -- the CANN custom-ops package's namespace, which sglang 0.5.9 -
  0.5.19's mlaprolog path calls; its schema is torch_npu 2.13.0's ``npu::npu_mla_prolog_v3`` (a
  string of libtorch_npu.so, which the conformance test finds) less five trailing dtype arguments.
  sglang 0.5.20+ call the wheel's own ``torch_npu.npu_mla_prolog_v3`` (``npu::``, whole schema):
  one stand-in behind both;
* sgl-kernel-npu's ``npu::batch_matmul_transpose`` -- quoted from its ``csrc/pytorch_extensions.cpp``
  (no public wheel to hold it to).

The DSA decode path's stand-ins (DECLARED, custom::, sgl-kernel-npu's) are declared to the stream
sanitizer (``declare_kernel``) with the real op's schema: one launch each, writing only what the
schema marks ``(a!)`` (the prolog's two caches, ``batch_matmul_transpose``'s output).

What a kernel computes is the reference math of the op (float32 accumulation, the input's dtype
out); what it writes in place is what the schema marks ``(a!)``.
"""
from __future__ import annotations

import types

from . import attention, common, dense, dsa_mla, moe, schemas, speculative, triton
from .schemas import (ATB_SCHEMAS, CUSTOM_SCHEMAS, DECLARED, GRAPH_SCHEMAS, NPU_SCHEMAS, SANITIZER_WRITES,
                      SGL_KERNEL_NPU_SCHEMAS, SOURCES, WRITES_UNANNOTATED)

_MISSING = object()

#: The family modules, where each op and table is defined (and named) once.
FAMILIES = (schemas, common, dense, dsa_mla, attention, speculative, moe, triton)


def lookup(name):
    """The op, stand-in or table ``name`` of a family module: what ``kernel`` registers and what
    callers read as ``_ops.<name>`` (a name set on this package itself first, so a test's
    ``monkeypatch.setattr(_ops, ...)`` is seen)."""
    here = globals()
    if name in here:
        return here[name]
    for family in FAMILIES:
        found = vars(family).get(name, _MISSING)
        if found is not _MISSING and not isinstance(found, types.ModuleType) and name != "annotations":
            return found
    raise AttributeError("simnpu._ops has no op or table %r (in none of %s)" % (
        name, ", ".join(f.__name__.rsplit(".", 1)[-1] for f in FAMILIES)))


def __getattr__(name):
    """``_ops.<name>``: the family module's (``lookup``)."""
    if name.startswith("__"):
        raise AttributeError(name)
    return lookup(name)


def __dir__():
    names = set(globals())
    for family in FAMILIES:
        names.update(n for n, v in vars(family).items()
                     if not n.startswith("__") and n != "annotations" and not isinstance(v, types.ModuleType))
    return sorted(names)


_LIBRARIES = []  # kept alive: a torch.library.Library unregisters its ops when collected


def _schemas():
    """(namespace, name, schema, where the schema is from) of every op defined here."""
    out = [("npu", n, sc, SOURCES["npu"]) for n, sc in NPU_SCHEMAS.items()]
    out += [("atb", n, sc, "torch-npu 2.13.0 libop_plugin_atb.so") for n, sc in ATB_SCHEMAS.items()]
    out += [("custom", n, sc, SOURCES["custom"]) for n, sc in CUSTOM_SCHEMAS.items()]
    out += [("npu", n, sc, SOURCES["sgl_kernel_npu"]) for n, sc in SGL_KERNEL_NPU_SCHEMAS.items()]
    return out


def kernel(name, namespace=None):
    """The stand-in registered for ``name`` (in ``namespace``; the first one defining it when
    None): declared to the sanitizer where the op is one of DECLARED, a custom:: one (in either
    namespace: ``npu_mla_prolog_v3``) or sgl-kernel-npu's, with that namespace's schema of the
    real op and its source."""
    from .._sanitizer import declare_kernel

    if name in GRAPH_SCHEMAS:
        return _graph_kernel(name)
    wanted = namespace
    for namespace, op, schema, source in _schemas():
        if op == name and wanted in (None, namespace):
            fn = lookup(name)
            if name in DECLARED or name in CUSTOM_SCHEMAS or name in SGL_KERNEL_NPU_SCHEMAS:
                for index, written in enumerate(SANITIZER_WRITES.get(name, ())):
                    schema = schema.replace("Tensor %s," % written, "Tensor(%s!) %s," % (chr(97 + index), written))
                return declare_kernel(name + schema, source)(fn)
            return fn
    raise KeyError(name)


def define() -> None:
    """Define every op once in this process (``torch.ops.npu.*``, ``torch.ops.atb.*``,
    ``torch.ops.custom.*``)."""
    import torch

    libraries = {}
    for namespace, name, schema, _ in _schemas():
        if namespace not in libraries:
            libraries[namespace] = torch.library.Library(namespace, "FRAGMENT")
            _LIBRARIES.append(libraries[namespace])
        libraries[namespace].define(name + schema)
        libraries[namespace].impl(name, kernel(name, namespace), "CompositeExplicitAutograd")
    for name, schema in GRAPH_SCHEMAS.items():  # the graph-only block below
        libraries["npu"].define(name + schema)
        libraries["npu"].impl(name, kernel(name), "CompositeExplicitAutograd")


def torch_npu_names() -> dict:
    """What ``torch_npu.<name>`` is on a device: the op itself, as torch_npu binds it."""
    import torch

    names = {name: getattr(torch.ops.npu, name) for name in NPU_SCHEMAS}
    names.update({name: getattr(torch.ops.npu, name) for name in GRAPH_SCHEMAS if "." not in name})
    names.update({name: getattr(torch.ops.atb, name) for name in ATB_SCHEMAS})
    return names


def kernel_stand_ins() -> dict:
    """{stub module: {name: stand-in}} for sgl-kernel-npu's kernels on the paths a server takes."""
    alloc_extend = "sgl_kernel_npu.mem_cache.allocator.alloc_extend_kernel"
    return {"sgl_kernel_npu.mem_cache.allocator": {"alloc_extend_kernel": lookup("JitKernel")(name=alloc_extend)},
            "sgl_kernel_npu.activation.swiglu_quant": {"swiglu_quant": lookup("swiglu_quant")},
            "sgl_kernel_npu.sample.verify_tree_greedy": {"verify_tree_greedy": lookup("verify_tree_greedy")},
            "triton": {"jit": lookup("jit")}}


#: The graph-only ops' registered names -> their stand-ins' names.
_GRAPH_KERNELS = {
    "npu_fused_infer_attention_score.out": "_npu_fused_infer_attention_score_out",
    "_npu_fused_infer_attention_score_get_max_workspace": "_npu_fused_infer_attention_score_get_max_workspace",
    "_npu_fused_infer_attention_score_infer_output": "_npu_fused_infer_attention_score_infer_output",
}


def _graph_kernel(name):
    """The graph-only ops' stand-ins; ``.out`` is declared to the stream sanitizer with its ``out``
    marked written and returned (what the kernel does; the registered string does not say so)."""
    from .._sanitizer import declare_kernel

    fn = lookup(_GRAPH_KERNELS[name])
    if name not in WRITES_UNANNOTATED:
        return fn
    schema = GRAPH_SCHEMAS[name].replace("Tensor[] out)", "Tensor(a!)[] out)")
    schema = schema.replace("-> (Tensor, Tensor)", "-> (Tensor(a!), Tensor(a!))")  # it returns out
    return declare_kernel(name.split(".")[0] + schema, SOURCES["npu"])(fn)
