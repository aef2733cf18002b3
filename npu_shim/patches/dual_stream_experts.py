"""GLM-4.x MoE on NPU: shared experts on a side stream, fused qkv-rmsnorm-rope in decode.

Why: in a GLM-4.5/4.6/4.7 MoE layer the shared experts and the routed experts read the same
hidden states and are independent until their outputs are added, so on an NPU the shared experts
can run on a second stream while gate -> topk -> routed experts run on the main one.  In decode,
one Triton kernel of ``sgl_kernel_npu`` (``norm.split_qkv_rmsnorm_rope``) replaces the three
launches split -> q/k RMSNorm -> rope of every attention layer.

How (two sub-features, gated as upstream 0.5.10 gates them):

* dual-stream experts -- ``Glm4MoeSparseMoeBlock.forward_deepep`` is wrapped when
  ``SGLANG_NPU_USE_MULTI_STREAM=1`` (upstream's variable).  For extend/target-verify batches the
  wrapper runs shared+routed experts itself: the side stream waits for the main stream, the shared
  experts are queued on it; gate, topk and routed experts are queued on the main stream; the main
  stream waits for the side stream *before* the two outputs are added.  Decode, and empty batches,
  go to the original method.  One side stream per main stream (upstream: one per process),
  created on first use: a draft model on a stream of its own gets its own side stream.
* fused decode path -- ``Glm4MoeAttention.forward_prepare`` is wrapped when the image's
  ``sgl_kernel_npu`` has ``norm.split_qkv_rmsnorm_rope`` with the signature upstream's call binds
  and partial-rotary support, both read from the kernel's ``def`` (``kernel_support``: the same
  check on the file before anything is patched and on the loaded kernel at its first call).
  Outside extend/draft-extend/mixed (as upstream: decode, target-verify, draft-extend-v2, dLLM
  extend, idle -- every mode but those three) it calls the kernel instead of split -> qk-norm -> rope, with
  cos/sin computed once per step at the first layer.  Layers the kernel would compute differently
  (no qk-norm, q/k eps differ, non-neox rope, 2-D positions, a kernel without partial-rotary
  support) keep the original path, and the reason is put into the patch's status details.

Both wrappers re-implement part of a method body, so each target carries the AST fingerprint of
the body it stands in for (0.5.7, 0.5.8 and 0.5.9 share one): any other code is ``unsupported``.
States: ``applied`` when at least one sub-feature applies (the reason says which, and why the
other does not); ``inactive`` when the image has no usable kernel and the streams are not asked for
(nothing to do); ``unsupported`` when a fingerprint differs or the kernel's signature is one the
shim does not know; ``upstream`` from 0.5.10.  ``NPU_SHIM_DUAL_STREAM_EXPERTS=0`` (or the older
``NPU_SHIM_DUAL_STREAM=0``) switches all of it off.

Upstream: sgl-project/sglang#19246 ("[NPU] optimize glm4.7"), sglang 0.5.10
(``hardware_backend/npu/utils.py``: ``process_shared_expert``, ``wait_share_stream``).
Remove when every supported image runs sglang >= 0.5.10.
"""

import ast
import importlib
import importlib.util
import os
import threading

from npu_shim.core import config
from npu_shim.core.framework import Inactive, Patch, Report, Unsupported, Upstream
from npu_shim.reporting import metrics
from npu_shim.runtime.targets import Wrap, bind_arguments
from npu_shim.source.reading import SourceError, parse_source, read_source, unwrap


GLM4_MOE = "sglang.srt.models.glm4_moe"
NPU_UTILS = "sglang.srt.hardware_backend.npu.utils"

MULTI_STREAM = config.boolean(
    "SGLANG_NPU_USE_MULTI_STREAM", False,
    "Run GLM-4.x shared experts on a side stream during extend/verify (upstream name and meaning).")


class DualStreamExpertsReport(Report):
    def check_facts(self):
        problem = kernel_problem()
        return {"kernel": {"label": "sgl_kernel_npu", "ok": problem is None,
                           "text": "split_qkv_rmsnorm_rope usable" if problem is None else str(problem)}}


