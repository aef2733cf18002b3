"""The environments the code runs in: every sglang release's layered environment (``sglang_envs``,
its ``releases``, ``wheels``, ``npu_layers``, the ``buildcache`` under them), the test runner's venv
(``runner``), what a machine needs (``machine``), running code in a release (``realsglang``), the
deploy recipes' container images (``containers``, ``fake_launch_server``), and the two tools the test
command and maintainers run in those environments (``lint``, ``mutation``)."""
