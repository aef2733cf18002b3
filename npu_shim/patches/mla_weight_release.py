"""mla_weight_release: free the MLA weights sglang's mlaprolog path no longer reads (PD disaggregation).

Why
    On Ascend, DeepSeek-V3.2 / GLM-5 style attention (DSA) decodes through ``npu_mla_preprocess`` ->
    ``NPUFusedMLAPreprocess.forward_mlaprolog`` when the quantisation config leaves ``kv_b_proj``
    unquantised (``quant_config.ignore`` has a name matching ``.*kv_b_proj``).  That path makes its
    own copies of the q_a / kv_a halves of the fused ``qkv_a_proj`` weight
    (``mlaprolog_preprocess_weight``) and its own contiguous copy of ``w_kc``: the originals are
    dead weight.  sglang 0.5.20 (sgl-project/sglang#38807, "glm5.2 fp8 memory opt") frees them with
    ``untyped_storage().resize_(0)`` under PD disaggregation: the fused qkv_a weight on the prefill
    and decode roles, ``w_kc`` on decode only.  Images built on 0.5.9 - 0.5.19 have the path but
    not the release.

How
    1. ``uses_mlaprolog(preprocess, w8a8_attr)`` -- one predicate, also installed as
       ``NPUFusedMLAPreprocess.uses_mlaprolog`` (upstream's name from 0.5.20; upstream's own
       predicate tests W8A8 only from 0.5.23, 0.5.20 - 0.5.22 test the ignore rule alone) --
       restates the judgement the running release's ``forward()`` makes to route to
       ``forward_mlaprolog``: not modelslim W8A8 (which
       wins in 0.5.9 - 0.5.19, checked through ``quant_method.quant_config`` in 0.5.9 and
       ``quant_method.quantization_config`` later) and the ``.*kv_b_proj`` ignore rule (no
       0.5.9 - 0.5.19 release has upstream's later arch35-DSA rule).  ``forward()``,
       ``forward_mlaprolog``, ``mlaprolog_preprocess_weight`` and ``npu_mla_preprocess`` must have
       exactly the code this module was written against (codeview fingerprints; the two wrapped
       ones are checked again in the loaded code); any other code leaves the patch ``unsupported``
       -- nothing is freed on code the shim has not read.
    2. Role: ``runtime_context.get_disagg().disaggregation_mode`` where it exists (0.5.17+), else
       ``get_global_server_args().disaggregation_mode``; read when each layer decides.  Which of
       the two, and forward()'s W8A8 attribute, are read from the code when the patch is decided
       and handed to the wrappers through ``MlaWeightReleaseState`` (one per decision).  Unknown
       (not published yet, no such field, odd value): nothing is released and one warning says so.
    3. ``mlaprolog_preprocess_weight`` is wrapped: after it made the q_a / kv_a copies, the fused
       ``qkv_a_proj.weight`` is released when role != ``null``.
    4. ``npu_mla_preprocess`` is wrapped (by a plain function of its pinned parameters, not a
       wrapt proxy: it runs on every eager layer call): on the call that first constructed the layer's
       ``mla_preprocess``, ``m.w_kc`` is released when role == ``decode``, ``uses_mlaprolog()`` and
       ``w_kc is not None``.  A layer first seen later (a layer list that changes) is released the
       same way at its first call.  The wrapper stays for the life of the process: every later call
       of a layer it has seen is one dict lookup before sglang's own function (eager mode; a
       captured NPU graph replays without Python, so nothing there).  Once the first layer seen comes
       round again (one pass over the layers), one line says what was released.

    5. Weight updates.  ``/update_weights_from_disk`` and the tensor / distributed /
       IPC variants exist on every 0.5.9 - 0.5.19 server whatever its flags.  Loading into a
       released weight raises ``ReleasedWeightError`` inside the scheduler: 0.5.9 - 0.5.19's disk
       update then "rolls back to original weights" by loading again outside its ``try`` (raises
       again), the tensor update has no ``try`` at all -- either takes the scheduler down; the
       distributed one catches it after loading part of the weights.  So ``BaseTpWorker``'s
       ``update_weights_from_disk``, ``update_weights_from_tensor``,
       ``update_weights_from_distributed``, ``update_weights_from_ipc`` and
       ``init_weights_update_group`` (sglang.srt.managers.tp_worker; one code shape 0.5.9 - 0.5.15
       and one or two 0.5.16 - 0.5.19, each pinned) are wrapped: once a weight is guarded in this
       process, they return ``(False, message)`` up front -- nothing read, nothing loaded, never in
       part -- naming the released weights, the MiB and ``NPU_SHIM_MLA_WEIGHT_RELEASE=0``; before
       that (or where nothing was released) the release's own method runs untouched.  The
       scheduler side turns the pair into the request's answer (success=False, the message; HTTP
       400), flushes no cache and still reaches its TP barrier: ``SchedulerUpdateWeightsMixin``
       (0.5.9 - 0.5.12) / ``SchedulerWeightUpdaterManager`` (0.5.13 - 0.5.19), pinned too.  Where
       either differs, the whole patch is ``unsupported`` (no release without a clean answer).
       Every TP rank decides alike: releases happen in forward passes all ranks run together.
       ``update_weights_from_distributed`` refused on its own leaves the trainer's broadcast
       without this rank; refusing ``init_weights_update_group`` first tells the trainer at set-up.

Deliberate differences from upstream 0.5.20
    * A released weight is *guarded*: the tensor object itself (every reference to it) becomes a
      subclass whose ``__torch_function__`` raises ``ReleasedWeightError`` naming the weight, the
      layer and ``NPU_SHIM_MLA_WEIGHT_RELEASE=0``; it holds a fresh empty tensor without ``_base``
      (``torch.utils.swap_tensors``), so even code that bypasses ``__torch_function__`` sees a
      0-element tensor, never freed memory.  Upstream leaves a tensor with its old shape on a
      0-byte storage: reading it segfaults CPU torch 2.13 and reads freed memory on a device.
    * Memory is freed only when the weight and its own ``_base`` chain are the storage's sole
      holders (the C++ use count of the storage, and no other reference to a base): a view,
      ``.data``, ``.detach()`` or base taken elsewhere keeps the weight whole, with one warning
      naming the holder count.  Upstream's ``resize_(0)`` frees memory such aliases still read.
    * Nothing is released when the server can reload or adapt weights -- LoRA, memory saver /
      weights CPU backup (RL refit), ``load_format=dummy``, checkpoint engine, custom weight loader,
      serving as a remote-instance weight seed -- unless ``NPU_SHIM_MLA_RELEASE_FORCE=1``; the log
      says which.  Where weights were released, update requests are refused cleanly (step 5).  Nor with
      speculative decoding (not forcible): its target-verify / draft-extend batches take the
      unfused path of ``forward_dsa_prepare_npu``, which reads both weights.
    * Before releasing, the copies are checked not to share the original's memory, and the
      original's storage to hold only that weight (else: kept, with a warning).
    * Per process: MiB released and layers are logged (after the first full pass over the layers)
      and put into the status details (``npu_shim.states()``).
    * ``NPU_SHIM_MLA_WEIGHT_RELEASE=0`` turns it off; default on (upstream: always on under PD).
    * 0.5.7 / 0.5.8 have no mlaprolog path: ``inactive`` (nothing to release) with that reason.

Upstream: sgl-project/sglang#38807, sglang 0.5.20 (``NPUFusedMLAPreprocess.uses_mlaprolog``).
Remove when every supported image runs sglang >= 0.5.20.
"""

