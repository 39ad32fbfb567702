#!/usr/bin/env bash
# Session 10, call 5 (issue 15): the planar gpu tests at main (test_moe.py's planar tests and the stream-K tests),
# then call 1's bench beside the peer (same routing) at every T of both shapes, with gpt-oss-120b's T = 1 row now
# the fused combine with a stream-K GEMM2.
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
R=$OUT/s10c5; mkdir -p $R
timeout "${TESTS_S:-200}" python3 -m pytest -q -m gpu -p no:cacheprovider -k "planar or stream_k" \
  tests/kernels/test_moe.py tests/kernels/test_moe_stream_k.py > $R/pytest_gpu_planar.log 2>&1
echo "rc=$?" >> $R/pytest_gpu_planar.log; tail -4 $R/pytest_gpu_planar.log
OUT=$R TESTS_S=0 BENCH_S=${BENCH_S:-130} bash benchmarks/next/s10_call1.sh
rm -f $R/s10c1.tgz
tar czf $OUT/s10c5.tgz -C $OUT s10c5
