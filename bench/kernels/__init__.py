"""The kernel benchmarks: the routing glue kernels (run, ``python -m bench.kernels``; the dense kernels'
rows from dense), the grouped-GEMM experts (experts, ``python -m bench.kernels.experts``) and the sm_90
compile check (compile_check, ``python -m bench.kernels.compile_check``; its cases in compile_cases)."""
