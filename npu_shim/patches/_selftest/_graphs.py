"""A patch's selftest path through an NPU graph capture and a replay, as sglang's NPUGraphRunner
drives a decode step (sglang's default on Ascend; ``--disable-cuda-graph`` turns it off): two eager
warm-ups, each after a ``synchronize``; one ``graph_pool_handle()``; the capture on a stream of its
own with ``auto_dispatch_capture=True``; then the static inputs refreshed in place and ``replay()``.
The replayed output must equal an eager run of the reference on the new inputs: a replay runs no
Python, so what the patch decided while capturing is what every replay does.

``step.graphs`` (set by npu_shim/cli/selftest_child.py) is None where this runs -- an NPU whose
torch_npu has the graph API -- else why not, which the step's line repeats.  Imports torch only
through ``step``.
"""


def device(step):
    """Where a graph check's tensors live: ``step.graph_device``, the NPU itself (on the simulated
    NPU too, whose graphs record only what is on the npu: host tensors run eagerly)."""
    return step.graph_device


def skipped(step):
    """The words a step's line ends with where graphs are not exercised, else None."""
    return None if step.graphs is None else "graphs: not exercised (%s)" % step.graphs


def capture_and_replay(step, fn, inputs, fresh, reference=None):
    """(equal, facts): ``fn(*inputs)`` captured into an NPUGraph after two warm-ups, ``fresh``
    copied into ``inputs``, the graph replayed; its output compared with ``reference(*fresh)``
    (default ``fn``) run eagerly.  The graph is reset on every way out."""
    torch, dm = step.torch, step.dm
    for _ in range(2):  # sglang's two eager warm-ups per batch size
        dm.synchronize()
        fn(*inputs)
    dm.synchronize()
    pool = dm.graph_pool_handle()
    graph = dm.NPUGraph()
    try:
        with dm.graph(graph, pool=pool, stream=dm.Stream(), auto_dispatch_capture=True):
            out = fn(*inputs)
        for dst, src in zip(inputs, fresh):
            dst.copy_(src)
        graph.replay()
        dm.synchronize()
        replayed = out.clone()
        expected = (reference or fn)(*fresh)
        dm.synchronize()
    finally:
        graph.reset()
    equal = bool(torch.equal(replayed, expected))
    return equal, {"captured": True, "replayed": True, "equal": equal}


def refused_at_capture(step, fn, inputs, error):
    """(refused, facts): whether ``fn(*inputs)`` raises ``error`` while a capture is live (the
    refusal must come at capture time: a replay runs no Python to refuse with).  The capture is
    ended and the graph reset either way."""
    dm = step.dm
    dm.synchronize()
    graph = dm.NPUGraph()
    raised = None
    try:
        with dm.graph(graph, stream=dm.Stream()):
            fn(*inputs)
    except error as exc:
        raised = exc
    finally:
        graph.reset()
    dm.synchronize()
    return raised is not None, {"refused_at_capture": raised is not None,
                                "error": type(raised).__name__ if raised is not None else None}
