"""The schemas the ops are defined under (torch_npu 2.13.0's strings, atb::'s, the CANN custom ops',
sgl-kernel-npu's) and where each is from; what the stream sanitizer is told beyond them."""
from __future__ import annotations



#: name -> schema (after the name), for ``npu::``.  Verbatim from libtorch_npu.so.
NPU_SCHEMAS = {
    "npu_rms_norm": "(Tensor input, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)",
    "npu_add_rms_norm": "(Tensor x1, Tensor x2, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor, Tensor)",
    "npu_swiglu": "(Tensor input, int dim=-1) -> Tensor",
    "npu_mrope": ("(Tensor positions, Tensor query, Tensor key, Tensor cos_sin_cache, int head_size, *, "
                  "int[]? mrope_section=None, str? rotary_mode='half', str? cache_mode='default') "
                  "-> (Tensor, Tensor)"),
    # The DSA (DeepSeek-V3.2 / GLM-5 indexer) decode path: the indexer's rope, its top-k and the
    # sparse attention over the selected tokens; the W8A8 dynamic linear (q_b_proj, indexer.wq_b).
    "npu_rotary_mul": "(Tensor input, Tensor r1, Tensor r2, str rotary_mode='half', Tensor? rotate=None) -> Tensor",
    "npu_interleave_rope": "(Tensor x, Tensor cos, Tensor sin) -> Tensor",
    "npu_lightning_indexer": (
        '(Tensor query, Tensor key, Tensor weights, *, Tensor? actual_seq_lengths_query=None, '
        'Tensor? actual_seq_lengths_key=None, Tensor? block_table=None, str layout_query="BSND", '
        'str layout_key="BSND", int sparse_count=2048, int sparse_mode=3, '
        'int pre_tokens=9223372036854775807, int next_tokens=9223372036854775807, '
        'bool return_value=False) -> (Tensor, Tensor)'),
    "npu_sparse_flash_attention": (
        '(Tensor query, Tensor key, Tensor? value, Tensor sparse_indices, float scale_value, *, '
        'Tensor? block_table=None, Tensor? actual_seq_lengths_query=None, '
        'Tensor? actual_seq_lengths_kv=None, Tensor? query_rope=None, Tensor? key_rope=None, '
        'int sparse_block_size=1, str layout_query="BSND", str layout_kv="BSND", int sparse_mode=3, '
        'int pre_tokens=9223372036854775807, int next_tokens=9223372036854775807, '
        'int attention_mode=0, bool return_softmax_lse=False, Tensor? sinks=None) '
        '-> (Tensor, Tensor, Tensor)'),
    "npu_quant_matmul": (
        "(Tensor x1, Tensor x2, Tensor scale, *, Tensor? offset=None, Tensor? pertoken_scale=None, "
        "Tensor? bias=None, int? output_dtype=None, int? x1_dtype=None, int? x2_dtype=None, "
        "int? pertoken_scale_dtype=None, int? scale_dtype=None, int[]? group_sizes=None, "
        "Tensor? y_scale=None) -> Tensor"),
    "npu_dynamic_quant": (
        '(Tensor input, *, Tensor? smooth_scales=None, Tensor? group_index=None, int? dst_type=None, '
        'str quant_mode="pertoken", float dst_type_max=0.0) -> (Tensor, Tensor)'),
    "npu_format_cast": ("(Tensor input, int acl_format, *, int? customize_dtype=None, "
                        "int? input_dtype=None) -> Tensor"),
    # -- speculative decoding (EAGLE / NextN): ascend_backend.forward_mtp's attention for
    # target-verify and draft-extend batches
    "npu_fused_infer_attention_score": (
        '(Tensor query, Tensor key, Tensor value, *, Tensor? pse_shift=None, Tensor? atten_mask=None, '
        'SymInt[]? actual_seq_lengths=None, SymInt[]? actual_seq_lengths_kv=None, '
        'Tensor? dequant_scale1=None, Tensor? quant_scale1=None, Tensor? dequant_scale2=None, '
        'Tensor? quant_scale2=None, Tensor? quant_offset2=None, Tensor? antiquant_scale=None, '
        'Tensor? antiquant_offset=None, Tensor? key_antiquant_scale=None, '
        'Tensor? key_antiquant_offset=None, Tensor? value_antiquant_scale=None, '
        'Tensor? value_antiquant_offset=None, Tensor? block_table=None, '
        'Tensor? query_padding_size=None, Tensor? kv_padding_size=None, '
        'Tensor? key_shared_prefix=None, Tensor? value_shared_prefix=None, '
        'SymInt[]? actual_shared_prefix_len=None, Tensor? query_rope=None, Tensor? key_rope=None, '
        'Tensor? key_rope_antiquant_scale=None, int num_heads=1, float scale=1.0, '
        'int pre_tokens=2147483647, int next_tokens=2147483647, str input_layout="BSH", '
        'int num_key_value_heads=0, int sparse_mode=0, int inner_precise=0, int block_size=0, '
        'int antiquant_mode=0, int key_antiquant_mode=0, int value_antiquant_mode=0, '
        'bool softmax_lse_flag=False) -> (Tensor, Tensor)'),
    # -- the MoE path (sglang's hardware_backend/npu/moe/topk.py, ep_moe/layer.py's forward_npu,
    # quantization/unquant.py's forward_npu, npu/quantization/fused_moe_method_npu.py)
    "npu_moe_gating_top_k": (
        "(Tensor x, int k, *, Tensor? bias=None, Tensor? input_ids=None, Tensor? tid2eid=None, "
        "int k_group=1, int group_count=1, int group_select_mode=0, int renorm=0, int norm_type=0, "
        "bool out_flag=False, float routed_scaling_factor=1.0, float eps=1e-20) "
        "-> (Tensor, Tensor, Tensor)"),
    "npu_moe_gating_top_k_softmax": "(Tensor x, Tensor? finished=None, int k=1) -> (Tensor, Tensor, Tensor)",
    "npu_grouped_matmul": (
        "(Tensor[] x, Tensor[] weight, *, Tensor[]? bias=None, Tensor[]? scale=None, "
        "Tensor[]? offset=None, Tensor[]? antiquant_scale=None, Tensor[]? antiquant_offset=None, "
        "Tensor[]? per_token_scale=None, Tensor? group_list=None, Tensor[]? activation_input=None, "
        "Tensor[]? activation_quant_scale=None, Tensor[]? activation_quant_offset=None, "
        "int? split_item=0, int? group_type=None, int? group_list_type=0, int? act_type=0, "
        "int[]? tuning_config=None, int? output_dtype=None, int? x_dtype=None, int? weight_dtype=None, "
        "int? scale_dtype=None, int? per_token_scale_dtype=None) -> Tensor[]"),
    "npu_moe_init_routing": (
        "(Tensor x, Tensor row_idx, Tensor expert_idx, int active_num) -> (Tensor, Tensor, Tensor)"),
    "npu_moe_compute_expert_tokens": "(Tensor sorted_expert_for_source_row, int num_expert) -> Tensor",
    "npu_moe_init_routing_v2": (
        "(Tensor x, Tensor expert_idx, *, Tensor? scale=None, Tensor? offset=None, int active_num=-1, "
        "int expert_capacity=-1, int expert_num=-1, int drop_pad_mode=0, int expert_tokens_num_type=0, "
        "bool expert_tokens_num_flag=False, int quant_mode=-1, int[2] active_expert_range=[], "
        "int row_idx_type=0, int? x_dtype=None) -> (Tensor, Tensor, Tensor, Tensor)"),
    "npu_moe_finalize_routing": (
        "(Tensor expanded_permuted_rows, Tensor? skip1, Tensor? skip2, Tensor? bias, Tensor? scales, "
        "Tensor expanded_src_to_dst_row, Tensor? export_for_source_row, int? drop_pad_mode=0, "
        "int? k=1) -> Tensor"),
}

