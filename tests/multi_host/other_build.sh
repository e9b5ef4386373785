#!/usr/bin/env bash
# Writes a copy of a program that differs from it as another build does: the same code with
# another GNU build id (what cohort compares between the processes of a job).
# Usage: other_build.sh PROGRAM COPY
set -euo pipefail
build_id=$(readelf -n "$1" | awk '/Build ID/ {print $3}')
[ -n "$build_id" ] || { echo "other_build.sh: $1 has no GNU build id" >&2; exit 1; }
python3 - "$1" "$2" "$build_id" <<'EOF'
import sys
source, target, build_id = sys.argv[1:]
data = bytearray(open(source, "rb").read())
at = data.find(bytes.fromhex(build_id))
assert at >= 0, "build id not found"
data[at] ^= 0xFF
open(target, "wb").write(data)
EOF
chmod +x "$2"
