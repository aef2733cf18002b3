"""zbal: memfabric's zero-buffer allocator on Ascend NPUs (backport of sglang 0.5.12's integration).

Why
    zbal (``pip install memfabric-zbal``) takes over NPU memory with a global virtual address (GVA)
    heap shared by all ranks; DeepEP-style MoE dispatch/combine then moves tokens without staging
    buffers (upstream reports 30 %+ faster DSv3-like MoE, 1.2 GB+ less memory).  sglang 0.5.12
    integrates it in seven files; images built on 0.5.7 - 0.5.11 do not have it.

How (upstream's six code touch points; its seventh file, ``environ.py``, declares the two variables,
declared here as ``LOCAL_MEM_SIZE`` / ``BOOTSTRAP_URL``.  Trigger: ``SGLANG_ZBAL_LOCAL_MEM_SIZE`` MiB
> 0 on an NPU)
    1. ``Scheduler.__init__`` is wrapped: before its body allocates anything, zbal is set up for the
       rank -- mix mode (``zbal.is_mix_alloc()``): ``switch_to_allocator()`` only; full mode:
       ``zbal_init(world_size=tp_size, device_id=gpu_id, rank_id=tp_rank, device_mem_size=MiB<<20,
       [ip_port=SGLANG_ZBAL_BOOTSTRAP_URL])``.  Upstream calls it right after ``init_ipc_channels``;
       nothing before that point touches the device, so running it first is equivalent.
    2. ``ModelRunner.initialize`` marks its scope and ``ModelRunner.init_device_graphs`` (called by
       the NPU branch right after ``init_attention_backend()``; the source is checked for exactly that
       order) initialises the GVA heap in mix mode, once per process, never in a draft worker, i.e.
       after weights, KV cache and attention backend and before graph capture.  Should a release
       not call ``init_device_graphs`` there, the heap is initialised when ``initialize`` returns.
    3. ``get_available_gpu_memory(device="npu")``: full mode reads free memory from
       ``zbal.mem_get_info()``; same checks, ``empty_cache``, ``distributed`` MIN all-reduce over
       ``cpu_group`` and GiB result as the original's NPU branch (the source is checked to still be
       that branch).  Mix mode, and every other device: the original.
    4. ``get_npu_memory_capacity()``: the configured MiB.
    5. ``token_dispatcher.deepep``: ``Buffer``/``Config`` become ``zbal.zbal_buffer.Buffer`` /
       ``zbal.zbal.deepep_adaptor.Config`` and ``use_deepep`` True (upstream's import succeeded).
    6. ``parallel_state``: ``_DEVICE_TO_DISTRIBUTED_BACKEND["npu"]`` is ``"zbal"`` (0.5.10 - 0.5.11);
       0.5.7 - 0.5.9 have no map (``ModelRunner.init_torch_distributed`` hard-codes ``"hccl"``), so
       ``init_distributed_environment`` maps ``backend="hccl"`` to ``"zbal"`` there.  On every
       release it imports zbal first, which is what registers the ``"zbal"`` backend with torch.
    Nothing is touched while the patch is not ``applied`` (size unset/0, ``NPU_SHIM_ZBAL=0``, no
    NPU, or a release that has it: ``Scheduler.init_zbal_on_npu`` /
    ``hardware_backend.npu.utils.init_zbal`` present -> ``upstream``; there upstream's own zbal
    follows ``SGLANG_ZBAL_LOCAL_MEM_SIZE`` whatever ``NPU_SHIM_ZBAL`` says).

Deliberate differences from upstream 0.5.12 (each a weakness seen in its code):
    * GVA size in mix mode: upstream takes "in use" as a hard-coded 61.2 GB minus free memory (right
      only on a 64 GB card).  Here in use = device total - free, both from ``torch.npu.mem_get_info()``
      after emptying the cache, rounded up to whole MiB.  Like upstream (its MIN all-reduce of the
      size) every rank then asks ``zbal_init``, which ends in a world barrier, for the same size:
      here the MAX of in use over the world group's ``cpu_group``.  Size = configured - in use,
      aligned down to 128 MiB; <= 0 raises ``ZbalError`` with the numbers instead of passing a
      negative size to zbal.
    * ``zbal_init`` returning False raises ``ZbalInitError`` (rank, device, size) instead of a bare log
      line plus ``sys.exit(-1)``: sglang's ``run_scheduler_process`` catches ``Exception``, logs the
      traceback and SIGQUITs the parent, so the whole server stops and says why; ``SystemExit``
      escapes that handler and the launcher only learns that a scheduler died.
    * ``pp_size > 1`` in full mode raises (upstream logs "only zbal mix mode support pp_size > 1!"
      -- even in mix mode -- and carries on into an unsupported set-up).
    * zbal missing while the size is set: the patch is ``failed`` when decided (``find_spec``, no
      import: ``python -m npu_shim status`` says it too) and the process stops with ``ZbalError``
      naming memfabric-zbal and the variable before sglang allocates anything (the launcher fails
      too), instead of an ``ImportError`` deep in the scheduler -- or, for DeepEP, a silent
      ``use_deepep = False``.  Each target checks again when its module is patched.
    * A malformed ``SGLANG_ZBAL_BOOTSTRAP_URL`` or size fails at decision time; upstream passes any
      string.  The size is read as its number before its length is judged (``0000000000000`` is 0).
      On a release with zbal upstream both are upstream's to read (it takes the size with
      ``int()``: ``+4096``, ``4_096``): the patch is ``upstream`` whatever the backport would make
      of them, its reason saying how the backport would have read them, and nothing is vetoed.
    * The lazy init runs once per process (upstream asserts); a second runner is skipped.
    * Mix mode in a process whose allocator is still torch_npu's own when the heap is due (no
      Scheduler switched zbal's in): ``ZbalError`` saying so; upstream's ``zbal_init`` tries the
      swap and torch_npu refuses it ("Can't swap an already initialized allocator").

NPU graphs (sglang's default on Ascend) and ``ZBAL_ENABLE_GRAPH``
    What memfabric-zbal 1.2.0 does with the variable: only its Python layer reads it, once, when
    ``zbal_module`` is imported (``ZBAL_ENABLE_GRAPH = int(os.environ.get(...)) == 1``); the native
    library holds no such string.  With it ``switch_to_allocator`` also hands torch_npu the
    library's ``zbal_pluggable_begin_allocate_to_pool`` / ``_end_allocate_to_pool`` /
    ``_release_pool``; without it torch_npu's ``NPUPluggableAllocator`` calls nothing when a capture
    begins, ends or its graph is reset.  The native side (exported symbols, disassembly) takes
    torch_npu's call ``(device, MempoolId_t, std::function<bool(aclrtStream)> filter)`` and routes it
    as it routes ``zbal_pluggable_malloc``: in mix mode (``use_vmm_for_static_memory``) to the GVA
    heap's allocator (``sma_begin_allocate_to_pool``) once the heap exists, else to its device
    caching allocator (``dma_begin_allocate_to_pool``); in full mode to the heap's.  Both keep a
    private pool per mempool id and, while a capture is underway, defer the event queries a free
    would make (``GraphDeferPools``, ``captures_underway``, "beginAllocateToPool: already recording
    to mempool_id").  Without the hooks zbal never learns that a capture is underway: what a
    captured graph allocates is an ordinary block, back in zbal's cache when the capture ends and
    handed out again while replays still write it.  Upstream (0.5.12 - 0.5.23) never sets it.
    What the shim does, at ``Scheduler.__init__`` before zbal's allocator is switched in (where it
    first knows whether this server captures graphs: ``--disable-cuda-graph`` unset): the variable
    unset -> it sets ``ZBAL_ENABLE_GRAPH=1`` (and ``zbal_module``'s global of that name, should the
    DeepEP module have imported zbal already: ``switch_to_allocator`` reads the global when
    called); set to 1 -> nothing to do; set to anything else -> the operator's value stands and a
    warning says the capture is unpooled and why.  The details say which: ``graph_pool``
    (words) and ``graph_pool_hooks`` (1 or 0, in sglang's ``/metrics``).
    A server that does not capture is left alone (the hooks would never be called).

Upstream: sgl-project/sglang#24575, released in 0.5.12 (``hardware_backend/npu/utils.py: init_zbal,
lazy_init_zbal_gva_mem``).
Remove when every supported image runs sglang >= 0.5.12.
"""

