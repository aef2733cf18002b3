"""``python -m shimdev.server.launch ARGS``: ``python -m sglang.launch_server ARGS`` on the
simulated NPU.

The simulated NPU must be in place before the first sglang import in every process of the
server.  sglang starts its scheduler and detokenizer with multiprocessing's spawn, whose child
re-imports the parent's main module (as ``__mp_main__``) before it unpickles its target -- so this
module, as the main module, installs the simulation in the launcher and in each child before any
sglang code runs, and the launcher then runs sglang's own ``launch_server`` main unchanged.  The
shim's ``sitecustomize`` is active in all of them exactly as on a node (it runs before this
module and imports no sglang).

``SIMNPU_RELEASE`` names the release whose stub set to use; ``SIMNPU_TOTAL_MIB`` /
``SIMNPU_FREE_MIB`` size the device.
"""
import os
import runpy
import sys

if __name__ in ("__main__", "__mp_main__"):
    from shimdev import simnpu

    simnpu.install(release=os.environ.get("SIMNPU_RELEASE"), server=True)

if __name__ == "__main__":
    sys.argv[0] = "sglang.launch_server"
    # alter_sys=False: this module stays __main__, so spawned children re-import it (not sglang's).
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=False)
