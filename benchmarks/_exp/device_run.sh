#!/usr/bin/env bash
# scratch: one device session (removed afterwards)
export PYTHONDONTWRITEBYTECODE=1
pip install -q --no-deps --target /tmp/site benchmarks/.devwheels/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site
rm -rf benchmarks/.devwheels
T="MALLOC_MMAP_THRESHOLD_=1073741824 MALLOC_TRIM_THRESHOLD_=2147483648"
uptime
benchmarks/run_all.sh > $OUT/plain.jsonl 2> $OUT/stderr.txt; echo rc=$?
for cmd in "-m benchmarks.pushpull" "-m benchmarks.overhead" "-m benchmarks.workloads w1" "-m benchmarks.workloads w2" "-m benchmarks.workloads w3"; do
  env MALLOC_MMAP_THRESHOLD_=1073741824 MALLOC_TRIM_THRESHOLD_=2147483648 python $cmd >> $OUT/malloc.jsonl 2>>$OUT/stderr.txt
done
python -m benchmarks.overhead --ps 2 >> $OUT/extra.jsonl 2>>$OUT/stderr.txt
python -m benchmarks.workloads w1 --workers 4 >> $OUT/extra.jsonl 2>>$OUT/stderr.txt
python -m benchmarks.workloads w3 --threads 4 >> $OUT/extra.jsonl 2>>$OUT/stderr.txt
python -m benchmarks.workloads w2 --ps 4 --workers 4 >> $OUT/extra.jsonl 2>>$OUT/stderr.txt
python -m benchmarks.pushpull >> $OUT/extra.jsonl 2>>$OUT/stderr.txt
uptime
wc -l $OUT/*.jsonl
grep -c '"ok": false' $OUT/*.jsonl