class DualStreamExperts(Patch):
    upstream = Upstream("sgl-project/sglang#19246", "0.5.10", backports=("0.5.7", "0.5.9"))
    switch = config.switch("dual_stream_experts", "Switch for the GLM-4.x MoE dual-stream experts and fused "
                           "qkv-rmsnorm-rope backport.", aliases=("NPU_SHIM_DUAL_STREAM",))
    reads = (MULTI_STREAM,)
    modules = (GLM4_MOE,)
    report = DualStreamExpertsReport()

    def probe(self, view):
        module = view.module(GLM4_MOE)
        if (module is not None and module.contains(r"process_shared_expert\(")
                and view.has(NPU_UTILS, "process_shared_expert")):
            return "glm4_moe runs shared experts through hardware_backend.npu.utils.process_shared_expert"
        return None


PATCH = DualStreamExperts()


# ------------------------------------------------------------------------------- the kernel checks
# dual_stream_experts' kernel checks: whether the image's sgl-kernel-npu
# ``norm.split_qkv_rmsnorm_rope`` takes the call the fused decode path makes, read from the kernel's
# ``def`` -- from its file before anything is patched (``kernel_problem``: nothing is imported, so
# ``status`` runs it too) and from the loaded function at its first use (``load_kernel``).
# DualStreamExpertsState, below, makes the call.

KERNEL_MODULE = "sgl_kernel_npu.norm.split_qkv_rmsnorm_rope"
KERNEL_NAME = "split_qkv_rmsnorm_rope"

# How ``DualStreamExpertsState._forward_prepare_fused`` calls the kernel (as upstream 0.5.10): these parameters by
# position, then these by keyword.  sgl-kernel-npu's history of the function: 2025-11-19
# (input, sin, cos, q_weight, k_weight, q_hidden_size, ...), full rotation; 2025-12-26 today's
# order, full rotation; 2026-03-05 partial rotation (``rope_dim = sin.shape[-1]``); 2026-05-27
# ``is_neox_style=True`` appended.
KERNEL_POSITIONAL = ("input", "sin", "cos", "q_hidden_size", "kv_hidden_size", "head_dim")
KERNEL_KEYWORDS = ("eps", "q_weight", "k_weight", "q_bias", "k_bias")


def kernel_support(node, where):
    """(problem, partial) for the ``def`` of the kernel: problem is None when the fused path's call
    (KERNEL_POSITIONAL, KERNEL_KEYWORDS) binds as meant (each argument to the parameter of that
    name, every other parameter has a default); partial is True when it rotates only
    ``sin.shape[-1]`` dims of each head (partial rotary) rather than the whole head.  The decision
    and the call-time check both ask this."""
    args = node.args
    positional = [a.arg for a in args.posonlyargs + args.args]
    keywords = set(positional[len(args.posonlyargs):]) | {a.arg for a in args.kwonlyargs}
    for index, name in enumerate(KERNEL_POSITIONAL[1:], 1):
        if index >= len(positional) or positional[index] != name:
            found = positional[index] if index < len(positional) else "nothing"
            return ("%s: parameter %d is %s where the call passes %s (a kernel signature the shim "
                    "was not written for)" % (where, index + 1, found, name)), False
    for name in KERNEL_KEYWORDS:
        if name not in keywords or name in positional[:len(KERNEL_POSITIONAL)]:
            return "%s takes no keyword argument %s" % (where, name), False
    bound = set(positional[:len(KERNEL_POSITIONAL)]) | set(KERNEL_KEYWORDS)
    defaults = positional[len(positional) - len(args.defaults):] if args.defaults else []
    unbound = [a.arg for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is None]
    unbound += [name for name in positional if name not in bound and name not in defaults]
    if unbound:
        return "%s requires %s, which the call does not pass" % (where, ", ".join(unbound)), False
    return None, _reads_width_of(node, positional[1])


def _reads_width_of(node, name):
    """Whether the function reads ``<name>.shape[-1]`` (the rotary width, from sin)."""
    for sub in ast.walk(node):
        if (isinstance(sub, ast.Subscript) and isinstance(sub.value, ast.Attribute)
                and sub.value.attr == "shape" and isinstance(sub.value.value, ast.Name)
                and sub.value.value.id == name and _is_minus_one(sub.slice)):
            return True
    return False


def _is_minus_one(node):
    return (isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub)
            and isinstance(node.operand, ast.Constant) and node.operand.value == 1) or (
        isinstance(node, ast.Constant) and node.value == -1)