import functools
import logging
import re

from npu_shim.core import config
from npu_shim.core.framework import Inactive, Patch, Report, Unsupported, Upstream
from npu_shim.reporting import log, metrics
from npu_shim.runtime import tensor_release
from npu_shim.runtime.targets import Replace, Wrap


MLA_PRE = "sglang.srt.hardware_backend.npu.attention.mla_preprocess"
MLA_NPU = "sglang.srt.hardware_backend.npu.modules.deepseek_v2_attention_mla_npu"
RUNTIME_CONTEXT = "sglang.srt.runtime_context"
TP_WORKER = "sglang.srt.managers.tp_worker"
# What turns the worker's (success, message) into the request's answer (the scheduler's side).
SCHEDULER_MIXIN = ("sglang.srt.managers.scheduler_update_weights_mixin", "SchedulerUpdateWeightsMixin")
SCHEDULER_UPDATER = ("sglang.srt.managers.scheduler_components.weight_updater",
                     "SchedulerWeightUpdaterManager")

CLASS = "NPUFusedMLAPreprocess"
# npu_mla_preprocess's parameters in every pinned release: its replacement restates them
PREPROCESS_SIG = ("m", "hidden_states", "positions", "forward_batch", "zero_allocator")
MIB = 1 << 20
ROLES = ("null", "prefill", "decode")

RELEASE_FORCE = config.boolean(
    "NPU_SHIM_MLA_RELEASE_FORCE", False,
    "Release MLA weights even when the server can reload or adapt weights (LoRA, weight updates).")

