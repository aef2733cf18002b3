"""The shim's dual-stream body under PyTorch's own CUDA Sanitizer (``TORCH_CUDA_SANITIZER=1``): a
cross-check, on a CUDA device, of the simulated NPU's stream sanitizer (run by
scripts/csan_dual_stream.py; its cases are also run under the simulated NPU's sanitizer by
tests/dev/test_simnpu_sanitizer.py, which keeps ``OURS`` honest).

Each case drives ``DualStreamExpertsState._forward_deepep_dual_stream`` (npu_shim/patches/dual_stream_experts.py)
on the benchmark's synthetic MoE block (npu_shim/patches/_selftest/_synthetic_moe.py) through
``torch.get_device_module()``, so the same code runs on the simulated NPU and on CUDA.  On CUDA each
case runs in a child process with ``TORCH_CUDA_SANITIZER=1`` (CSAN must be on before the first
CUDA call, and it raises at the first race it finds).

``OURS`` is what the simulated NPU's sanitizer reports for each case, ``CSAN`` what PyTorch's
should say: a race (True) or nothing (False).  CSAN has no model of the caching allocator's
per-stream pools -- it forgets a block's accesses when the block is allocated again -- so the
unsafe reuse of ``shared_side_stream`` is ours alone; CSAN must stay silent there.

Not yet run on a CUDA device (none was available where this was written).
"""
from __future__ import annotations

import os
import subprocess
import sys
import types

SMALL = dict(tokens=64, hidden=128, shared_inter=256, experts=4, topk=2, expert_inter=64)
BATCH = types.SimpleNamespace(num_token_non_padded=None)

#: What the simulated NPU's sanitizer reports per case (sorted kinds).
OURS = {
    "backport": [],
    "two_main_streams": [],
    "removed_wait": ["write-after-write"],
    "side_does_not_wait": ["read-after-write"],
    "in_place_routed": ["write-after-read"],
    "shared_side_stream": ["unsafe-reuse"],
}
#: Whether CSAN should report a race per case.
CSAN = {"backport": False, "two_main_streams": False, "removed_wait": True,
        "side_does_not_wait": True, "in_place_routed": True, "shared_side_stream": False}


def _layer(process, block, hidden):
    from shimdev.bench import dual_stream_bench

    return process._forward_deepep_dual_stream(dual_stream_bench._serial_forward, block, hidden, BATCH)


def _two_layers(process, block, hidden):
    out = _layer(process, block, hidden)
    residual = out + hidden  # the decoder layer reads the output on the main stream
    del out
    return _layer(process, block, residual)


def _draft_between_target_layers(dm, process, block, hidden):
    import torch

    out = _layer(process, block, hidden)
    residual = out + hidden
    del out
    with dm.stream(dm.Stream()):  # the draft model on a stream of its own
        _layer(process, block, torch.randn_like(hidden))
    return _layer(process, block, residual)


def run_case(name, dm, block, hidden):
    """Run one case with the device module ``dm`` (torch.npu simulated, or torch.cuda)."""
    from npu_shim.patches import dual_stream_experts as ds

    process = ds.DualStreamExpertsState()
    if name == "backport":
        return _two_layers(process, block, hidden)
    if name == "two_main_streams":
        return _draft_between_target_layers(dm, process, block, hidden)
    if name == "removed_wait":
        process.wait_share_stream = lambda: None
        return _two_layers(process, block, hidden)
    if name == "side_does_not_wait":
        side = dm.Stream()

        def no_wait(hidden_states, forward_func):
            with dm.stream(side):
                return forward_func(hidden_states)

        process.process_shared_expert = no_wait
        process.wait_share_stream = lambda: dm.current_stream().wait_stream(side)
        return _layer(process, block, hidden * 2)  # written on the main stream just before
    if name == "in_place_routed":
        from shimdev.beds.stream_races import in_place

        block.experts = in_place(block.experts)
        return _layer(process, block, hidden)
    if name == "shared_side_stream":  # the backport before its fix, as upstream: one side stream
        side = dm.Stream()
        process.side_stream_for = lambda main: process.side_streams.setdefault(main, side)
        return _draft_between_target_layers(dm, process, block, hidden)
    raise ValueError("no case %r" % name)


def build(device, dtype=None):
    import torch

    from shimdev.bench import dual_stream_bench

    params = dict(dual_stream_bench.DEFAULTS, **SMALL)
    dtype = dtype or (torch.float32 if device == "cpu" else torch.bfloat16)
    block = dual_stream_bench.build_block(device, dtype, params)
    hidden = torch.randn(params["tokens"], params["hidden"], device=device, dtype=dtype)
    return block, hidden


# ------------------------------------------------------------------------------ on CUDA

def cuda_available():
    try:
        import torch
    except ImportError:
        return False, "torch is not installed"
    if not torch.cuda.is_available():
        return False, "no CUDA device on this machine"
    return True, torch.cuda.get_device_name(0)


def child(name):
    """One case under CSAN (this process was started with TORCH_CUDA_SANITIZER=1): exit 0
    silent, 3 with CSAN's report on stderr."""
    import torch
    from torch.cuda._sanitizer import CUDASanitizerErrors

    real_get = torch.get_device_module
    torch.get_device_module = lambda d=None: real_get("cuda" if d is None else d)
    block, hidden = build("cuda")
    try:
        with torch.no_grad():
            run_case(name, torch.cuda, block, hidden)
        torch.cuda.synchronize()
    except CUDASanitizerErrors as exc:
        print("CSAN: %s" % exc, file=sys.stderr)
        return 3
    return 0


def run_under_csan(name, repo):
    env = dict(os.environ, TORCH_CUDA_SANITIZER="1",
               PYTHONPATH=os.pathsep.join([os.path.join(repo, "dev"), repo]))
    proc = subprocess.run([sys.executable, os.path.join(repo, "scripts", "csan_dual_stream.py"),
                           "--case", name], env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode not in (0, 3):
        raise RuntimeError("case %s exited %d:\n%s" % (name, proc.returncode, proc.stderr[-3000:]))
    return proc.returncode == 3, proc.stderr


def main(argv, repo):
    if len(argv) == 2 and argv[0] == "--case":
        return child(argv[1])
    ok, why = cuda_available()
    if not ok:
        print("not run: %s (this cross-check needs a CUDA device)" % why)
        return 2
    print("CUDA device: %s" % why)
    agree = True
    for name in OURS:
        raced, stderr = run_under_csan(name, repo)
        same = raced == CSAN[name]
        agree &= same
        print("%-20s ours %-22s CSAN %-8s %s" % (name, ",".join(OURS[name]) or "nothing",
                                                 "race" if raced else "silent", "ok" if same else "DIFFERS"))
        if raced and not same:
            print("    " + stderr.strip().replace("\n", "\n    ")[:3000])
    return 0 if agree else 1
