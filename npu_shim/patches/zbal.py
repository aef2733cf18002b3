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
import sys

from npu_shim.core import config
from npu_shim.core.framework import Failed, Inactive, Patch, Report, ShimError, Upstream
from npu_shim.reporting import log, metrics
from npu_shim.runtime.targets import Replace, Wrap, bind_arguments


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
    upstream = Upstream("sgl-project/sglang#24575", "0.5.12", backports=("0.5.7", "0.5.11"))
    switch = "Switch for the zbal allocator backport (also needs SGLANG_ZBAL_LOCAL_MEM_SIZE)."
    reads = (LOCAL_MEM_SIZE, BOOTSTRAP_URL)
    modules = (COMMON, PARALLEL_STATE, DEEPEP, MODEL_RUNNER, SCHEDULER)
    error = ZbalError
    report = ZbalReport()

    def probe(self, view):
        if view.has(SCHEDULER, "Scheduler.init_zbal_on_npu"):
            return "Scheduler.init_zbal_on_npu"
        if view.has(NPU_UTILS, "init_zbal"):
            return "hardware_backend.npu.utils.init_zbal"
        return None

    def trigger(self, environ, on_npu):
        if LOCAL_MEM_SIZE.read(environ) <= 0:
            raise Inactive("SGLANG_ZBAL_LOCAL_MEM_SIZE is unset or 0")
        super().trigger(environ, on_npu)

    def must_honour(self, environ):
        if not LOCAL_MEM_SIZE.is_set(environ):
            return False
        try:
            return LOCAL_MEM_SIZE.read(environ) > 0
        except config.ConfigError:
            return True  # an invalid size is a request we cannot read, not a request for nothing


PATCH = ZbalPatch()


# ------------------------------------------------------------------------------ the implementation
# The wrappers, their per-process state (``ZbalState``), the memory queries and the targets, used
# only where the patch is decided past its probe and trigger (not on a release that has zbal
# upstream, nor while SGLANG_ZBAL_LOCAL_MEM_SIZE is unset).

SCHEDULER_INIT_SIGS = (
    ("server_args", "port_args", "gpu_id", "tp_rank", "moe_ep_rank", "pp_rank", "dp_rank"),
    ("server_args", "port_args", "gpu_id", "tp_rank", "moe_ep_rank", "pp_rank", "attn_cp_rank",
     "moe_dp_rank", "dp_rank"),
)
INITIALIZE_SIGS = (("min_per_gpu_memory",), ("pre_model_load_memory",))
#: memfabric-zbal's own switch for its graph-pool hooks (zbal_module.py reads it at import).
AVAILABLE_SIG = ("device", "gpu_id", "distributed", "empty_cache", "cpu_group")
INIT_DIST_SIGS = (
    ("world_size", "rank", "distributed_init_method", "local_rank", "backend", "timeout"),
    ("world_size", "rank", "distributed_init_method", "local_rank", "backend", "timeout",
     "moe_a2a_backend"),
    ("world_size", "rank", "distributed_init_method", "local_rank", "backend", "timeout",
     "moe_a2a_backend", "recovered_rank"),
)

# The NPU branch of ModelRunner.initialize the lazy init relies on (attention backend, then graphs).
_NPU_BRANCH = (r'elif self\.device in \["npu", "cpu"\]:\s*\n\s*self\.init_attention_backend\(\)'
               r'\s*\n\s*self\.init_device_graphs\(\)')
# The NPU branch of get_available_gpu_memory the full-mode query re-states (0.5.7 - 0.5.11).
_AVAILABLE_NPU_BRANCH = (
    r'elif device == "npu":\s*num_gpus = torch\.npu\.device_count\(\)\s*assert gpu_id < num_gpus\s*'
    r'if torch\.npu\.current_device\(\) != gpu_id:\s*print\([\s\S]*?torch NPU context\.",\s*\)\s*'
    r'if empty_cache:\s*torch\.npu\.empty_cache\(\)\s*'
    r'free_gpu_memory, total_gpu_memory = torch\.npu\.mem_get_info\(\)[\s\S]*?'
    r'if distributed:\s*tensor = torch\.tensor\(free_gpu_memory, dtype=torch\.float32\)\s*'
    r'torch\.distributed\.all_reduce\(\s*tensor, op=torch\.distributed\.ReduceOp\.MIN, group=cpu_group\s*\)'
    r'\s*free_gpu_memory = tensor\.item\(\)\s*return free_gpu_memory / \(1 << 30\)')


