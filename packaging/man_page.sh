#!/usr/bin/env bash
# cohort.1.gz from the CLI's own help (help2man), each subcommand's --help a section of its own.
# Usage: man_page.sh COHORT_BINARY OUTPUT.1.gz
set -euo pipefail
binary="$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"
output="$2"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# Run as `cohort`, so that the usage lines name the command, not the build folder.
ln -s "$binary" "$work/cohort"
export PATH="$work:$PATH"
{
  cat <<'TEXT'
[DESCRIPTION]
cohort runs a libtorch training loop on many worker processes, GPUs and machines: data, ZeRO,
pipeline and tensor parallelism, local SGD and parameter servers, fault tolerance and elastic
groups, hyperparameter search, TensorBoard and a live dashboard. The library (find_package(cohort)
in CMake, headers under /usr/include/cohort) is the product; this command is a user of it.
TEXT
  for sub in $(cohort --help | awk '/^Subcommands:/ { on = 1; next } on && /^$/ { exit } on { print $1 }'); do
    echo "[COMMAND: ${sub^^}]"
    echo ".nf"
    # Roff: a backslash is \e; a line starting with . or ' would be a request.
    cohort "$sub" --help | sed -e 's/\\/\\e/g' -e "s/^\([.']\)/\\\\\&\1/"
    echo ".fi"
  done
  cat <<'TEXT'
[EXIT STATUS]
0 on success; 2 for bad input (an option, a file or a configuration), named in one line with the
fix; 1 for a failure while running; 130 when Ctrl-C stopped a run after its checkpoint.
[SEE ALSO]
The guides under /usr/share/doc/cohort/guides (start with getting-started.md), and the
project's README.
TEXT
} >"$work/sections.h2m"
help2man --no-info --no-discard-stderr --section 1 \
  --name "distributed training for libtorch in C++" --include "$work/sections.h2m" \
  --output "$work/cohort.1" cohort
gzip -9n <"$work/cohort.1" >"$output.tmp"
mv "$output.tmp" "$output"
