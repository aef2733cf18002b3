"""The public names of torch-npu 2.13.0's ``torch_npu.npu`` and ``torch_npu.npu.memory``, as read
from the wheel's Python files (tests/dev/test_simnpu_conformance.py reads them again and fails when
this list differs).  The simulated modules answer exactly these names: the ones they implement
(``_device.py``), the rest with inert stubs; any other name is an AttributeError, as there.
"""

NPU = frozenset({
    'BFloat16Storage', 'BoolStorage', 'ByteStorage', 'CharStorage', 'CubeMathType',
    'DoubleStorage', 'Event', 'ExternalEvent', 'ExternalStream', 'FloatStorage', 'HalfStorage',
    'IntStorage', 'LongStorage', 'MemPool', 'NPUGraph', 'NPUPluggableAllocator',
    'NpuGraphOpHandler', 'ShortStorage', 'Stream', 'StreamContext', 'SyncLaunchStream',
    'are_compatible_impl_enabled', 'autocast_utils', 'backends', 'caching_allocator_alloc',
    'caching_allocator_delete', 'can_device_access_peer', 'change_current_allocator',
    'check_uce_in_memory', 'clear_npu_overflow_flag', 'config', 'conv', 'current_blas_handle',
    'current_device', 'current_stream', 'default_generators', 'default_stream', 'deterministic',
    'device', 'device_count', 'device_of', 'disable_deterministic_with_backward', 'empty_cache',
    'empty_virt_addr_cache', 'enable_deterministic_with_backward', 'enable_flash_sdp',
    'enable_math_sdp', 'enable_mem_efficient_sdp', 'finalize_dump',
    'flash_sdp_enabled', 'get_allocator_backend', 'get_amp_supported_dtype',
    'get_autocast_dtype', 'get_device_capability', 'get_device_limit', 'get_device_name',
    'get_device_properties', 'get_mm_bmm_format_nd', 'get_npu_overflow_flag',
    'get_per_process_memory_fraction', 'get_rng_state', 'get_rng_state_all', 'get_soc_version',
    'get_stream_limit', 'get_sync_debug_mode', 'get_task_queue_enable', 'graph',
    'graph_pool_handle', 'graph_task_group_begin', 'graph_task_group_end',
    'graph_task_update_begin', 'graph_task_update_end', 'graphs', 'host_empty_cache',
    'host_memory_stats', 'host_memory_stats_as_nested_dict', 'init', 'init_dump',
    'initial_seed', 'ipc_collect', 'is_autocast_enabled', 'is_available', 'is_bf16_supported',
    'is_current_stream_capturing', 'is_initialized', 'is_jit_compile_false',
    'make_graphed_callables', 'manual_seed', 'manual_seed_all', 'math_sdp_enabled', 'matmul',
    'max_memory_allocated', 'max_memory_cached', 'max_memory_reserved',
    'mem_efficient_sdp_enabled', 'mem_get_info', 'memory', 'memory_allocated', 'memory_cached',
    'memory_reserved', 'memory_snapshot', 'memory_stats', 'memory_stats_as_nested_dict',
    'memory_summary', 'mstx', 'npu_config', 'npurt', 'obfuscation_calculate',
    'obfuscation_finalize', 'obfuscation_initialize', 'preferred_linalg_library', 'random',
    'register_npu_graph_handler', 'reset_accumulated_host_memory_stats',
    'reset_accumulated_memory_stats', 'reset_max_memory_allocated', 'reset_max_memory_cached',
    'reset_peak_host_memory_stats', 'reset_peak_memory_stats', 'reset_stream_limit',
    'restart_device', 'sdp_kernel', 'seed', 'seed_all', 'set_aoe', 'set_autocast_dtype',
    'set_autocast_enabled', 'set_compile_mode', 'set_deterministic_level', 'set_device',
    'set_device_limit', 'set_dump', 'set_mm_bmm_format_nd', 'set_op_timeout_ms', 'set_option',
    'set_per_process_memory_fraction', 'set_rng_state', 'set_rng_state_all', 'set_stream',
    'set_stream_limit', 'set_sync_debug_mode', 'set_task_queue_enable', 'stop_device', 'stream',
    'streams', 'stress_detect', 'super_kernel_scope_begin', 'super_kernel_scope_end',
    'synchronize', 'use_compatible_impl', 'use_mem_pool', 'utilization', 'utils', 'npugraph_ex'
})
MEMORY = frozenset({
    'MemPool', 'NPUPluggableAllocator', 'caching_allocator_alloc', 'caching_allocator_delete',
    'change_current_allocator', 'empty_cache', 'empty_virt_addr_cache', 'get_allocator_backend',
    'get_per_process_memory_fraction', 'host_empty_cache', 'host_memory_stats',
    'host_memory_stats_as_nested_dict', 'is_initialized', 'max_memory_allocated',
    'max_memory_cached', 'max_memory_reserved', 'memory_allocated', 'memory_cached',
    'memory_reserved', 'memory_snapshot', 'memory_stats', 'memory_stats_as_nested_dict',
    'memory_summary', 'reset_accumulated_host_memory_stats', 'reset_accumulated_memory_stats',
    'reset_max_memory_allocated', 'reset_max_memory_cached', 'reset_peak_host_memory_stats',
    'reset_peak_memory_stats', 'set_per_process_memory_fraction', 'use_mem_pool'
})
#: torch_npu/npu/graphs.py's ``__all__`` (the conformance test reads it again).
GRAPHS = frozenset({
    'is_current_stream_capturing', 'graph_pool_handle', 'graph_task_group_begin', 'graph_task_group_end',
    'graph_task_update_begin', 'graph_task_update_end', 'NPUGraph', 'graph', 'make_graphed_callables',
    'super_kernel_scope_begin', 'super_kernel_scope_end',
})
