"""The beds the tests stand on inside a release process (simulated NPU, real sglang): set-ups over a
release's real modules (``release_beds``), the demo's drivers (``demo_features``), the child-process
probes (``import_probe``, ``drop_in_probe``), the dual-stream path under the stream sanitizer
(``stream_races``), the NPU kernel stand-ins (``mla_kernels``, ``dual_stream_kernels``), and what each
patch is expected to do per release (``expected_states``, ``release_report``)."""
