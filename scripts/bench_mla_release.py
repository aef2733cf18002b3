"""mla_weight_release: memory freed, measured in one run (the per-call cost of its
``npu_mla_preprocess`` wrapper, before and after the first pass: scripts/bench_hot_path.py).

* bytes freed per layer and per full model, DeepSeek-V3(.2) and GLM-5 attention shapes (public
  configs) at attention TP 1 / 8 / 16 on decode, TP 8 on prefill: driven through the REAL sglang
  0.5.11 ``npu_mla_preprocess`` on the simulated NPU (dev/shimdev/bench/mla_real_bench.py); freed = the
  weights' ``untyped_storage().nbytes()`` before - after, compared with the bytes the weights' shapes
  say no consumer reads (the original fused qkv_a weight; ``w_kc`` on decode).  Target: 100 %.

Usage: python3 scripts/bench_mla_release.py
"""

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(REPO, "dev"), REPO]  # shimdev (dev/shimdev/__init__.py), npu_shim

MIB = 1 << 20


def memory_rows():
    from shimdev.bench import mla_real_bench
    from shimdev.bench.bench_rows import mla_row

    out = mla_real_bench.measure()
    if out["state"] != "applied":
        raise RuntimeError("mla_weight_release is %s in the sglang %s process" % (out["state"], mla_real_bench.RELEASE))
    rows = []
    for r in out["results"]:
        freed, shape = sum(r["freed"].values()), sum(r["shape"].values())
        share = 100.0 * freed / shape if shape else float("nan")
        rows.append({
            "what": mla_row(r["model"], r["tp"], r["role"]),
            "how": "synthetic layer of the public config's shape (bf16 CPU tensors) through sglang "
                   "%s's own npu_mla_preprocess, 2 steps (%s); storage nbytes before - after"
                   % (mla_real_bench.RELEASE, " + ".join(sorted(set(r["kernels"])))),
            "measured": "%.2f MiB per layer (qkv_a %.2f + w_kc %.2f) = %.0f MiB per NPU over %d layers; "
                        "%.1f %% of the %.2f MiB the shapes say is unread"
                        % (freed / MIB, r["freed"]["qkv_a"] / MIB, r["freed"]["w_kc"] / MIB,
                           freed * r["layers"] / MIB, r["layers"], share, shape / MIB),
            "target": "100 % of the bytes no consumer reads",
            "ok": r["freed"] == r["shape"],
        })
    return rows


def rows():
    return memory_rows()


if __name__ == "__main__":
    for row in rows():
        print("%-70s %-8s %s" % (row["what"], "ok" if row["ok"] else "MISSED", row["measured"]))
