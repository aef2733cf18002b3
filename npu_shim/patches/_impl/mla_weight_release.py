"""mla_weight_release's implementation: the guard its released weights get (the release itself:
npu_shim/runtime/tensor_release.py), the accounting, the refusal of weight updates and the
wrappers' per-process state (``MlaWeightReleaseState``), and the targets.  When a weight may go
(the mlaprolog predicate, the disaggregation role, the server's arguments) is
_mla_weight_release_rules.py beside it.  Loaded only where the patch is decided past its probe (not
on a release that has the release upstream): npu_shim/patches/mla_weight_release.py is the patch
and its documentation."""

import functools
import logging

from npu_shim.core.framework import Inactive, Unsupported
from npu_shim.patches._impl._mla_weight_release_rules import (
    disagg_role, make_uses_mlaprolog_method, other_reader_reasons, server_args, uses_mlaprolog,
    weight_update_reasons)
from npu_shim.patches.mla_weight_release import (
    CLASS, FORWARD_FINGERPRINTS, MIB, MLA_NPU, MLA_PRE, PATCH, RELEASE_FORCE, RUNTIME_CONTEXT,
    SCHEDULER_MIXIN, SCHEDULER_UPDATER, SWITCH, SWITCH_HINT, TP_WORKER, UPDATE_OPS, UPDATE_SIG,
    ReleasedWeightError, fingerprint, pins)
from npu_shim.reporting import log, metrics
from npu_shim.runtime import tensor_release
from npu_shim.runtime.targets import Replace, Wrap

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
