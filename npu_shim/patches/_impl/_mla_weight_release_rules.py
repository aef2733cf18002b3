"""mla_weight_release's rules: whether a layer's ``forward()`` takes the mlaprolog path (the
predicate), which disaggregation role this process has, and what else would read or write the
weights after a release (the server's arguments).  Each is a question about sglang's own objects,
asked when a layer decides; npu_shim/patches/_impl/mla_weight_release.py acts on the answers.

A helper of that implementation module, not a patch's: its name begins with ``_``, which no
patch's name can (``core.framework``), so ``Patch.implementation`` never mistakes it for one."""

import re

from npu_shim.patches.mla_weight_release import CLASS, ROLES

# -- the predicate

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

    method.__name__, method.__qualname__ = "uses_mlaprolog", CLASS + ".uses_mlaprolog"
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
