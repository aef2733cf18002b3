"""torch_npu's operators on the paths of a real sglang server, in pure torch on the CPU: one module
per family (``schemas``; ``common``; ``dense``; ``dsa_mla``; ``attention``; ``speculative``;
``moe``; ``triton``), registered here.

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

from .schemas import (
    ATB_SCHEMAS,
    CUSTOM_SCHEMAS,
    DECLARED,
    GRAPH_SCHEMAS,
    NPU_MLA_PROLOG_V3,
    NPU_SCHEMAS,
    SANITIZER_WRITES,
    SGL_KERNEL_NPU_SCHEMAS,
    SOURCES,
    WRITES_UNANNOTATED,
    _DTYPE_ARGS,
    _FIA_ARGS)
from .common import (
    _SCALAR_TYPES,
    _dtype,
    _unsupported)
from .dense import (
    _rms,
    _rotate,
    _rotate_half,
    npu_add_rms_norm,
    npu_format_cast,
    npu_interleave_rope,
    npu_mrope,
    npu_rms_norm,
    npu_rotary_mul,
    npu_swiglu)
from .dsa_mla import (
    _batch_of_tokens,
    _mla_prolog_shapes,
    _paged_rows,
    _visible,
    batch_matmul_transpose,
    npu_dynamic_quant,
    npu_lightning_indexer,
    npu_mla_prolog_v3,
    npu_quant_matmul,
    npu_sparse_flash_attention)
from .attention import (
    WORKSPACE_BYTES_PER_QUERY_ELEMENT,
    _attend,
    _bsh_paged_decode,
    _bsnd_paged_decode,
    _gather,
    _mla_rope_joined,
    _npu_flash_attention_qlens,
    _npu_fused_infer_attention_score_get_max_workspace,
    _npu_fused_infer_attention_score_infer_output,
    _npu_fused_infer_attention_score_out,
    _npu_paged_attention,
    _npu_reshape_and_cache,
    _paged_requests,
    npu_fused_infer_attention_score)
from .speculative import (
    _align_evict_mask_to_page_size,
    _assign_draft_cache_locs,
    _assign_req_to_token_pool,
    _create_extend_after_decode_spec_info,
    _filter_finished_cache_loc,
    _get_target_cache_loc,
    build_tree_kernel_efficient,
    verify_tree_greedy)
from .moe import (
    _group_bounds,
    _sorted_by_expert,
    npu_grouped_matmul,
    npu_moe_compute_expert_tokens,
    npu_moe_finalize_routing,
    npu_moe_gating_top_k,
    npu_moe_gating_top_k_softmax,
    npu_moe_init_routing,
    npu_moe_init_routing_v2,
    swiglu_quant)
from .triton import (
    JitKernel,
    TRITON_KERNELS,
    _alloc_extend_kernel,
    _compute_position,
    _write_req_to_token_pool,
    jit)

#: Every op and table of the families, reached by name here (``kernel`` looks its stand-in up by
#: the op's name; the tests and the rest of simnpu read them as ``_ops.<name>``).
__all__ = [
    'ATB_SCHEMAS',
    'CUSTOM_SCHEMAS',
    'DECLARED',
    'GRAPH_SCHEMAS',
    'JitKernel',
    'NPU_MLA_PROLOG_V3',
    'NPU_SCHEMAS',
    'SANITIZER_WRITES',
    'SGL_KERNEL_NPU_SCHEMAS',
    'SOURCES',
    'TRITON_KERNELS',
    'WORKSPACE_BYTES_PER_QUERY_ELEMENT',
    'WRITES_UNANNOTATED',
    '_DTYPE_ARGS',
    '_FIA_ARGS',
    '_SCALAR_TYPES',
    '_align_evict_mask_to_page_size',
    '_alloc_extend_kernel',
    '_assign_draft_cache_locs',
    '_assign_req_to_token_pool',
    '_attend',
    '_batch_of_tokens',
    '_bsh_paged_decode',
    '_bsnd_paged_decode',
    '_compute_position',
    '_create_extend_after_decode_spec_info',
    '_dtype',
    '_filter_finished_cache_loc',
    '_gather',
    '_get_target_cache_loc',
    '_group_bounds',
    '_mla_prolog_shapes',
    '_mla_rope_joined',
    '_npu_flash_attention_qlens',
    '_npu_fused_infer_attention_score_get_max_workspace',
    '_npu_fused_infer_attention_score_infer_output',
    '_npu_fused_infer_attention_score_out',
    '_npu_paged_attention',
    '_npu_reshape_and_cache',
    '_paged_requests',
    '_paged_rows',
    '_rms',
    '_rotate',
    '_rotate_half',
    '_sorted_by_expert',
    '_unsupported',
    '_visible',
    '_write_req_to_token_pool',
    'batch_matmul_transpose',
    'build_tree_kernel_efficient',
    'jit',
    'npu_add_rms_norm',
    'npu_dynamic_quant',
    'npu_format_cast',
    'npu_fused_infer_attention_score',
    'npu_grouped_matmul',
    'npu_interleave_rope',
    'npu_lightning_indexer',
    'npu_mla_prolog_v3',
    'npu_moe_compute_expert_tokens',
    'npu_moe_finalize_routing',
    'npu_moe_gating_top_k',
    'npu_moe_gating_top_k_softmax',
    'npu_moe_init_routing',
    'npu_moe_init_routing_v2',
    'npu_mrope',
    'npu_quant_matmul',
    'npu_rms_norm',
    'npu_rotary_mul',
    'npu_sparse_flash_attention',
    'npu_swiglu',
    'swiglu_quant',
    'verify_tree_greedy']

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
            fn = globals()[name]
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
    return {"sgl_kernel_npu.mem_cache.allocator": {
                "alloc_extend_kernel": JitKernel(name="sgl_kernel_npu.mem_cache.allocator.alloc_extend_kernel")},
            "sgl_kernel_npu.activation.swiglu_quant": {"swiglu_quant": swiglu_quant},
            "sgl_kernel_npu.sample.verify_tree_greedy": {"verify_tree_greedy": verify_tree_greedy},
            "triton": {"jit": jit}}


_GRAPH_KERNELS = {
    "npu_fused_infer_attention_score.out": _npu_fused_infer_attention_score_out,
    "_npu_fused_infer_attention_score_get_max_workspace": _npu_fused_infer_attention_score_get_max_workspace,
    "_npu_fused_infer_attention_score_infer_output": _npu_fused_infer_attention_score_infer_output,
}


def _graph_kernel(name):
    """The graph-only ops' stand-ins; ``.out`` is declared to the stream sanitizer with its ``out``
    marked written and returned (what the kernel does; the registered string does not say so)."""
    from .._sanitizer import declare_kernel

    fn = _GRAPH_KERNELS[name]
    if name not in WRITES_UNANNOTATED:
        return fn
    schema = GRAPH_SCHEMAS[name].replace("Tensor[] out)", "Tensor(a!)[] out)")
    schema = schema.replace("-> (Tensor, Tensor)", "-> (Tensor(a!), Tensor(a!))")  # it returns out
    return declare_kernel(name.split(".")[0] + schema, SOURCES["npu"])(fn)
