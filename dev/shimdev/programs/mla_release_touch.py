"""A released weight touched (tests/patches/test_mla_weight_release_real.py): the process exits
with the error, not a signal.  Argument: which touch (``TOUCHES``)."""
from shimdev.beds import mla_kernels as K
from shimdev.programs import arg, emit

#: How a released weight is touched: the fused qkv_a projection called, or w_kc read.
TOUCHES = {
    "fused_qkv_a_proj_with_mqa(x)": lambda m: m.fused_qkv_a_proj_with_mqa(K.torch.zeros(1, 6144, dtype=K.DTYPE)),
    "w_kc.sum()": lambda m: m.w_kc.sum(),
}

touch = TOUCHES[arg(0)]
K.publish_server_args("decode")
r = K.run_layer("glm-5", 16)
assert r["freed"] == r["expected"], r
m = r["layer"]
print("released; touching", flush=True)
touch(m)
emit({"survived": True})
