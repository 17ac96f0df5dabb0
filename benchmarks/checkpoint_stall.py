"""How long a checkpoint of the W2 model (1,000,000 x 64 float32 embedding over 2 ps, Adagrad) stalls training.

Training waits only for the snapshot (a consistent pull of every shard and its slots); the write to disk
(npz, sha256 manifest, fsync, rename) runs in the background. This prints both, beside the machine's own
ceilings measured in the same run: memcpy of the same bytes and a plain sequential write + fsync of them.

    python -m benchmarks.checkpoint_stall [--repeats 3] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import (
    bench_cluster,
    emit_all,
    install_signal_handlers,
    log,
    machine,
    median,
    run_directory,
)
from psctl.runtime.checkpoint import take_snapshot, write_checkpoint
from psctl.runtime.config import TrainingConfig
from psctl.runtime.model import ShardedModel
from psctl.runtime.program import ProgramRef, load_program
from psctl.runtime.ps_client import PsClient

TRAINING = {
    "program": "psctl.models.wide_embedding",
    "args": {"vocab_size": 1_000_000, "dim": 64},
    "data": {"name": "synthetic_embedding", "num_examples": 20000, "vocab_size": 1_000_000, "ids_per_example": 10},
    "batch_size": 512,
    "optimizer": {"name": "adagrad", "learning_rate": 0.1},
    "partitioner": {"kind": "fixed", "num_shards": 2},
    "steps": 1,
}


def disk_ceiling(directory: Path, nbytes: int) -> float:
    """Seconds to write ``nbytes`` sequentially and fsync them: what any checkpoint write costs at least."""
    buffer = np.ones(nbytes // 8, dtype=np.float64)
    path = directory / "ceiling.bin"
    started = time.perf_counter()
    with open(path, "wb") as f:
        f.write(buffer.data.cast("B"))
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - started
    path.unlink()
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write checkpoints (default: a temporary folder)")
    parser.add_argument("--run-dir", default=None)
    args = parser.parse_args()
    install_signal_handlers()
    return emit_all("checkpoint_stall", lambda: [run(args)])


def run(args: argparse.Namespace) -> dict[str, Any]:
    config = TrainingConfig.from_dict(TRAINING)
    program = load_program(ProgramRef(config.program, config.args, config.data, config.seed))
    model = ShardedModel(program, 2, config.partitioner)
    with run_directory(args.run_dir) as run_dir, bench_cluster(
        run_dir, TRAINING, num_ps=2, num_workers=0, with_chief=False
    ) as cluster:
        cluster.start_all()
        client = PsClient(cluster.jobs["ps"], timeout=300)
        try:
            client.wait_ready(60.0)
            client.init(model.shard_specs(0), config.optimizer_proto(), cluster.cluster_id)
            target = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="psctl-ckpt-"))
            stalls, writes = [], []
            nbytes = 0
            for i in range(args.repeats):
                started = time.perf_counter()
                snapshot = take_snapshot(model, client)
                stalls.append(time.perf_counter() - started)
                nbytes = sum(v.nbytes for v in snapshot.variables.values()) + sum(
                    s.nbytes for slots in snapshot.slots.values() for s in slots.values()
                )
                snapshot.global_step = i + 1  # a new folder each time
                started = time.perf_counter()
                write_checkpoint(target / "ckpts", snapshot)
                writes.append(time.perf_counter() - started)
                log(f"repeat {i}: snapshot {stalls[-1]:.2f}s, write {writes[-1]:.2f}s")
            big = np.ones(nbytes // 8)
            started = time.perf_counter()
            big.copy()
            memcpy = time.perf_counter() - started
            disk = disk_ceiling(target, nbytes)
        finally:
            client.close()
    return {
        "benchmark": "checkpoint_stall",
        "model": "W2 1,000,000 x 64 float32 over 2 ps, adagrad (variable + accumulator slot)",
        "bytes": nbytes,
        "training_stall_s": round(median(stalls), 3),
        "background_write_s": round(median(writes), 3),
        "ceiling_memcpy_s": round(memcpy, 3),
        "ceiling_sequential_write_fsync_s": round(disk, 3),
        "stall_vs_write": round(median(stalls) / median(writes), 3),
        "repeats": args.repeats,
        "machine": machine(),
    }


if __name__ == "__main__":
    sys.exit(main())