import importlib
import importlib.util
import os

from npu_shim.core import config
from npu_shim.core.framework import Inactive, Patch, Report, ShimError

SCHEDULER = "sglang.srt.managers.scheduler"
MODEL_RUNNER = "sglang.srt.model_executor.model_runner"
COMMON = "sglang.srt.utils.common"
DEEPEP = "sglang.srt.layers.moe.token_dispatcher.deepep"
PARALLEL_STATE = "sglang.srt.distributed.parallel_state"
NPU_UTILS = "sglang.srt.hardware_backend.npu.utils"

MIB = 1 << 20
ALIGN_MIB = 128
PACKAGE = "memfabric-zbal"

class ZbalError(ShimError):
    """zbal was asked for (SGLANG_ZBAL_LOCAL_MEM_SIZE > 0) but cannot be set up as configured."""


class ZbalInitError(ZbalError):
    """``zbal_init`` returned False."""

    def __init__(self, message, rank, device, size_mib):
        super().__init__(message)
        self.rank = rank
        self.device = device
        self.size_mib = size_mib


LOCAL_MEM_SIZE = config.mib(
    "SGLANG_ZBAL_LOCAL_MEM_SIZE",
    "Device memory zbal manages, in MiB (at most 1048576 = 1 TiB); > 0 turns zbal on (upstream name "
    "and meaning; on sglang >= 0.5.12 upstream's own zbal reads it, whatever NPU_SHIM_ZBAL says).",
    zero_means="turns zbal off")