def zbal_module():
    """The imported zbal package; ZbalError (naming the package and variable) if it cannot load."""
    try:
        import zbal
    except ImportError as exc:
        raise ZbalError("%s (import failed: %s)" % (missing_message(), exc)) from exc
    return zbal


def configured_mib():
    return LOCAL_MEM_SIZE.read()


def _ip_port_kwargs():
    """``ip_port`` only when SGLANG_ZBAL_BOOTSTRAP_URL is set (else zbal derives it), as upstream."""
    url = BOOTSTRAP_URL.read()
    return {"ip_port": url} if url else {}


def _call_zbal_init(zbal, world_size, device_id, rank_id, size_mib, what):
    kwargs = _ip_port_kwargs()
    ok = zbal.zbal_init(world_size=world_size, device_id=device_id, rank_id=rank_id,
                        device_mem_size=size_mib * MIB, **kwargs)
    if not ok:
        raise ZbalInitError(
            "zbal_init failed (%s): rank %s of %s, device %s, %d MiB%s; see zbal's log above "
            "(memfabric library path, bootstrap server reachable, device memory free)"
            % (what, rank_id, world_size, device_id, size_mib,
               ", bootstrap %s" % kwargs["ip_port"] if kwargs else ""),
            rank=rank_id, device=device_id, size_mib=size_mib)


# -- 2. the lazy GVA size ---------------------------------------------------------------------------