# codeview fingerprints of what the release relies on, as shipped in 0.5.9 - 0.5.19.
# forward(): its code also says how it detects modelslim W8A8 (the attribute of quant_method).
FORWARD_FINGERPRINTS = {
    "d010fbeaf53c20ee": "quant_config",         # 0.5.9
    "011dc459e9706bff": "quantization_config",  # 0.5.10 - 0.5.19
}
PINNED = {
    # routes: modelslim W8A8 -> forward_mlapo, else the .*kv_b_proj ignore rule -> forward_mlaprolog
    (MLA_PRE, CLASS + ".forward"): {fp: "0.5.9" if attr == "quant_config" else "0.5.10 - 0.5.19"
                                    for fp, attr in FORWARD_FINGERPRINTS.items()},
    # makes q_a / kv_a copies (clone + npu_format_cast) of the transposed fused weight
    (MLA_PRE, CLASS + ".mlaprolog_preprocess_weight"): {"09fdb1454d8689bd": "0.5.9 - 0.5.19"},
    # reads the copies and self.w_kc (its own contiguous copy), never qkv_a_proj.weight / m.w_kc
    (MLA_PRE, CLASS + ".forward_mlaprolog"): {"96dc2446cff765c4": "0.5.9 - 0.5.19"},
    # builds m.mla_preprocess lazily, routes on the ignore rule only
    (MLA_NPU, "npu_mla_preprocess"): {"38ffc9242c8f71f7": "0.5.9 - 0.5.19"},
}

# Weight updates: BaseTpWorker's methods that load weights into this process's model (or set up a
# group only used for that), each returning (success, message) to the scheduler.  What the
# refusal says each would have done.
UPDATE_OPS = {
    "update_weights_from_disk": "loading weights from disk would write into",
    "update_weights_from_tensor": "loading the tensors would write into",
    "update_weights_from_distributed": "loading the broadcast weights would write into",
    "update_weights_from_ipc": "loading weights over IPC (checkpoint engine) would write into",
    "init_weights_update_group": "the group would serve only to load weights, which would write into",
}
UPDATE_SIG = ("recv_req",)
# BaseTpWorker.<op>: hands recv_req to the model runner (0.5.16+: its weight_updater) and
# returns its (success, message).
UPDATE_PINS = {
    "update_weights_from_disk": {"7d7bd48f2cd03bc7": "0.5.9 - 0.5.15", "2905646aebc14a4b": "0.5.16 - 0.5.19"},
    "update_weights_from_tensor": {"45fb758993da4ded": "0.5.9 - 0.5.15", "63cb3243cb891b6a": "0.5.16",
                                   "0ff5c21a9783bc8e": "0.5.17 - 0.5.19"},
    "update_weights_from_distributed": {"55866601b437f3c6": "0.5.9 - 0.5.15",
                                        "6c0d0f6220213f41": "0.5.16 - 0.5.19"},
    "update_weights_from_ipc": {"a8dea004533cb7cb": "0.5.9 - 0.5.15", "13d8673cfc7b5ac4": "0.5.16 - 0.5.19"},
    "init_weights_update_group": {"207758a6f8726c36": "0.5.9 - 0.5.15", "91ad943c5cf0b3ba": "0.5.16 - 0.5.19"},
}
# The scheduler's <op>: (False, message) from the worker -> no cache flush, the message logged
# (not for init), the request answered with success=False and the message (HTTP 400); the tensor /
# IPC ones still reach their TP barrier.  SchedulerUpdateWeightsMixin in 0.5.9 - 0.5.12,
# SchedulerWeightUpdaterManager (scheduler.weight_updater) in 0.5.13 - 0.5.19.
CALLER_PINS = {
    SCHEDULER_MIXIN: {
        "update_weights_from_disk": {"8f74107b2495cb5a": "0.5.9 - 0.5.10", "7feae91f08c508c6": "0.5.11",
                                     "8cbd93254a900262": "0.5.12"},
        "update_weights_from_tensor": {"ee1f24e176794173": "0.5.9", "93e2256f9bacac52": "0.5.10",
                                       "ac61c776f8d1fa31": "0.5.11", "35082486191bc0a0": "0.5.12"},
        "update_weights_from_distributed": {"2d1200d746303169": "0.5.9 - 0.5.10",
                                            "a41eb03a508aff6f": "0.5.11", "7851b9e0a1ad6d68": "0.5.12"},
        "update_weights_from_ipc": {"db86c47016c9559f": "0.5.9 - 0.5.10", "b45a42f7d64fe864": "0.5.11",
                                    "dcdb299c0fd850a1": "0.5.12"},
        "init_weights_update_group": {"85f04e1c518ebc6a": "0.5.9 - 0.5.12"},
    },
    SCHEDULER_UPDATER: {
        "update_weights_from_disk": {"cba422bf7bb189e7": "0.5.13 - 0.5.14", "75dc83678d5f2eda": "0.5.15 - 0.5.18",
                                     "f52be3fc7b3a382b": "0.5.19"},
        "update_weights_from_tensor": {"8c57b2e14c2e8670": "0.5.13 - 0.5.14",
                                       "8030a525ce273bc8": "0.5.15 - 0.5.18", "2ac1cb41f9220bee": "0.5.19"},
        "update_weights_from_distributed": {"bebb3c96d38454e5": "0.5.13 - 0.5.14",
                                            "b27feda85aa7750d": "0.5.15 - 0.5.18",
                                            "5a99c6caf592afd0": "0.5.19"},
        "update_weights_from_ipc": {"b98b5426ece4f060": "0.5.13 - 0.5.14", "28ef37c3202e6c58": "0.5.15 - 0.5.18",
                                    "042a476ece6eefd2": "0.5.19"},
        "init_weights_update_group": {"3ec277b136b2fc97": "0.5.13 - 0.5.14", "aa6da7ec646f9d26": "0.5.15 - 0.5.19"},
    },
}
PINNED.update({(TP_WORKER, "BaseTpWorker." + op): pinned for op, pinned in UPDATE_PINS.items()})
PINNED.update({(module, cls + "." + op): pinned
               for (module, cls), ops in CALLER_PINS.items() for op, pinned in ops.items()})


