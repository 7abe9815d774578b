#!/usr/bin/env bash
# Convert an FP4 MoE checkpoint for serving and prove it before `vllm serve`.
# Usage: convert_and_verify.sh SRC DST [TARGET]
# Relies only on mxfp4conv's exit codes (0 ok, 1 bad input, 2 usage, 3 verification failed)
# and its --json report.
set -euo pipefail
src=$1; dst=$2; target=${3:-auto}

# 1. Fail in seconds on a broken or unsupported checkpoint (header-only).
mxfp4conv inspect "$src" --json > inspect.json
echo "layout: $(python3 -c 'import json;print(json.load(open("inspect.json"))["layout"])')"

# 2. Convert (skipped when DST already matches this input and these options), verified before publish.
mxfp4conv convert "$src" "$dst" --to "$target" --skip-if-current --json > convert.json
python3 - <<'PY'
import json
r = json.load(open("convert.json"))
print(f"status={r['status']} shards={len(r['shards'])} bytes={r['bytes_written']}")
for name, s in sorted(r["requant_stats"].items()):
    print(f"  {name}: SQNR {s['sqnr_db']:.2f} dB")
PY

# 3. Independent re-check (exit 3 if anything differs).
mxfp4conv verify "$src" "$dst" --json > verify.json
echo "verified; ready for: vllm serve $dst"