def gva_size_mib(configured, world_size, cpu_group):
    """(GVA MiB, in-use MiB, device total MiB): configured - in use, aligned down to 128 MiB."""
    import torch

    torch.npu.empty_cache()
    free, total = torch.npu.mem_get_info()
    in_use = int(total) - int(free)
    if world_size > 1:
        # zbal_init ends in a world barrier: every rank must ask for the same size.
        tensor = torch.tensor(in_use, dtype=torch.int64)
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX, group=cpu_group)
        in_use = int(tensor.item())
    in_use_mib = -(-in_use // MIB)
    total_mib = int(total) // MIB
    size = configured - in_use_mib
    if size > 0:
        size -= size % ALIGN_MIB
    if size <= 0:
        raise ZbalError(
            "no room for the zbal GVA heap: SGLANG_ZBAL_LOCAL_MEM_SIZE=%d MiB configured, %d MiB "
            "already in use (weights, KV cache, workspace) of the device's %d MiB total -> %d MiB "
            "left (%d after aligning down to %d MiB); raise SGLANG_ZBAL_LOCAL_MEM_SIZE to at least "
            "%d or lower --mem-fraction-static"
            % (configured, in_use_mib, total_mib, configured - in_use_mib, size, ALIGN_MIB,
               in_use_mib + ALIGN_MIB))
    return size, in_use_mib, total_mib


def require_zbal_allocator():
    """Mix mode sets the heap up on zbal's allocator, switched in at Scheduler start-up.  Where it is
    not (a ModelRunner started without sglang's Scheduler, e.g. bench_one_batch), zbal_init would
    swap allocators now, after the weights: torch_npu refuses that with "Can't swap an already
    initialized allocator" from inside zbal; say why instead."""
    import torch

    backend = torch.npu.memory.get_allocator_backend()
    if backend == "native":
        raise ZbalError(
            "zbal mix mode: the GVA heap needs zbal's allocator, switched in before the first NPU "
            "allocation (at sglang's Scheduler start-up), but this process allocated on torch_npu's "
            "native allocator, which cannot be swapped once used (a ModelRunner started without "
            "sglang's Scheduler?); unset SGLANG_ZBAL_LOCAL_MEM_SIZE for this process")


def _world_group():
    from sglang.srt.distributed import get_world_group

    return get_world_group()


# -- 1./2./6. what zbal set up in this process ---------------------------------------------------

class ZbalState:
    """zbal in one process: the wrappers that set it up, and what they did.  A decision builds a
    fresh one (``targets``), so uninstall/install starts over; ``details`` is the patch record's
    (``npu_shim.states()`` and status show it)."""

    def __init__(self, details=None):
        self.details = {} if details is None else details
        self.mode = None            # "mix" / "full" once Scheduler.__init__ set zbal up
        self.gva_mib = None         # size the GVA heap was initialised with
        self.initializing = set()   # id() of ModelRunners inside initialize()

    # 1. Scheduler.__init__: upstream init_zbal -- mix mode switches the allocator only, full mode
    # initialises the heap.
    def init_for_rank(self, tp_size, pp_size, gpu_id, tp_rank):
        if self.mode is not None:
            log.debug("zbal: already set up in this process (%s mode)" % self.mode)
            return
        size = configured_mib()
        zbal = zbal_module()
        if zbal.is_mix_alloc():
            zbal.switch_to_allocator()
            self.mode = "mix"
            self.details.update(mode="mix", allocator="zbal (GVA heap after the KV cache)")
            return
        if pp_size > 1:
            raise ZbalError("only zbal mix mode supports pp_size > 1 (got pp_size=%d with "
                            "SGLANG_ZBAL_LOCAL_MEM_SIZE=%d in full mode); enable zbal's mix mode or "
                            "use pp_size 1" % (pp_size, size))
        _call_zbal_init(zbal, tp_size, gpu_id, tp_rank, size, "full mode, Scheduler start-up")
        self.mode = "full"
        self.gva_mib = size
        self.details.update(mode="full", gva_mib=size)
        log.info("zbal: rank %s initialised a %d MiB heap in full mode (device %s, world %d)"
                 % (tp_rank, size, gpu_id, tp_size))

    def scheduler_init_wrapper(self, params):
        def scheduler_init(wrapped, instance, args, kwargs):
            bound = bind_arguments(params, args, kwargs)
            server_args = bound["server_args"]
            self.graph_pool_hooks(server_args)
            self.init_for_rank(server_args.tp_size, server_args.pp_size, bound["gpu_id"], bound["tp_rank"])
            metrics.publish()
            return wrapped(*args, **kwargs)

        return scheduler_init

    # 1b. NPU graphs: zbal's graph-pool hooks (ZBAL_ENABLE_GRAPH; the patch's docstring says why).
    def graph_pool_hooks(self, server_args):
        """Before zbal's allocator is switched in: where this scheduler will capture NPU graphs,
        make ``switch_to_allocator`` install zbal's pool hooks, unless the operator set
        ``ZBAL_ENABLE_GRAPH`` (then say what that value means)."""
        import os

        if getattr(server_args, "disable_cuda_graph", True):  # (a stand-in without it: no capture)
            return  # no capture: the hooks would never be called, and nothing is said
        raw = os.environ.get(GRAPH_SWITCH)
        hooks, words = graph_pool_setting(raw)
        self.details.update(graph_pool=words, graph_pool_hooks=int(hooks))
        if raw is None:
            os.environ[GRAPH_SWITCH] = "1"
            # zbal_module reads the variable once, at its import (which the DeepEP module may have
            # done already); switch_to_allocator, its only reader, reads the module global.
            module = sys.modules.get("zbal.zbal_module")
            if module is not None and hasattr(module, GRAPH_SWITCH):
                setattr(module, GRAPH_SWITCH, True)
        if hooks:
            return
        try:
            int(raw)
            note = ""
        except ValueError:
            note = " (not an integer: zbal fails to import)"
        log.warning(
            "zbal: graphs will be captured but %s=%s%s keeps zbal's pool hooks off: a captured "
            "graph's memory is not pooled and may be reused while replays write it; unset %s (the "
            "shim then sets it to 1) or pass --disable-cuda-graph" % (GRAPH_SWITCH, raw, note, GRAPH_SWITCH))

    # 2. ModelRunner.initialize / init_device_graphs: the lazy GVA heap of mix mode.
    def lazy_init_due(self, runner):
        """Mix mode, NPU, not a draft worker, heap not yet initialised in this process."""
        if getattr(runner, "device", None) != "npu" or self.gva_mib is not None:
            return False
        if getattr(runner, "is_draft_worker", False):
            self.details["draft_worker_skipped"] = True
            return False
        return bool(zbal_module().is_mix_alloc())

    def lazy_init(self, runner, when, group=None):
        """``group``: the world group (sglang's own where None; ``selftest`` passes a one-rank one)."""
        zbal = zbal_module()
        group = group or _world_group()
        size, in_use, total = gva_size_mib(configured_mib(), group.world_size, group.cpu_group)
        require_zbal_allocator()
        # upstream's own line (sglang >= 0.5.12, hardware_backend/npu/utils.py), word for word on
        # stdout: operators' log scrapers look for it.  One write with its newline: the ranks share
        # one stdout, and print()'s two writes interleaved them on one line.
        sys.stdout.write("[ZBAL] rank %d allocated %d MB gva space.\n" % (group.rank_in_group, size))
        sys.stdout.flush()
        _call_zbal_init(zbal, group.world_size, runner.gpu_id, group.rank_in_group, size,
                        "mix mode, lazy GVA heap %s" % when)
        self.gva_mib = size
        self.details.update(gva_mib=size, in_use_mib=in_use, device_total_mib=total, gva_init=when)
        metrics.publish()
        log.info("zbal: rank %d initialised a %d MiB GVA heap (%d MiB configured, %d of %d MiB in use)"
                 % (group.rank_in_group, size, configured_mib(), in_use, total))

    def model_runner_initialize(self, wrapped, instance, args, kwargs):
        key = id(instance)
        self.initializing.add(key)
        try:
            result = wrapped(*args, **kwargs)
        finally:
            self.initializing.discard(key)
        if self.lazy_init_due(instance):
            log.warning("zbal: ModelRunner.initialize did not reach init_device_graphs; "
                        "initialising the GVA heap after it instead")
            self.lazy_init(instance, "after ModelRunner.initialize")
        return result

    def model_runner_init_device_graphs(self, wrapped, instance, args, kwargs):
        if id(instance) in self.initializing and self.lazy_init_due(instance):
            self.lazy_init(instance, "before device-graph capture")
        return wrapped(*args, **kwargs)

    # 6. init_distributed_environment: "zbal" as the NPU's torch.distributed backend.
    def init_dist_wrapper(self, params, hccl_means_npu):
        index = params.index("backend")

        def init_distributed_environment(wrapped, instance, args, kwargs):
            backend = bind_arguments(params, args, kwargs).get("backend")
            if hccl_means_npu and backend == "hccl":
                backend = "zbal"
                if len(args) > index:
                    args = args[:index] + (backend,) + args[index + 1:]
                else:
                    kwargs = dict(kwargs, backend=backend)
            if backend == "zbal":
                zbal_module()  # importing zbal registers the "zbal" torch.distributed backend
                self.details["dist_backend"] = "zbal"
            return wrapped(*args, **kwargs)

        return init_distributed_environment


# -- 3./4. memory queries ------------------------------------------------------------------------

def get_available_gpu_memory(wrapped, instance, args, kwargs):
    bound = bind_arguments(AVAILABLE_SIG, args, kwargs)
    if bound.get("device") != "npu":
        return wrapped(*args, **kwargs)
    zbal = zbal_module()
    if zbal.is_mix_alloc():
        return wrapped(*args, **kwargs)  # the GVA heap may not exist yet: device figures
    import torch

    gpu_id = bound["gpu_id"]
    # The original's NPU branch, with zbal's heap as the source of the free figure.
    num_gpus = torch.npu.device_count()
    assert gpu_id < num_gpus
    if torch.npu.current_device() != gpu_id:
        print(
            f"WARNING: current device is not {gpu_id}, but {torch.npu.current_device()}, ",
            "which may cause useless memory allocation for torch NPU context.",
        )
    if bound.get("empty_cache", True):
        torch.npu.empty_cache()
    free_gpu_memory, _total = zbal.mem_get_info()
    if bound.get("distributed", False):
        tensor = torch.tensor(free_gpu_memory, dtype=torch.float32)
        torch.distributed.all_reduce(
            tensor, op=torch.distributed.ReduceOp.MIN, group=bound.get("cpu_group"))
        free_gpu_memory = tensor.item()
    return free_gpu_memory / (1 << 30)


def get_npu_memory_capacity(wrapped, instance, args, kwargs):
    try:
        import torch_npu  # noqa: F401 - the original's contract: it raises without torch_npu
    except ImportError:
        raise ImportError("torch_npu is required when run on npu device.")
    return configured_mib()  # unit: MB, as upstream


# -- 5./6. DeepEP and the distributed backend -----------------------------------------------------

def _zbal_deepep(name):
    def factory(original):
        zbal_module()
        if name == "Buffer":
            from zbal.zbal_buffer import Buffer

            return Buffer
        from zbal.zbal.deepep_adaptor import Config

        return Config

    return factory


def _backend_map(original):
    mapping = dict(original)
    mapping["npu"] = "zbal"
    return mapping


# -- the targets ---------------------------------------------------------------------------------

def targets(view, ctx):
    """The ten targets, bound to this decision's ``ZbalState`` (``ctx.process_state``); ``failed``
    where the job asks for zbal and its package cannot be found."""
    if not ctx.assume_triggered and not zbal_findable():
        raise Failed(missing_message())
    process = ctx.process_state = ZbalState(ctx.details)
    sched = view.function(SCHEDULER, "Scheduler.__init__")
    sched_params = sched.params if sched else SCHEDULER_INIT_SIGS[-1]
    dist = view.function(PARALLEL_STATE, "init_distributed_environment")
    dist_params = dist.params if dist and "backend" in dist.params else INIT_DIST_SIGS[0]
    has_map = view.has(PARALLEL_STATE, "_DEVICE_TO_DISTRIBUTED_BACKEND")
    targets = [
        Wrap(COMMON, "get_available_gpu_memory", get_available_gpu_memory, (AVAILABLE_SIG,),
             source_has=[(_AVAILABLE_NPU_BRANCH, "the NPU branch the full-mode query re-states")]),
        Wrap(COMMON, "get_npu_memory_capacity", get_npu_memory_capacity, ((),)),
        Wrap(PARALLEL_STATE, "init_distributed_environment",
             process.init_dist_wrapper(dist_params, hccl_means_npu=not has_map), INIT_DIST_SIGS),
    ]
    # Replaced in their own module only: the originals are shared objects -- deep_ep's
    # ``Buffer``, ``use_deepep`` is ``False`` -- read through ``deepep``'s globals.
    if has_map:
        targets.append(Replace(PARALLEL_STATE, "_DEVICE_TO_DISTRIBUTED_BACKEND", _backend_map))
    targets += [
        Replace(DEEPEP, "Buffer", _zbal_deepep("Buffer"), must_exist=False),
        Replace(DEEPEP, "Config", _zbal_deepep("Config"), must_exist=False),
        Replace(DEEPEP, "use_deepep", lambda original: True),
        Wrap(MODEL_RUNNER, "ModelRunner.initialize", process.model_runner_initialize,
             INITIALIZE_SIGS),
        Wrap(MODEL_RUNNER, "ModelRunner.init_device_graphs", process.model_runner_init_device_graphs,
             ((),), source_has=[(_NPU_BRANCH, "the NPU branch 'init_attention_backend(); "
                                              "init_device_graphs()' of initialize")]),
        Wrap(SCHEDULER, "Scheduler.__init__", process.scheduler_init_wrapper(sched_params),
             SCHEDULER_INIT_SIGS),
    ]
    for target in targets:  # zbal must be findable when any of its modules is patched
        target.requires = target.requires or require_zbal
    return targets