class ReleasedWeightError(RuntimeError):
    """Something touched an MLA weight npu-shim released (the mlaprolog path no longer reads it)."""


# --------------------------------------------------------------------------- source checks

def fingerprint(view, dotted, qualname):
    info = view.function(dotted, qualname)
    return info.fingerprint if info is not None else None


def pins(*defs):
    """The PINNED fingerprints of ``defs`` ((module, qualname) pairs), for a target's ``pins``."""
    return {key: PINNED[key] for key in defs}


# --------------------------------------------------------------------------- the patch

class MlaWeightReleaseReport(Report):
    def summary(self, details):
        released = details.number("released_mib")
        return [] if released is None else ["released %s MiB" % released]


class MlaWeightRelease(Patch):
    upstream = Upstream("sgl-project/sglang#38807", "0.5.20", backports=("0.5.9", "0.5.19"))
    switch = "Switch for freeing MLA weights the mlaprolog path no longer reads (PD disaggregation only)."
    reads = (RELEASE_FORCE,)
    modules = (MLA_PRE, MLA_NPU, TP_WORKER)
    report = MlaWeightReleaseReport()

    def probe(self, view):
        if view.has(MLA_PRE, CLASS + ".uses_mlaprolog"):
            return "%s.uses_mlaprolog exists (and the release with it)" % CLASS
        return None


PATCH = MlaWeightRelease()
SWITCH = MlaWeightRelease.switch
SWITCH_HINT = "set %s=0 to keep the MLA weights (turns the release off)" % SWITCH.name


# --------------------------------------------------------------------------------------- the rules
# mla_weight_release's rules: whether a layer's ``forward()`` takes the mlaprolog path (the
# predicate), which disaggregation role this process has, and what else would read or write the
# weights after a release (the server's arguments). Each is a question about sglang's own objects,
# asked when a layer decides; MlaWeightReleaseState, below, acts on the answers.

_KV_B_PROJ = re.compile(r".*kv_b_proj")


def uses_mlaprolog(preprocess, w8a8_attr):
    """True exactly when the running release's ``NPUFusedMLAPreprocess.forward()`` routes to
    ``forward_mlaprolog`` (same expressions, same order as its source, pinned by code shape);
    ``w8a8_attr``: the quant_method attribute its forward() reads (FORWARD_FINGERPRINTS)."""
    quant_method = preprocess.qkv_a_proj.quant_method
    is_w8a8 = hasattr(quant_method, w8a8_attr) and getattr(quant_method, w8a8_attr).get_name() == "modelslim"
    quant_config = preprocess.quant_config
    is_mlaprolog = hasattr(quant_config, "ignore") and any(
        _KV_B_PROJ.fullmatch(name) for name in quant_config.ignore)
    return (not is_w8a8) and bool(is_mlaprolog)


def make_uses_mlaprolog_method(w8a8_attr):
    """``NPUFusedMLAPreprocess.uses_mlaprolog`` as upstream names it, for this release's W8A8 check."""
    def method(self):
        """Whether this layer's forward() takes the mlaprolog path (npu-shim backport of 0.5.20)."""
        return uses_mlaprolog(self, w8a8_attr)

    # sglang's names, as upstream's method has them: it pickles by name, as any method of the class
    method.__module__, method.__name__, method.__qualname__ = MLA_PRE, "uses_mlaprolog", CLASS + ".uses_mlaprolog"
    return method


# -- the role, and what else reads or writes the weights

