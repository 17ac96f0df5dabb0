"""Process environment every role gets, whoever starts it (the supervisor, the benchmarks)."""

from __future__ import annotations


def default_threads(cpus: int, roles_here: int) -> int:
    """numpy/BLAS threads of a role whose spec names none: the host's CPUs shared out among the roles it runs,
    at least one. Where roles outnumber the CPUs, more than one thread each only oversubscribes them; where
    CPUs are plenty (16 for a 1 ps / 2 worker cluster), a role's matrix products get its share of them."""
    return max(1, cpus // max(1, roles_here))


def tuning_env(threads: int) -> dict[str, str]:
    """numpy/BLAS thread counts set deliberately (roles sharing a machine must not oversubscribe its cores),
    and glibc malloc settings: thresholds that keep large buffers mapped between rpcs (the default hands them
    back to the kernel and every rpc page-faults them in again; measured: +43% steps/s on W2, 2.3x push+pull at
    8 MiB), and one arena instead of up to 8 per core, so that the buffers gRPC's and the role's threads keep
    are not kept once per thread (measured, 2 cores: peak RSS of W3's workers 265 -> 188 MiB with two arenas, 159
    with one; W2's 101 -> 81 -> 74-77; W1's 126-139 -> 120 -> 117, where two arenas let a pipelined worker's two
    steps keep 133; at the same steps/s). A role's own ``env`` in the spec overrides any of them."""
    n = str(max(1, threads))
    return {
        "OMP_NUM_THREADS": n,
        "OPENBLAS_NUM_THREADS": n,
        "MKL_NUM_THREADS": n,
        "MALLOC_MMAP_THRESHOLD_": "1073741824",
        "MALLOC_TRIM_THRESHOLD_": "2147483648",
        "MALLOC_ARENA_MAX": "1",
        "PYTHONUNBUFFERED": "1",
    }
