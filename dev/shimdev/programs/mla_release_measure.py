"""What mla_weight_release frees per layer in one release process, for each (model, tp, role)
case of the argument (shimdev.bench.mla_real_bench.measure, the bench table's MLA rows)."""
from shimdev.programs import arg, emit
from npu_shim.runtime import activation
from npu_shim.patches import mla_weight_release  # noqa: F401 - loaded before the first layer, as it was
from shimdev.beds import mla_kernels as K

results = []
for model, tp, role in arg(0):
    record = activation.RUNTIME.record("mla_weight_release")  # None until the first layer imported its modules
    if record is not None:
        record.process_state.reset()
    K.publish_server_args(role)
    r = K.run_layer(model.lower(), tp)
    r.pop("layer")
    c = K.CONFIGS[model.lower()]
    shape_qkv = (c["q_lora"] + c["kv_lora"] + c["rope"]) * c["hidden"] * 2
    shape_w_kc = (c["heads"] // tp) * c["nope"] * c["kv_lora"] * 2 if role == "decode" else 0
    results.append({"model": model, "tp": tp, "role": role, "layers": c["layers"],
                    "freed": r["freed"], "before": r["before"], "after": r["after"],
                    "shape": {"qkv_a": shape_qkv, "w_kc": shape_w_kc},
                    "kernels": r["kernels"]})
emit({"state": activation.RUNTIME.states()["mla_weight_release"]["state"], "results": results})
