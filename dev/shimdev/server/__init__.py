"""The real-server test bed: ``python -m sglang.launch_server`` of a real release, with its real
process tree, on the simulated NPU, answering the real ``openai`` client.

* ``models``  tiny random-weight models and a byte-level BPE tokenizer, made locally (no hub) and
              cached by content under ``CACHE/models``;
* ``layer``   the packages a server needs beyond the import set of the release environments, and
              the server venv (the base plus a ``.pth`` that imports ``startup``);
* ``startup`` the simulated NPU installed in the launcher and in every spawned child of
              ``python -m sglang.launch_server``, before its first sglang import;
* ``process`` one server: start it in its own process group, wait until it answers, talk to it,
              stop its whole tree (on failure too) and prove nothing of it is left.
"""
