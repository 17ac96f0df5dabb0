"""Process environment every role gets, whoever starts it (the supervisor, the benchmarks)."""

from __future__ import annotations


def tuning_env(threads: int) -> dict[str, str]:
    """numpy/BLAS thread counts set deliberately (roles sharing a machine must not oversubscribe its cores),
    and glibc malloc thresholds that keep large buffers mapped between rpcs: the default hands them back to
    the kernel and every rpc page-faults them in again (measured: +43% steps/s on W2, 2.3x push+pull at 8 MiB)."""
    n = str(max(1, threads))
    return {
        "OMP_NUM_THREADS": n,
        "OPENBLAS_NUM_THREADS": n,
        "MKL_NUM_THREADS": n,
        "MALLOC_MMAP_THRESHOLD_": "1073741824",
        "MALLOC_TRIM_THRESHOLD_": "2147483648",
        "PYTHONUNBUFFERED": "1",
    }