def loaded_kernel_support(kernel):
    """``kernel_support`` of the imported kernel, from the source it was loaded from."""
    import inspect
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(unwrap(kernel))))
    except (OSError, TypeError, SyntaxError) as exc:
        return "cannot read the source of the loaded %s to check its signature (%r)" % (
            KERNEL_NAME, exc), False
    node = tree.body[0] if tree.body else None
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return "the loaded %s is not a plain function" % KERNEL_NAME, False
    return kernel_support(node, "the loaded " + KERNEL_NAME)


def load_kernel():
    """(kernel, partial, None): the image's kernel, imported and found to take the fused path's
    call (``partial`` as ``kernel_support`` says), or (None, None, why not)."""
    try:
        kernel = getattr(importlib.import_module(KERNEL_MODULE), KERNEL_NAME)
    except Exception as exc:  # noqa: BLE001 - an image without it keeps the original path
        return None, None, "cannot import %s.%s: %r" % (KERNEL_MODULE, KERNEL_NAME, exc)
    problem, partial = loaded_kernel_support(kernel)
    if problem:
        return None, None, problem
    return kernel, partial, None


# -- kernel availability, decided before anything is patched -------------------------------------

class KernelProblem:
    """Why the fused path cannot be used (``text``; ``str()`` of it); ``absent``: the image has no
    such kernel (an older or no sgl-kernel-npu: nothing to do) rather than one the shim cannot
    call (unsupported)."""

    def __init__(self, text, absent=False):
        self.text = text
        self.absent = absent

    def __str__(self):
        return self.text

    def __repr__(self):
        return "KernelProblem(%r, absent=%r)" % (self.text, self.absent)


def _absent(text):
    return KernelProblem(text, absent=True)


def kernel_problem():
    """None when the image's sgl_kernel_npu provides a usable ``norm.split_qkv_rmsnorm_rope``,
    else why not (a KernelProblem).  A package on disk is read as text (nothing is imported:
    ``status`` runs it)."""
    try:
        top = importlib.util.find_spec("sgl_kernel_npu")
    except (ImportError, ValueError) as exc:
        return KernelProblem("sgl_kernel_npu cannot be located: %r" % (exc,))
    if top is None:
        return _absent("sgl_kernel_npu is not installed")
    for location in list(top.submodule_search_locations or []):
        if not os.path.isdir(location):
            continue
        path = os.path.join(location, "norm", KERNEL_NAME + ".py")
        if not os.path.isfile(path):
            return _absent("sgl_kernel_npu at %s has no norm/%s.py (an older sgl-kernel-npu)"
                           % (location, KERNEL_NAME))
        try:
            tree = parse_source(read_source(path), path)
        except (SourceError, OSError) as exc:
            return KernelProblem(str(exc))
        node = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == KERNEL_NAME),
                    None)
        if node is None:
            return _absent("%s defines no %s()" % (path, KERNEL_NAME))
        problem, partial = kernel_support(node, "%s %s()" % (path, KERNEL_NAME))
        if problem:
            return KernelProblem(problem)
        if not partial:
            return _absent("%s has no partial-rotary support (GLM-4.x rotates half of each head; "
                    "this kernel would rotate all of it)" % path)
        return None
    # Not a directory package (zip, or a finder of its own): ask the import system.
    try:
        spec = importlib.util.find_spec(KERNEL_MODULE)
    except (ImportError, ValueError, AttributeError):
        spec = None
    return None if spec is not None else _absent("sgl_kernel_npu has no norm.%s" % KERNEL_NAME)


# ------------------------------------------------------------------------------ the implementation
# The wrappers' per-process state (``DualStreamExpertsState``) and the targets, used only where
# the patch is decided past its probe (not on a release that has the feature upstream).

DEEPEP = "Glm4MoeSparseMoeBlock.forward_deepep"
PREPARE = "Glm4MoeAttention.forward_prepare"
DEEPEP_PARAMS = ("hidden_states", "forward_batch")
PREPARE_PARAMS = ("positions", "hidden_states", "forward_batch")

# Fingerprints (reading.fingerprint_node: the same on every Python) of the bodies the wrappers
# stand in for, measured on the 0.5.7, 0.5.8 and 0.5.9 wheels (one body in all three).
DEEPEP_FINGERPRINTS = {"12fa6dbf452e9ddf": "0.5.7-0.5.9"}
PREPARE_FINGERPRINTS = {"e70a3adaa34177b5": "0.5.7-0.5.9"}

# -- the backport in one process ------------------------------------------------------------------

