"""The benchmarks: the rows of ``scripts/bench.py``'s table (``bench_rows``) and the code that
measures them -- the hot path (``hot_path_bench``, ``hot_path_rows``), the dual-stream overlap
(``dual_stream_bench``), the MLA release (``mla_real_bench``), arms timed in alternating rounds
(``interleave``) -- and the CUDA Sanitizer cross-check a device run makes (``csan_check``)."""