def disagg_role(role_source):
    """(role, None) with role in null/prefill/decode, or (None, why it cannot be known);
    ``role_source``: "get_disagg" (0.5.17+) or "server_args"."""
    try:
        if role_source == "get_disagg":
            from sglang.srt.runtime_context import get_disagg

            role = get_disagg().disaggregation_mode
            where = "runtime_context.get_disagg()"
        else:
            from sglang.srt.server_args import get_global_server_args

            role = get_global_server_args().disaggregation_mode
            where = "server_args.disaggregation_mode"
    except Exception as exc:  # noqa: BLE001 - not published yet, missing field, ...
        return None, "reading the disaggregation role failed: %r" % (exc,)
    if role not in ROLES:
        return None, "%s is %r" % (where, role)
    return role, None


def server_args():
    from sglang.srt.server_args import get_global_server_args

    args = get_global_server_args()
    if args is None:
        raise ValueError("server args are not published")
    return args


def weight_update_reasons(args):
    """What lets this server reload or adapt weights after start (forcible with
    NPU_SHIM_MLA_RELEASE_FORCE)."""
    reasons = []
    if getattr(args, "enable_lora", None) or getattr(args, "lora_paths", None):
        reasons.append("LoRA (enable_lora / lora_paths)")
    if getattr(args, "enable_memory_saver", False):
        reasons.append("enable_memory_saver (release/resume of weights for RL refit)")
    if getattr(args, "enable_weights_cpu_backup", False):
        reasons.append("enable_weights_cpu_backup (weights are restored in place)")
    if getattr(args, "load_format", None) == "dummy":
        reasons.append("load_format=dummy (weights arrive later through update_weights_*)")
    if getattr(args, "checkpoint_engine_wait_weights_before_ready", False):
        reasons.append("checkpoint engine pushes weights")
    if getattr(args, "custom_weight_loader", None):
        reasons.append("custom_weight_loader (update_weights_from_tensor)")
    if getattr(args, "remote_instance_weight_loader_start_seed_via_transfer_engine", False):
        reasons.append("this instance seeds other instances' weights")
    return reasons


def other_reader_reasons(args):
    """Paths that read the weights after the release (not forcible)."""
    algorithm = getattr(args, "speculative_algorithm", None)
    if algorithm:
        return ["speculative decoding (%s): target-verify / draft-extend batches take the unfused "
                "path of forward_dsa_prepare_npu, which reads qkv_a_proj.weight and w_kc" % algorithm]
    return []


# ------------------------------------------------------------------------------ the implementation
# The guard its released weights get (the release itself: npu_shim/runtime/tensor_release.py), the
# accounting, the refusal of weight updates, the wrappers' per-process state
# (``MlaWeightReleaseState``) and the targets, used only where the patch is decided past its probe
# (not on a release that has the release upstream).

# Per-layer markers in the attention module's __dict__ (the hot-path check is one dict lookup).
_DONE = "_npu_shim_mla_release_done"
_FIRST = "_npu_shim_mla_release_first"

# --------------------------------------------------------------------------- the guard

# How a released MLA weight answers a touch (npu_shim/runtime/tensor_release.py frees and guards).
GUARD = tensor_release.Guard(ReleasedWeightError, "the mlaprolog path no longer reads it", SWITCH_HINT,
                             unnamed="an MLA weight", repr_unnamed="MLA weight")
is_released = tensor_release.is_released


_PREFIX = PATCH.name + ": "  # every line this patch logs starts with its name

# The disaggregation roles in which each weight may go, as upstream's release (sglang#38807)
# decides: the fused qkv_a weight on prefill and decode, w_kc on decode only; without PD (null),
# nothing.
_RELEASED_IN = {"qkv_a": ("prefill", "decode"), "w_kc": ("decode",)}


def _log_line(level, message):
    log.log(level, _PREFIX + message)


def _say_each_time(key, level, message):
    """``free_weight``'s ``say`` where no process state keeps track (``MlaWeightReleaseState.once`` says
    each ``key`` once per process): every message is logged, ``key`` is not used."""
    _log_line(level, message)


def free_weight(tensor, what, say=None):
    """``tensor_release.free_weight`` with this patch's guard; ``say(key, level, message)`` says
    why a weight is kept (``MlaWeightReleaseState.once``: once per process; None: every time)."""
    return tensor_release.free_weight(tensor, what, GUARD, say or _say_each_time)


def _layer_list(layers):
    """"layer 3", "layers 0-60", "layers 0-2, 5, ?" (ids that are not ints come last)."""
    ints = sorted(i for i in layers if isinstance(i, int))
    runs = []
    for i in ints:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    parts = ["%d" % a if a == b else "%d-%d" % (a, b) for a, b in runs]
    parts += sorted(str(i) for i in layers if not isinstance(i, int))
    return ("layer " if len(layers) == 1 else "layers ") + ", ".join(parts)


# --------------------------------------------------------------------------- the release in a process

