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
    4. ``npu_mla_preprocess`` is wrapped: on the call that first constructed the layer's
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

from npu_shim.core import config
from npu_shim.core.framework import Patch, Report

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
    title = "Free MLA weights the mlaprolog path no longer reads (PD disaggregation)"
    upstream_pr = "sgl-project/sglang#38807"
    upstream_release = "0.5.20"
    backport_range = ("0.5.9", "0.5.19")
    remove_when = "every supported image runs sglang >= 0.5.20"
    switch_doc = "Switch for freeing MLA weights the mlaprolog path no longer reads (PD disaggregation only)."
    reads = (RELEASE_FORCE,)
    trigger_env = {}  # on by default; the disaggregation role decides in the server
    modules = (MLA_PRE, MLA_NPU, TP_WORKER)
    report = MlaWeightReleaseReport()

    def probe(self, view):
        if view.has(MLA_PRE, CLASS + ".uses_mlaprolog"):
            return "%s.uses_mlaprolog exists (and the release with it)" % CLASS
        return None


PATCH = MlaWeightRelease()
SWITCH = MlaWeightRelease.switch
SWITCH_HINT = "set %s=0 to keep the MLA weights (turns the release off)" % SWITCH.name
