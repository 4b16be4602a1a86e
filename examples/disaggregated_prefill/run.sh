#!/usr/bin/env bash
# Disaggregated prefill: a producer process computes the prompts and saves their KV blocks to
# a shared folder; a consumer process loads them and only decodes. Its text must equal a
# single process doing both (the baseline).
#
# Environment: PYTHON (default python3), LOOM_MODEL (default gemma3-270m),
# LOOM_EXAMPLE_WORDS, LOOM_BLOCK_SIZE, and LOOM_EXAMPLE_DIR: the folder to work in (outputs
# and kv_store/; default this script's folder).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PY="${PYTHON:-python3}"
cd "${LOOM_EXAMPLE_DIR:-$HERE}"

rm -rf kv_store
rm -f consumer_output.txt baseline_output.txt

echo "=== producer: prefill, save KV to kv_store/"
"$PY" "$HERE/producer.py"
echo "=== consumer: load KV from kv_store/, decode"
"$PY" "$HERE/consumer.py"
echo "=== baseline: one process, no connector"
"$PY" "$HERE/baseline.py"

if ! diff -u baseline_output.txt consumer_output.txt; then
    echo "Outputs differ: the consumer's text is not the baseline's."
    exit 1
fi
echo "Outputs match: the consumer decoded from the producer's KV exactly as the baseline."
