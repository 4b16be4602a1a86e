#!/usr/bin/env bash
# Segmented prefill check: a prefill stage saves the prompts' KV blocks, then two decode
# stages continue the prompts, one loading every block and one computing gaps inside the
# loaded range instead (SegmentedPrefillExampleConnector). Their outputs must be identical.
#
# Environment: PYTHON (default python3), LOOM_MODEL (default gemma3-270m),
# LOOM_EXAMPLE_WORDS, LOOM_BLOCK_SIZE, and LOOM_EXAMPLE_DIR: the folder to work in (its
# outputs and local_storage/; default this script's folder).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PY="${PYTHON:-python3}"
cd "${LOOM_EXAMPLE_DIR:-$HERE}"

DECODE_OUTPUT="decode_output.txt"
SEGMENTED_OUTPUT="segmented_prefill_decode_output.txt"
rm -rf local_storage
rm -f prefill_output.txt "$DECODE_OUTPUT" "$SEGMENTED_OUTPUT"

echo "=== prefill: compute the prompts, save their KV blocks"
"$PY" "$HERE/prefill_example.py"
echo "=== decode: load every block"
"$PY" "$HERE/decode_example.py"
echo "=== decode: compute gaps inside the loaded range (segmented prefill)"
status=0
"$PY" "$HERE/decode_example.py" --segmented-prefill || status=$?

if [ ! -f "$SEGMENTED_OUTPUT" ]; then
    echo "The segmented prefill decode failed before writing $SEGMENTED_OUTPUT (exit $status)."
    exit 1
fi
if ! diff -u "$DECODE_OUTPUT" "$SEGMENTED_OUTPUT"; then
    echo "Outputs differ: segmented prefill changed the generated text."
    exit 1
fi
if [ "$status" -ne 0 ]; then
    echo "The segmented prefill decode failed its own check (exit $status)."
    exit 1
fi
echo "Outputs match: segmented prefill gave the same text as loading every block."