BOOTSTRAP_URL = config.url(
    "SGLANG_ZBAL_BOOTSTRAP_URL",
    "tcp://HOST:PORT (hostname, IPv4 or [IPv6]; port 1-65535) of zbal's bootstrap server; empty "
    "lets zbal derive it from MASTER_ADDR/PORT.")


# -- helpers -------------------------------------------------------------------------------------

def missing_message():
    return ("SGLANG_ZBAL_LOCAL_MEM_SIZE=%s asks for the zbal allocator, but the Python package "
            "'zbal' is not importable: install %s (pip install %s) into this image, or unset "
            "SGLANG_ZBAL_LOCAL_MEM_SIZE to run on torch_npu's native allocator"
            % (_raw_size(), PACKAGE, PACKAGE))


def _raw_size():
    import os

    return os.environ.get(LOCAL_MEM_SIZE.name, "")


def zbal_findable():
    """Whether ``import zbal`` would find a package (cheap: nothing is imported)."""
    try:
        return importlib.util.find_spec("zbal") is not None
    except (ImportError, ValueError):
        return False


def require_zbal():
    """Raise ZbalError unless ``zbal`` can be found (every target's ``requires``)."""
    if not zbal_findable():
        raise ZbalError(missing_message())


# The Python API of memfabric-zbal this patch calls (identical in 1.1.2 and 1.2.0): names
# ``zbal/__init__.py`` must provide, and the keyword arguments given to ``zbal_init``.
ZBAL_API_NAMES = {"__init__.py": ("zbal_init", "switch_to_allocator", "is_mix_alloc", "mem_get_info",
                                  "Config"),
                  "zbal_buffer.py": ("Buffer",)}
ZBAL_INIT_KWARGS = ("world_size", "device_id", "rank_id", "device_mem_size", "ip_port")


def api_problems(package_dir):
    """What the zbal package at ``package_dir`` lacks of ZBAL_API_NAMES / ZBAL_INIT_KWARGS, read
    from its source files (never imported: that loads the native library); [] when complete."""
    import ast
    import os

    def parse(name):
        with open(os.path.join(package_dir, name), "rb") as handle:
            return ast.parse(handle.read())

    problems = []
    for filename, names in ZBAL_API_NAMES.items():
        try:
            tree = parse(filename)
        except (OSError, SyntaxError, ValueError) as exc:
            problems.append("%s unreadable (%s)" % (filename, exc.__class__.__name__))
            continue
        defined = set()
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                defined.update((a.asname or a.name).split(".")[0] for a in node.names)
        problems += ["%s has no %s" % (filename, n) for n in names if n not in defined]
    try:
        init = next(node for node in parse("zbal_module.py").body
                    if isinstance(node, ast.FunctionDef) and node.name == "zbal_init")
        params = {a.arg for a in init.args.args + init.args.kwonlyargs}
        problems += ["zbal_init has no parameter %s" % p for p in ZBAL_INIT_KWARGS if p not in params]
    except (OSError, SyntaxError, ValueError, StopIteration):
        problems.append("zbal_module.py defines no readable zbal_init")
    return problems