#: torch_npu 2.13.0's ``npu::npu_mla_prolog_v3`` (a string of libtorch_npu.so).  sglang 0.5.9 -
#: 0.5.19 call it as ``torch.ops.custom.npu_mla_prolog_v3``: the ``custom`` namespace is not
#: torch_npu's but the CANN custom-ops package's (cann-recipes-infer
#: ``ops/ascendc/torch_ops_extension/custom_ops/csrc/ops_def_registration.cpp``,
#: ``TORCH_LIBRARY(custom, m)``), whose schema is this one without the five trailing ``int? *_dtype``
#: arguments (torch_npu added them for its FP8/HiFloat8 variants).  The conformance test holds the
#: ``custom::`` schema to be exactly that prefix of the wheel's string.
NPU_MLA_PROLOG_V3 = (
    '(Tensor token_x, Tensor weight_dq, Tensor weight_uq_qr, Tensor weight_uk, Tensor weight_dkv_kr, '
    'Tensor rmsnorm_gamma_cq, Tensor rmsnorm_gamma_ckv, Tensor rope_sin, Tensor rope_cos, '
    'Tensor(a!) kv_cache, Tensor(b!) kr_cache, *, Tensor? cache_index=None, Tensor? dequant_scale_x=None, '
    'Tensor? dequant_scale_w_dq=None, Tensor? dequant_scale_w_uq_qr=None, '
    'Tensor? dequant_scale_w_dkv_kr=None, Tensor? quant_scale_ckv=None, Tensor? quant_scale_ckr=None, '
    'Tensor? smooth_scales_cq=None, Tensor? actual_seq_len=None, Tensor? k_nope_clip_alpha=None, '
    'float rmsnorm_epsilon_cq=1e-05, float rmsnorm_epsilon_ckv=1e-05, str cache_mode="PA_BSND", '
    'bool query_norm_flag=False, int weight_quant_mode=0, int kv_cache_quant_mode=0, '
    'int query_quant_mode=0, int ckvkr_repo_mode=0, int quant_scale_repo_mode=0, int tile_size=128, '
    'float qc_qr_scale=1.0, float kc_scale=1.0, int? token_x_dtype=None, int? weight_dq_dtype=None, '
    'int? weight_uq_qr_dtype=None, int? weight_dkv_kr_dtype=None, int? kv_cache_dtype=None) '
    '-> (Tensor, Tensor, Tensor, Tensor, Tensor)')