def _device_module():
    import torch

    return torch.get_device_module()


def _dual_stream_modes(mode_class):
    """The forward modes upstream 0.5.10 runs on two streams: extend (which includes mixed /
    draft-extend) or target-verify; decode stays single-stream (its launches are too small to gain,
    and it runs in captured graphs).  Read once from the release's own predicates, so that a decode
    call, which only passes through the wrapper, asks one set membership (docs/performance.md,
    the decode row)."""
    return frozenset(m for m in mode_class if m.is_extend() or m.is_target_verify())


def _layer_key(attn):
    rotary = attn.rotary_emb
    q_norm = getattr(attn, "q_norm", None)
    k_norm = getattr(attn, "k_norm", None)
    return (
        type(rotary), attn.head_dim, getattr(rotary, "rotary_dim", None),
        getattr(rotary, "is_neox_style", None), bool(getattr(attn, "use_qk_norm", False)),
        getattr(q_norm, "variance_epsilon", None), getattr(k_norm, "variance_epsilon", None),
    )


class DualStreamExpertsState:
    """Both sub-features in one process: the side streams, the kernel and each layer's plan, and
    how often each path ran Python (``details["counts"]``).  A decision builds a fresh
    one (so uninstall/install starts over); ``details`` is the patch record's."""

    def __init__(self, details=None):
        self.details = {} if details is None else details
        self.lock = threading.Lock()
        self.side_streams = {}      # main stream -> its side stream
        self.kernel = None          # the imported split_qkv_rmsnorm_rope
        self.kernel_error = None    # why it could not be imported/used
        self.kernel_partial = None  # True/False once its signature was read (kernel_support)
        self.layer_plans = {}       # layer-config key -> None (fused) or reason (original path)
        self.dual_stream_modes = None  # _dual_stream_modes, at the first call
        self.verify_mode = None     # the release's ForwardMode.TARGET_VERIFY, at the first call
        # How often each path ran Python: eager forwards, graph warm-ups and captures (a replayed
        # graph runs no Python, so decode steps under NPU graphs are not counted).
        # dual_stream_python_calls: every dual-stream forward_deepep; dual_stream_verify_python_calls:
        # those of them for target-verify batches (speculative decoding), apart from prefills.
        # One increment a call: sglang's metrics get them when its scheduler logs its stats
        # (npu_shim/runtime/metrics_hook.py), never from a forward.
        self.counts = {"dual_stream_python_calls": 0, "dual_stream_verify_python_calls": 0,
                       "fused_python_calls": 0}
        self.details["counts"] = self.counts  # live: npu_shim.states() shows how often each path ran

    def _note(self, key, value):
        self.details[key] = value

    # -- the side streams: device-agnostic like upstream's hardware_backend/npu/utils.py
    def side_stream_for(self, main):
        """The side stream that serves ``main``, created on its first use.

        One per main stream, not one per process as upstream: the shared output is allocated on
        the side stream, used and freed on the main stream, so its block goes back to the side
        stream's pool with no record_stream.  That is safe only while every later allocation on
        the side stream comes after a wait for that main stream.  A second main stream feeding the
        same side stream (speculative decoding's draft on its own stream, sglang#30965) breaks it:
        the side stream waits for the draft, not for the target, and hands the target's block to
        the draft's shared experts while the target may still read it."""
        side = self.side_streams.get(main)
        if side is None:
            with self.lock:
                side = self.side_streams.get(main)
                if side is None:
                    side = self.side_streams[main] = _device_module().Stream()
                    self._note("side_streams", {repr(m): repr(s) for m, s in self.side_streams.items()})
                    # a number in sglang's metrics: more than 1 is two main streams sharing the
                    # layers (sglang#30965's case), each with its own side stream
                    self.details["side_stream_count"] = len(self.side_streams)
                    metrics.publish()  # once per main stream, not per call
        return side

    def process_shared_expert(self, hidden_states, forward_func):
        """Queue ``forward_func(hidden_states)`` on the current stream's side stream, after all the
        current stream has queued so far (the side stream waits for it), and return its output."""
        device = _device_module()
        main = device.current_stream()
        side = self.side_stream_for(main)
        side.wait_stream(main)
        with device.stream(side):
            return forward_func(hidden_states)

    def wait_share_stream(self):
        """The current (main) stream waits for everything queued on its side stream."""
        main = _device_module().current_stream()
        side = self.side_streams.get(main)
        if side is not None:
            main.wait_stream(side)

    # -- the dual-stream forward_deepep
    def forward_deepep_wrapper(self, wrapped, instance, args, kwargs):
        if len(args) == 2 and not kwargs:  # as sglang's forward calls it: no binding to pay
            hidden_states, forward_batch = args
        else:
            bound = bind_arguments(DEEPEP_PARAMS, args, kwargs)
            hidden_states, forward_batch = bound["hidden_states"], bound["forward_batch"]
        mode = forward_batch.forward_mode
        modes = self.dual_stream_modes
        if modes is None:
            self.verify_mode = getattr(type(mode), "TARGET_VERIFY", None)
            modes = self.dual_stream_modes = _dual_stream_modes(type(mode))
        if mode not in modes or hidden_states.shape[0] == 0:
            return wrapped(*args, **kwargs)
        if mode is self.verify_mode:
            self.counts["dual_stream_verify_python_calls"] += 1
        return self._forward_deepep_dual_stream(wrapped, instance, hidden_states, forward_batch)

    def _forward_deepep_dual_stream(self, wrapped, block, hidden_states, forward_batch):
        """0.5.7-0.5.9's forward_deepep (fingerprinted) for a non-empty batch, streams added.

        Data dependencies: both streams only read ``hidden_states`` until the main stream has waited
        for the side stream, and only then is the shared output written (``add_``).  The shared output
        and the side stream's temporaries come from the side stream's memory pool; the side stream
        serves this main stream only, so its next allocation happens after its next
        ``wait_stream(main)`` and no block is reused while the main stream may still read it (hence
        no ``record_stream``).  Checked by the simulated NPU's stream sanitizer on 0.5.7-0.5.9's
        code, two main streams included (tests/patches/test_dual_stream_experts*.py).
        """
        dispatch_info = unwrap(wrapped).__globals__["ExpertLocationDispatchInfo"]
        shared_output = self.process_shared_expert(hidden_states, block._forward_shared_experts)
        # router_logits: (num_tokens, n_experts)
        router_logits = block.gate(hidden_states)
        topk_output = block.topk(
            hidden_states,
            router_logits,
            num_token_non_padded=forward_batch.num_token_non_padded,
            expert_location_dispatch_info=dispatch_info.init_new(layer_id=block.layer_id),
        )
        final_hidden_states = block.experts(hidden_states=hidden_states, topk_output=topk_output)
        self.wait_share_stream()
        self.counts["dual_stream_python_calls"] += 1

        if shared_output is not None:
            x = shared_output
            if block.experts.should_fuse_routed_scaling_factor_in_topk:
                x.add_(final_hidden_states)
            else:
                x.add_(final_hidden_states, alpha=block.routed_scaling_factor)
            final_hidden_states = x
        else:
            if not block.experts.should_fuse_routed_scaling_factor_in_topk:
                final_hidden_states *= block.routed_scaling_factor
        return final_hidden_states

    # -- the fused forward_prepare
    def forward_prepare_wrapper(self, wrapped, instance, args, kwargs):
        bound = bind_arguments(PREPARE_PARAMS, args, kwargs)
        hidden_states = bound["hidden_states"]
        forward_batch = bound["forward_batch"]
        positions = bound["positions"]
        # Upstream 0.5.10 takes the fused path in every mode but extend/draft-extend/mixed.
        if hidden_states.shape[0] == 0 or forward_batch.forward_mode.is_extend_or_draft_extend_or_mixed():
            return wrapped(*args, **kwargs)
        kernel = self._fused_kernel_for(instance, positions)
        if kernel is None:
            return wrapped(*args, **kwargs)
        return self._forward_prepare_fused(instance, kernel, positions, hidden_states, forward_batch)

    def _forward_prepare_fused(self, attn, kernel, positions, hidden_states, forward_batch):
        """0.5.7-0.5.9's forward_prepare (fingerprinted) for a non-empty batch, split -> qk-norm ->
        rope done by one kernel."""
        qkv, _ = attn.qkv_proj(hidden_states)
        rotary = attn.rotary_emb
        # cos/sin once per step, at the first layer (get_rope shares one rotary object between the
        # layers); also when this object has none of this batch's size yet.
        cos = rotary.position_cos
        if (attn.attn.layer_id == forward_batch.token_to_kv_pool.start_layer
                or cos is None or cos.shape[0] != qkv.shape[0]):
            rotary.get_cos_sin_with_position(positions)
        q, k, v = kernel(
            qkv,
            rotary.position_sin,
            rotary.position_cos,
            attn.q_size,
            attn.kv_size,
            attn.head_dim,
            eps=attn.q_norm.variance_epsilon,
            q_weight=attn.q_norm.weight,
            k_weight=attn.k_norm.weight,
            q_bias=getattr(attn.q_norm, "bias", None),
            k_bias=getattr(attn.k_norm, "bias", None),
        )
        self.counts["fused_python_calls"] += 1
        inner_state = q, k, v, forward_batch
        return None, forward_batch, inner_state

    def _fused_kernel_for(self, attn, positions):
        """The kernel when it computes exactly what this layer's original path computes, else None
        (the reason goes into the status details once)."""
        if positions.ndim != 1:
            return None  # multimodal rope (2-D positions): upstream's get_cos_sin rejects it too
        key = _layer_key(attn)
        plans = self.layer_plans
        if key not in plans:
            with self.lock:
                if key not in plans:
                    plans[key] = self._plan_layer(attn)
                    if plans[key] is not None:
                        self._note("fused_fallback", plans[key])
        if plans[key] is not None:
            return None
        return self.kernel

    def _plan_layer(self, attn):
        """None when the fused kernel fits this layer, else why the original path is kept."""
        kernel = self._load_kernel()
        if kernel is None:
            return self.kernel_error
        rotary = attn.rotary_emb
        if not getattr(attn, "use_qk_norm", False):
            return "layer has no q/k RMSNorm (the kernel always normalises)"
        if attn.q_norm.variance_epsilon != attn.k_norm.variance_epsilon:
            return "q_norm and k_norm use different eps (the kernel takes one)"
        if not hasattr(rotary, "get_cos_sin_with_position") or getattr(rotary, "is_neox_style", True) is not True:
            return "%s is not a neox-style RotaryEmbedding with get_cos_sin_with_position" % type(rotary).__name__
        rotary_dim = getattr(rotary, "rotary_dim", attn.head_dim)
        if rotary_dim != attn.head_dim and not self.kernel_partial:
            return ("rope rotates %d of %d head dims and this %s has no partial-rotary support"
                    % (rotary_dim, attn.head_dim, KERNEL_NAME))
        return None

    def _load_kernel(self):
        if self.kernel is None and self.kernel_error is None:
            kernel, partial, self.kernel_error = load_kernel()
            if kernel is not None:
                self.kernel_partial = partial
                self.kernel = kernel
        return self.kernel


