"""``python -m npu_shim selftest``'s step of zbal, in a process of its own (zbal's allocator goes in
before anything else touches the device): zbal set up through the process's own ``ZbalState`` as
the ``Scheduler.__init__`` wrapper sets it up (full mode: a heap of ``--zbal-mib``; mix mode: the
allocator switch, an allocation, then the lazy GVA heap), a tensor allocated through it, the
allocator backend, and the shim's memory queries (``get_available_gpu_memory``,
``get_npu_memory_capacity``) against zbal's ``mem_get_info``; on an NPU with the graph API, an
allocating computation captured through zbal's allocator and replayed, and whether the captured
tensors come from a graph pool.
"""

MIB = 1 << 20
ALONE = True  # its step runs in a process of its own: zbal's allocator goes in before anything else touches the device
OPTIONS = (("--zbal-mib", "zbal_mib", 1024, "size of the zbal heap the selftest sets up, MiB"),)


def mib(options):
    """Free device memory (MiB) the step needs: the heap it sets up, and room beside it."""
    return options["zbal_mib"] + 512


def _one_rank_world():
    """The world group of a one-rank job, for ZbalState.lazy_init (sglang's own group exists only
    once torch.distributed is initialised, which the selftest does not do)."""
    import types

    return types.SimpleNamespace(world_size=1, cpu_group=None, rank_in_group=0)


def _graph_part(step):
    """(ok, text, facts) where the step's device does graphs: an allocating computation captured
    through zbal's allocator and replayed on new inputs, equal to eager; and whether the captured
    tensors come from a graph pool: zbal installs its pool hooks only when ``ZBAL_ENABLE_GRAPH=1``
    as it is imported (memfabric-zbal's zbal_module.py), which nothing sets by default."""
    import os

    from npu_shim.patches._selftest import _graphs

    why = _graphs.skipped(step)
    if why:
        return True, why, {"skipped": step.graphs}
    torch, device = step.torch, _graphs.device(step)
    step.progress("an allocating computation captured into an NPU graph through zbal, replayed")
    x = torch.ones(1024, dtype=torch.bfloat16, device=device)
    fresh = torch.full((1024,), 3.0, dtype=torch.bfloat16, device=device)
    equal, facts = _graphs.capture_and_replay(step, lambda t: t * 2 + 1, [x], [fresh])
    facts["graph_pool"] = os.environ.get("ZBAL_ENABLE_GRAPH") == "1"
    return equal, "graph: captured through zbal's allocator and replayed, output %s eager; captured " \
        "tensors %s" % ("equal to" if equal else "DIFFERS from", "in zbal's graph pool (ZBAL_ENABLE_GRAPH=1)"
                        if facts["graph_pool"] else "UNPOOLED (ZBAL_ENABLE_GRAPH is not 1 when zbal is "
                        "imported: no graph-pool hooks)"), facts


def run(step):
    """zbal set up as the Scheduler wrapper does (the live ZbalState of this process's decision),
    a tensor allocated through it, the shim's memory queries against zbal's; (ok, line, facts)."""
    import os
    import types

    from npu_shim.patches import zbal as zbal_patch
    from npu_shim.patches import zbal as patch_module

    torch, index, simulated, progress = step.torch, step.index, step.simulated, step.progress
    zbal_mib = step.options["zbal_mib"]

    progress("importing zbal and sglang.srt.utils.common (the shim wraps its memory queries)")
    zbal = patch_module.zbal_module()
    from sglang.srt.utils import common

    record = step.record()
    if record is None or record.process_state is None:
        return False, "the zbal patch was not applied in this process (%s)" % (
            record.state if record else "not decided"), {}
    process = record.process_state
    mix = bool(zbal.is_mix_alloc())
    device = "cpu" if simulated else "npu:%d" % index
    facts = {"mode": "mix" if mix else "full"}
    os.environ[zbal_patch.LOCAL_MEM_SIZE.name] = str(zbal_mib)
    progress("%s mode: setting zbal up as Scheduler.__init__ does" % facts["mode"])
    process.init_for_rank(1, 1, index, 0)  # tp_size, pp_size, gpu_id, tp_rank: one rank
    tensor = torch.ones(16 * MIB // 2, dtype=torch.bfloat16, device=device)  # 16 MiB
    if mix:
        progress("mix mode: lazy GVA heap after an allocation, as before graph capture")
        torch.npu.empty_cache()
        free, total = torch.npu.mem_get_info()
        in_use = -(-(int(total) - int(free)) // MIB)
        configured = in_use + zbal_mib  # the heap is what is configured beyond what is in use
        os.environ[zbal_patch.LOCAL_MEM_SIZE.name] = str(configured)
        runner = types.SimpleNamespace(device="npu", gpu_id=index, is_draft_worker=False)
        if not process.lazy_init_due(runner):
            return False, "mix mode: the shim does not see the lazy GVA heap as due", facts
        process.lazy_init(runner, "in the selftest", _one_rank_world())
        facts.update(configured_mib=configured, in_use_mib=in_use)
    facts["heap_mib"] = process.gva_mib
    facts["backend"] = torch.npu.memory.get_allocator_backend()
    progress("the shim's memory queries against zbal.mem_get_info()")
    zfree, ztotal = zbal.mem_get_info()
    shim_free_gib = common.get_available_gpu_memory("npu", index, empty_cache=True)
    capacity = common.get_npu_memory_capacity()
    facts.update(zbal_free=int(zfree), zbal_total=int(ztotal), shim_free_gib=shim_free_gib,
                 shim_capacity_mib=capacity, tensor_bytes=tensor.numel() * tensor.element_size())
    problems = []
    if facts["backend"] == "native":
        problems.append("the allocator backend is still torch_npu's native one")
    if mix:
        device_free = torch.npu.mem_get_info()[0] / (1 << 30)
        facts["device_free_gib"] = device_free
        agree = abs(shim_free_gib - device_free) < 1e-3  # mix: the original query, device figures
        queries = "free %.2f GiB = the device's (mix mode: the original query)" % shim_free_gib
    else:
        agree = shim_free_gib == zfree / (1 << 30)
        queries = "free %.2f GiB = zbal.mem_get_info()'s" % shim_free_gib
    if not agree:
        problems.append("get_available_gpu_memory says %.3f GiB, zbal/device %.3f GiB" % (
            shim_free_gib, facts.get("device_free_gib", zfree / (1 << 30))))
    if capacity != int(os.environ[zbal_patch.LOCAL_MEM_SIZE.name]):
        problems.append("get_npu_memory_capacity says %s MiB, not the configured size" % capacity)
    graph_ok, graph_text, facts["graph"] = _graph_part(step)
    if not graph_ok:
        problems.append(graph_text)
    facts["problems"] = problems
    line = ("%s mode: %d MiB heap, allocator backend %s, 16 MiB tensor allocated %s; shim: %s, "
            "capacity %s MiB; zbal heap %d of %d MiB free%s%s" % (
                facts["mode"], facts["heap_mib"], facts["backend"],
                "(host memory: the simulated NPU has none)" if simulated else "through it", queries,
                capacity, zfree // MIB, ztotal // MIB,
                " (simulated zbal: its heap figures are fixed)" if simulated else "",
                "".join("; PROBLEM: " + p for p in problems)))
    if graph_ok:
        line += "; " + graph_text
    del tensor
    return not problems, line, facts