_DTYPE_ARGS = (", int? token_x_dtype=None, int? weight_dq_dtype=None, int? weight_uq_qr_dtype=None, "
               "int? weight_dkv_kr_dtype=None, int? kv_cache_dtype=None")
CUSTOM_SCHEMAS = {"npu_mla_prolog_v3": NPU_MLA_PROLOG_V3.replace(_DTYPE_ARGS, "")}
#: sglang 0.5.20+ call the wheel's own op, ``torch_npu.npu_mla_prolog_v3`` (torch_npu/utils/
#: custom_ops.py binds it as ``torch.ops.npu.npu_mla_prolog_v3``): defined here under the wheel's
#: whole string, the same stand-in behind both namespaces.
NPU_SCHEMAS["npu_mla_prolog_v3"] = NPU_MLA_PROLOG_V3

#: sgl-kernel-npu's own ``npu::`` op (``csrc/pytorch_extensions.cpp``, ``TORCH_LIBRARY_FRAGMENT(npu,
#: m)``): the decode attention's ``w_vc`` product (``forward_dsa_core_npu``).  Not in the torch-npu
#: wheel, so the conformance test cannot hold it to a binary (no sgl-kernel-npu wheel is public).
SGL_KERNEL_NPU_SCHEMAS = {
    "batch_matmul_transpose": (
        "(Tensor tensor_a, Tensor tensor_b, Tensor(a!) tensor_c, str? format_mode=None, "
        "str? quant_mode=None) -> ()"),
    # EAGLE's draft tree (sglang speculative/eagle_utils.py calls torch.ops.npu.<this> on NPU).
    # The registered string marks no argument written, though the kernel fills its five output
    # buffers in place (as sgl-kernel's CUDA op of the same name, whose schema marks them ``!``):
    # the op is defined here under the real string, and declared to the sanitizer with the writes
    # (SANITIZER_WRITES).
    "build_tree_kernel_efficient": (
        "(Tensor parent_list, Tensor selected_index, Tensor verified_seq_len, Tensor tree_mask, "
        "Tensor positions, Tensor retrive_index, Tensor retrive_next_token, "
        "Tensor retrive_next_sibling, int topk, int depth, int draft_token_num, "
        "int tree_mask_mode)->()"),
}

