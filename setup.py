"""Packaging; metadata lives in setup.cfg.  One addition: the ``.pth`` that lets a pip-installed
npu-shim activate itself in every Python process when ``NPU_SHIM_ACTIVATE=1`` is set (the
equivalent of putting the repository on PYTHONPATH, whose sitecustomize.py does the same)."""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH_NAME = "npu_shim-activate.pth"  # npu_shim/runtime/installer.py's PTH_NAME
# One line: site.py executes .pth lines that start with "import".  Costs a dict lookup when unset.
PTH_LINE = ("import os; os.environ.get('NPU_SHIM_ACTIVATE', '').strip().lower() in "
            "('1', 'true', 'yes', 'on') and __import__('npu_shim._bootstrap')._bootstrap.start()\n")


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        with open(os.path.join(self.build_lib, PTH_NAME), "w") as handle:
            handle.write(PTH_LINE)


setup(cmdclass={"build_py": BuildPyWithPth})