# -- the patch -----------------------------------------------------------------------------------

GRAPH_SWITCH = "ZBAL_ENABLE_GRAPH"


def graph_pool_setting(raw):
    """What a scheduler that captures NPU graphs gets from ``ZBAL_ENABLE_GRAPH``'s value ``raw``
    (None: unset): ``(hooks, words)``, ``hooks`` True where zbal's pool hooks go in.  Unset, the
    shim sets it to 1 (the module docstring says why); any value zbal reads as 1 is the operator's
    own; anything else keeps the hooks off."""
    if raw is None:
        return True, "zbal pool hooks (%s=1 set by the shim)" % GRAPH_SWITCH
    try:
        on = int(raw) == 1  # as zbal_module reads it
    except ValueError:
        on = False
    return on, "%s (%s=%s set in the environment)" % ("zbal pool hooks" if on else "unpooled", GRAPH_SWITCH, raw)


class ZbalReport(Report):
    def check_facts(self):
        """The zbal package the shim would use, read from its files (never imported: importing
        loads the native library, which needs CANN), and whether it has the Python API called."""
        from npu_shim.source.reading import find_package_dir, module_version

        package_dir = find_package_dir("zbal")
        if package_dir is None:
            return {"zbal": {"label": "zbal", "found": False,
                             "text": "not installed (needed only with SGLANG_ZBAL_LOCAL_MEM_SIZE)"}}
        version = module_version(("memfabric-zbal", "memfabric_zbal"), package_dir)
        missing = api_problems(package_dir)
        text = "%s at %s: %s" % (version or "unknown version", package_dir,
                                 "API as memfabric-zbal 1.1.2/1.2.0" if not missing else
                                 "API differs: " + "; ".join(missing))
        hooks, words = graph_pool_setting(os.environ.get(GRAPH_SWITCH))
        return {"zbal": {"label": "zbal", "found": True, "version": version, "path": package_dir,
                         "api_ok": not missing, "api_problems": missing, "text": text},
                "zbal_graphs": {"label": "zbal graphs", "hooks": hooks,
                                "text": "a server that captures NPU graphs: %s" % words}}

    def summary(self, details):
        parts = [details.text("mode")] if details.text("mode") else []
        size = details.count("gva_mib")
        if size is not None:
            parts.append("%d MiB" % size)
        return parts


class ZbalPatch(Patch):
    title = "memfabric zbal allocator: init, lazy GVA heap, memory queries, DeepEP, dist backend"
    upstream_pr = "sgl-project/sglang#24575"
    upstream_release = "0.5.12"
    backport_range = ("0.5.7", "0.5.11")
    remove_when = "every supported image runs sglang >= 0.5.12"
    switch_doc = "Switch for the zbal allocator backport (also needs SGLANG_ZBAL_LOCAL_MEM_SIZE)."
    reads = (LOCAL_MEM_SIZE, BOOTSTRAP_URL)
    trigger_env = {LOCAL_MEM_SIZE.name: "12288"}
    modules = (COMMON, PARALLEL_STATE, DEEPEP, MODEL_RUNNER, SCHEDULER)
    error = ZbalError
    report = ZbalReport()

    def probe(self, view):
        if view.has(SCHEDULER, "Scheduler.init_zbal_on_npu"):
            return "Scheduler.init_zbal_on_npu"
        if view.has(NPU_UTILS, "init_zbal"):
            return "hardware_backend.npu.utils.init_zbal"
        return None

    def trigger(self, environ):
        if LOCAL_MEM_SIZE.read(environ) <= 0:
            raise Inactive("SGLANG_ZBAL_LOCAL_MEM_SIZE is unset or 0")

    def requires(self):
        """Every target: zbal must be findable when its module is patched."""
        require_zbal()

    def must_honour(self, environ):
        if not LOCAL_MEM_SIZE.is_set(environ):
            return False
        try:
            return LOCAL_MEM_SIZE.read(environ) > 0
        except config.ConfigError:
            return True  # an invalid size is a request we cannot read, not a request for nothing


PATCH = ZbalPatch()