#: op -> the arguments its kernel writes where its registered schema does not say so: the schema
#: the stream sanitizer is given marks them ``(x!)``.
SANITIZER_WRITES = {"build_tree_kernel_efficient": ("tree_mask", "positions", "retrive_index",
                                                    "retrive_next_token", "retrive_next_sibling")}

#: Where each op's schema (and so what it reads and writes, for the stream sanitizer) is from.
SOURCES = {
    "npu": "torch-npu 2.13.0 torch_npu/lib/libtorch_npu.so",
    "custom": ("CANN custom ops (cann-recipes-infer ops/ascendc/torch_ops_extension/custom_ops/csrc/"
               "ops_def_registration.cpp); = torch-npu 2.13.0's npu::npu_mla_prolog_v3 less its dtype "
               "arguments"),
    "sgl_kernel_npu": "sgl-kernel-npu csrc/pytorch_extensions.cpp",
}

#: name -> schema, for ``atb::`` (types: the C++ function's; names: sglang's keywords).
ATB_SCHEMAS = {
    "_npu_reshape_and_cache": (
        "(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slot_indices) -> ()"),
    "_npu_flash_attention_qlens": (
        "(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_table, Tensor mask, "
        "Tensor seq_len, Tensor context_lens, int num_kv_heads, int num_heads, float scale_value, "
        "Tensor(a!) out) -> ()"),
    "_npu_paged_attention": (
        "(Tensor query, Tensor key_cache, Tensor value_cache, int num_kv_heads, int num_heads, "
        "float scale_value, Tensor block_table, Tensor context_lens, Tensor(a!) out, "
        "Tensor? mask=None) -> ()"),
}


# -- registration -----------------------------------------------------------------------------------

#: The ops whose stand-ins are declared to the stream sanitizer (``simnpu.declare_kernel``) with
#: the real op's schema: one launch reading and writing what the real kernel does.
DECLARED = ("npu_rotary_mul", "npu_interleave_rope", "npu_lightning_indexer",
            "npu_sparse_flash_attention", "npu_quant_matmul", "npu_dynamic_quant",
            "npu_fused_infer_attention_score")


# == graph-only attention ops =======================================================================
#
# What sglang's NPU-graph decode (``ascend_backend.forward_decode_graph``, 0.5.9 - 0.5.11) and
# torch_npu's own ``_IFAv1DefaultHandler`` (``torch_npu/npu/_npugraph_handlers/ifa_handler.py``)
# call: the max-workspace query, the output-shape inference, and the ``.out`` overload that writes
# into preallocated outputs.  Schemas verbatim from libtorch_npu.so (the conformance test finds
# each one there).  ``.out`` registers ``Tensor[] out`` without a write annotation, though the
# kernel fills it: the graph recorder (``_graphs.py``) and the stream sanitizer are told so by
# ``WRITES_UNANNOTATED``.

_FIA_ARGS = NPU_SCHEMAS["npu_fused_infer_attention_score"][:-len(" -> (Tensor, Tensor)")]
GRAPH_SCHEMAS = {
    "npu_fused_infer_attention_score.out": (
        _FIA_ARGS[:-1] + ", Tensor? workspace=None, Tensor[] out) -> (Tensor, Tensor)"),
    "_npu_fused_infer_attention_score_get_max_workspace": _FIA_ARGS + " -> Tensor",
    "_npu_fused_infer_attention_score_infer_output": (
        '(Tensor query, Tensor value, *, str input_layout="BSH", Tensor? quant_scale2=None, '
        'Tensor? block_table=None, int num_heads=1, int num_key_value_heads=0, '
        'bool softmax_lse_flag=False, Tensor? query_rope=None) -> (Tensor, Tensor)'),
}
#: op -> arguments its kernel writes that its registered schema does not mark ``(a!)``.
WRITES_UNANNOTATED = {"npu_fused_infer_attention_score.out": ("out",)}
