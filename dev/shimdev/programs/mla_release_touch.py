"""A released weight touched (tests/patches/test_mla_weight_release_real.py): the process exits
with the error, not a signal."""
from shimdev import mla_kernels as K
K.publish_server_args("decode")
r = K.run_layer("glm-5", 16)
assert r["freed"] == r["expected"], r
m = r["layer"]
print("released; touching", flush=True)
{touch}
emit({{"survived": True}})
