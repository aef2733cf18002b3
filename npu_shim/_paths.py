"""Where the shim is: its package directory and the directory above it (a checkout's or a bundle's
root, the one that goes on PYTHONPATH).  One definition for the commands, install() and the
wrapt loader."""

import os

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(PACKAGE_DIR)