# -- targets --------------------------------------------------------------------------------------

def targets(view, ctx):
    """The targets of a decision: the dual-stream forward_deepep when the job asks for the streams
    (or when asked "would it apply if on?"), the fused forward_prepare when the image's kernel is
    usable; a Verdict when neither.  Nothing else makes the whole patch inactive: the fused path
    is on by default on an NPU, as upstream."""
    streams = ctx.assume_triggered or MULTI_STREAM.read(ctx.environ)
    problem = kernel_problem()
    process = ctx.process_state = DualStreamExpertsState(ctx.details)
    deepep = Wrap(GLM4_MOE, DEEPEP, process.forward_deepep_wrapper, [DEEPEP_PARAMS],
                  pins={(GLM4_MOE, DEEPEP): DEEPEP_FINGERPRINTS})
    prepare = Wrap(GLM4_MOE, PREPARE, process.forward_prepare_wrapper, [PREPARE_PARAMS],
                   pins={(GLM4_MOE, PREPARE): PREPARE_FINGERPRINTS})
    parts, chosen = [], []
    if streams:
        chosen.append(deepep)
        parts.append("dual-stream experts on")
    else:
        parts.append("dual-stream experts off (%s is not on)" % MULTI_STREAM.name)
    if problem is None:
        chosen.append(prepare)
        parts.append("fused qkv-rmsnorm-rope decode path on")
    else:
        parts.append("fused qkv-rmsnorm-rope decode path %s: %s"
                     % ("off" if getattr(problem, "absent", False) else "unsupported", str(problem)))
    if not chosen:
        raise (Inactive if getattr(problem, "absent", False) else Unsupported)("; ".join(parts))
    for part in parts:
        ctx.note(part)
    return chosen