class MlaWeightReleaseState:
    """The release in one process: what the decision read from the code (forward()'s W8A8
    attribute, where the role is published), the wrappers built on it, and what they freed.  A
    decision builds a fresh one (so uninstall/install starts over); ``details`` is the patch
    record's (``npu_shim.states()`` and status show it)."""

    def __init__(self, w8a8_attr="quantization_config", role_source="server_args", details=None):
        self.w8a8_attr = w8a8_attr
        self.role_source = role_source
        self.details = {} if details is None else details
        self.reset()

    def reset(self):
        """Start over, as a fresh decision would (tests, the demo and the bench run several
        layers' cases in one process)."""
        self.released_bytes = {"qkv_a": 0, "w_kc": 0}
        self.layers = set()
        self.guarded = {"qkv_a": set(), "w_kc": set()}  # layer ids whose weight is guarded
        self.said = set()
        self.summary_logged = False
        self.first_marked = False

    def once(self, key, level, message):
        if key not in self.said:
            self.said.add(key)
            _log_line(level, message)

    def uses_mlaprolog(self, preprocess):
        return uses_mlaprolog(preprocess, self.w8a8_attr)

    def disagg_role(self):
        return disagg_role(self.role_source)

    # -- may this process release?
    def _skip(self, key, message, detail, result):
        """Log why nothing is released (once per process and reason) and put it into status."""
        self.once(key, logging.WARNING, "releasing nothing: " + message)
        self.details.update(skipped=detail)
        return result

    def free_allowed(self, kind):
        """(role, None) when ``kind`` ("qkv_a" / "w_kc") may be released in this process, else
        (role or None, why not); every 'no' other than the role itself is logged once."""
        role, why = self.disagg_role()
        if role is None:
            self.details.update(role=None)
            return self._skip("role", "the disaggregation role is unknown when the layer decides (%s)"
                              % why, "role unknown: %s" % why, (None, why))
        self.details.update(role=role)
        if role not in _RELEASED_IN[kind]:
            return role, "role %s" % role
        try:
            args = server_args()
        except Exception as exc:  # noqa: BLE001 - unknown args: nothing is released, and the log says why
            return self._skip("args", "the server args cannot be read (%r), so LoRA / weight updates "
                                      "cannot be ruled out" % (exc,),
                              "server args unknown", (role, "server args unknown"))
        readers = other_reader_reasons(args)
        if readers:
            return self._skip("readers", "; ".join(readers), "; ".join(readers), (role, "other readers"))
        updates = ", ".join(weight_update_reasons(args))
        if updates:
            force = RELEASE_FORCE
            if not force.read():
                return self._skip("updates", "the server can reload or adapt weights (%s); set %s=1 "
                                             "to release anyway" % (updates, force.name),
                                  "weights can change: %s" % updates, (role, "weight updates"))
            self.once("forced", logging.WARNING,
                      "releasing although the server can reload or adapt weights (%s), because %s=1: "
                      "a later update of these weights raises ReleasedWeightError" % (updates, force.name))
        return role, None

    # -- releasing and the wrappers
    def _account(self, kind, layer_id, nbytes, what):
        self.released_bytes[kind] += nbytes
        self.layers.add(layer_id)
        total = sum(self.released_bytes.values())
        self.details.update(released_mib=round(total / MIB, 3), layers=len(self.layers),
                            qkv_a_mib=round(self.released_bytes["qkv_a"] / MIB, 3),
                            w_kc_mib=round(self.released_bytes["w_kc"] / MIB, 3),
                            released_bytes=total, qkv_a_bytes=self.released_bytes["qkv_a"],
                            w_kc_bytes=self.released_bytes["w_kc"])
        _log_line(logging.DEBUG, "released %s (%.2f MiB)" % (what, nbytes / MIB))
        metrics.publish()  # once per layer and weight, at the first forward: no count
        if self.summary_logged:
            self._log_summary("more layers released")

    def _log_summary(self, prefix="released"):
        self.summary_logged = True
        total = sum(self.released_bytes.values())
        _log_line(logging.INFO, "%s: %.1f MiB in %d layers (qkv_a %.1f MiB, w_kc %.1f MiB) in %s"
                  % (prefix, total / MIB, len(self.layers), self.released_bytes["qkv_a"] / MIB,
                     self.released_bytes["w_kc"] / MIB, log.pid_text()))

    def _note_guarded(self, kind, layer, tensor):
        """A guarded weight raises on every touch, freed or not (memory still held elsewhere):
        weight updates are refused from then on."""
        if is_released(tensor):
            self.guarded[kind].add(layer)

    # -- weight updates
    def released_weights(self):
        """The guarded weights, e.g. ["qkv_a_proj.weight of layers 0-60", "w_kc of layers 0-60"]."""
        return ["%s of %s" % (name, _layer_list(self.guarded[kind]))
                for kind, name in (("qkv_a", "qkv_a_proj.weight"), ("w_kc", "w_kc")) if self.guarded[kind]]

    def update_refusal(self, op):
        """The message a refused weight update answers with."""
        total = sum(self.released_bytes.values())
        return ("npu-shim refused %s: %s MLA weights this process released to free NPU memory "
                "(%s; %.1f MiB freed), so nothing was loaded and the server keeps serving its current "
                "weights. To update weights on this server, start it with %s=0 (keeps the MLA "
                "weights)" % (op, UPDATE_OPS.get(op, "the update would write into"),
                                       ", ".join(self.released_weights()), total / MIB, SWITCH.name))

    def wrap_weight_update(self, wrapped, instance, args, kwargs):
        """BaseTpWorker's weight-update methods: once a weight is guarded in this process, refuse
        up front with the (success, message) the method returns -- before anything is read or
        loaded, so nothing is applied in part and no ReleasedWeightError reaches the scheduler
        (0.5.11 - 0.5.19's disk update rolls back by loading again outside its ``try``, and the
        tensor update has no ``try``: either would take the scheduler down).  Otherwise the
        release's own method runs untouched."""
        if not (self.guarded["qkv_a"] or self.guarded["w_kc"]):
            return wrapped(*args, **kwargs)
        op = getattr(wrapped, "__name__", "the weight update")
        message = self.update_refusal(op)
        self.details["updates_refused"] = self.details.get("updates_refused", 0) + 1
        metrics.publish()  # sglang's metrics say so too
        _log_line(logging.WARNING, "refused %s: MLA weights are released in %s (%s=0 keeps them)"
                  % (op, log.pid_text(), SWITCH.name))
        return False, message

    # -- the wrappers
    def free_qkv_a(self, preprocess):
        """After ``mlaprolog_preprocess_weight``: free the fused qkv_a weight (role != null)."""
        layer = getattr(preprocess, "layer_id", "?")
        what = "qkv_a_proj.weight of layer %s" % layer
        weight = preprocess.qkv_a_proj.weight
        if weight is None or is_released(weight):
            return 0
        if not self.uses_mlaprolog(preprocess):
            self.once("disagree", logging.WARNING, "keeping %s: mlaprolog_preprocess_weight ran "
                                                   "although forward() would not route to mlaprolog" % what)
            return 0
        role, no = self.free_allowed("qkv_a")
        if no:
            return 0
        copies = [getattr(preprocess, name, None) for name in ("q_a_proj_weight", "kv_a_proj_weight")]
        if (any(c is None or tensor_release.shares_storage(c, weight) for c in copies)
                or not tensor_release.exclusive(weight)):
            self.once("qkv-shared", logging.WARNING, "keeping %s: its q_a/kv_a copies share its memory, "
                                                     "or its storage holds more than this weight" % what)
            return 0
        return self._free("qkv_a", layer, weight, what)

    def free_w_kc(self, m):
        """After ``npu_mla_preprocess`` first built ``m.mla_preprocess``: free ``m.w_kc`` (decode)."""
        layer = getattr(m, "layer_id", "?")
        what = "w_kc of layer %s" % layer
        w_kc = getattr(m, "w_kc", None)
        if w_kc is None or is_released(w_kc):
            return 0
        preprocess = m.mla_preprocess
        if not self.uses_mlaprolog(preprocess):
            return 0
        role, no = self.free_allowed("w_kc")
        if no:
            return 0
        own = getattr(preprocess, "w_kc", None)
        if own is None or own is w_kc or tensor_release.shares_storage(own, w_kc) or not tensor_release.exclusive(w_kc):
            self.once("wkc-shared", logging.WARNING, "keeping %s: the preprocessor's w_kc shares its "
                                                     "memory, or its storage holds more than this weight" % what)
            return 0
        return self._free("w_kc", layer, w_kc, what)

    def _free(self, kind, layer, tensor, what):
        nbytes = free_weight(tensor, what, self.once)
        self._note_guarded(kind, layer, tensor)
        if nbytes:
            self._account(kind, layer, nbytes, what)
        return nbytes

    def npu_mla_preprocess_for(self, original):
        """What replaces sglang's ``npu_mla_preprocess`` (``original``): a plain function of its
        own parameters (pinned, so they are these), not a wrapt proxy.  Each eager call of a layer
        it has seen is one dict lookup and one call more than sglang's (a captured NPU graph
        replays without calling Python): a wrapt ``FunctionWrapper`` packs the arguments into a
        tuple and a dict and calls through two more frames, about 7x the cost (``Wrap``'s way:
        +0.7 us per call against +0.09 us, measured side by side on CPython 3.11).  It pickles
        and copies as sglang's function does: by its module and name."""
        def npu_mla_preprocess(m, hidden_states, positions, forward_batch, zero_allocator):
            if _DONE in m.__dict__:
                # A layer seen already (every call after a layer's first, in eager mode).
                return original(m, hidden_states, positions, forward_batch, zero_allocator)
            return self._first_calls(original, m, (m, hidden_states, positions, forward_batch, zero_allocator), {})

        return functools.wraps(original)(npu_mla_preprocess)

    def _first_calls(self, wrapped, m, args, kwargs):
        if _FIRST in m.__dict__:
            # The first layer seen comes round again: one pass over all layers is done, and the
            # summary line says what it released.
            m.__dict__[_DONE] = True
            if not self.summary_logged and self.layers:
                self._log_summary()
            return wrapped(*args, **kwargs)
        had = hasattr(m, "mla_preprocess")
        result = wrapped(*args, **kwargs)
        try:
            if not had and hasattr(m, "mla_preprocess"):
                self.free_w_kc(m)
        except Exception as exc:  # noqa: BLE001 - never break the forward pass over an optimisation
            self.once("error", logging.ERROR, "keeping w_kc: deciding the release raised %r" % (exc,))
        if self.first_marked:
            m.__dict__[_DONE] = True
        else:
            self.first_marked = True
            m.__dict__[_FIRST] = True
        return result

    def wrap_preprocess_weight(self, wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        try:
            self.free_qkv_a(instance)
        except Exception as exc:  # noqa: BLE001 - never break weight loading over an optimisation
            self.once("error", logging.ERROR,
                      "keeping qkv_a_proj.weight: deciding the release raised %r" % (exc,))
        return result


# --------------------------------------------------------------------------- the targets

def targets(view, ctx):
    """What the decision reads from the code, for the wrappers (forward()'s W8A8 attribute, where
    the disaggregation role is published: ``ctx.process_state``), and the targets bound to it."""
    entry = (MLA_NPU, "npu_mla_preprocess")
    weight = (MLA_PRE, CLASS + ".mlaprolog_preprocess_weight")
    if view.function(MLA_PRE, CLASS + ".forward_mlaprolog") is None and view.function(*entry) is None:
        raise Inactive("this sglang has no mlaprolog path (it appears in 0.5.9), so there is "
                       "nothing to release")
    forward_attr = FORWARD_FINGERPRINTS.get(fingerprint(view, MLA_PRE, CLASS + ".forward"))
    role_source = "get_disagg" if view.has(RUNTIME_CONTEXT, "get_disagg") else "server_args"
    release = ctx.process_state = MlaWeightReleaseState(
        w8a8_attr=forward_attr, role_source=role_source, details=ctx.details)
    missing = [d for d in (entry, weight) if view.function(*d) is None]
    if missing:
        raise Unsupported("%s:%s not found, although this sglang has the mlaprolog path "
                          "(%s.forward_mlaprolog): renamed or moved in this image, so the shim "
                          "cannot tell what would still read the weights" % (missing[0] + (CLASS,)))
    caller = next((c for c in (SCHEDULER_MIXIN, SCHEDULER_UPDATER)
                   if view.function(c[0], c[1] + ".update_weights_from_disk") is not None), None)
    if caller is None:
        raise Unsupported("the scheduler's update_weights_from_disk was not found (%s.%s or %s.%s): "
                          "the shim cannot tell how a refused weight update would be answered, so "
                          "it releases nothing" % (SCHEDULER_MIXIN + SCHEDULER_UPDATER))
    ctx.note("frees memory only where the disaggregation role is prefill (qkv_a) or decode "
             "(qkv_a, w_kc), and not with LoRA, weight updates or speculative decoding; once "
             "it has, update_weights_* requests are refused")
    forward = (MLA_PRE, CLASS + ".forward")
    return [
        # the entry: replaced by a plain function (every eager layer call goes through it; see
        # npu_mla_preprocess_for); its pin, checked in the loaded code too, holds its parameters
        Replace(MLA_NPU, "npu_mla_preprocess", release.npu_mla_preprocess_for, rebind_copies=True,
                pins=pins(entry)),
        Wrap(MLA_PRE, weight[1], release.wrap_preprocess_weight, [()],
             pins=pins(weight, forward, (MLA_PRE, CLASS + ".forward_mlaprolog"))),
        Replace(MLA_PRE, CLASS + ".uses_mlaprolog",
                lambda _original: make_uses_mlaprolog_method(release.w8a8_attr), must_exist=False),
    ] + [
        Wrap(TP_WORKER, "BaseTpWorker." + op, release.wrap_weight_update, [UPDATE_SIG],
             pins=pins((TP_WORKER, "BaseTpWorker." + op), (caller[0], caller[1] + "." + op)))
        for op in UPDATE_OPS
    ]
