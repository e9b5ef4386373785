#!/usr/bin/env bash
# Runs an example as a user would, in a fresh storage folder (@STORAGE@ in its arguments):
# passes when it exits 0 and its output matches the regular expression.
# Usage: run_example.sh REGEX PROGRAM ARGS...
set -uo pipefail
regex="$1"
shift
storage="$(mktemp -d)"
trap 'rm -rf "$storage"' EXIT
args=()
for a in "$@"; do args+=("${a//@STORAGE@/$storage}"); done
output="$("${args[@]}" 2>&1)"
status=$?
printf '%s\n' "$output"
if [ $status -ne 0 ]; then echo "run_example: exit code $status" >&2; exit 1; fi
if ! grep -Eq -- "$regex" <<<"$output"; then echo "run_example: output does not match /$regex/" >&2; exit 1; fi
