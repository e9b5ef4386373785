#!/usr/bin/env bash
# Prints the Debian archive this host's apt installs its own suite from, for debootstrap to make a
# root of another suite from the same place (a machine may reach only its own mirror or proxy).
# Reads both source formats: one-line entries (sources.list, sources.list.d/*.list) and deb822
# stanzas (sources.list.d/*.sources), with any URI path and with or without a trailing slash. An
# entry counts when one of its suites is the host's codename or a Debian suite name (stable,
# testing, unstable, sid): security, updates, backports and other vendors' archives do not.
# Prints http://deb.debian.org/debian when no entry counts.
#
#   scripts/apt_mirror.sh [--etc DIR (default /etc/apt)] [--codename NAME (default: os-release's)]
set -euo pipefail
etc=/etc/apt
codename=""
while [ $# -gt 0 ]; do
  case "$1" in
    --etc) etc="$2"; shift 2 ;;
    --codename) codename="$2"; shift 2 ;;
    *) echo "apt_mirror.sh: unknown option '$1' (--etc DIR, --codename NAME)" >&2; exit 2 ;;
  esac
done
if [ -z "$codename" ] && [ -r /etc/os-release ]; then
  codename="$(sed -n 's/^VERSION_CODENAME=//p' /etc/os-release | tr -d '"')"
fi
suites="^(${codename:+$codename|}stable|testing|unstable|sid)$"

one_line=()
deb822=()
[ -f "$etc/sources.list" ] && one_line+=("$etc/sources.list")
for f in "$etc"/sources.list.d/*.list; do [ -f "$f" ] && one_line+=("$f"); done
for f in "$etc"/sources.list.d/*.sources; do [ -f "$f" ] && deb822+=("$f"); done

candidates="$({
  if [ ${#one_line[@]} -gt 0 ]; then
    # deb [options] URI SUITE COMPONENTS...; the options may hold spaces.
    awk -v suites="$suites" '$1 == "deb" {
        i = 2
        if ($i ~ /^\[/) { while (i <= NF && $i !~ /\]$/) i++; i++ }
        if ($(i + 1) ~ suites) print $i
      }' "${one_line[@]}"
  fi
  if [ ${#deb822[@]} -gt 0 ]; then
    # One stanza a paragraph; field names are case-insensitive; comment lines are skipped.
    awk -v suites="$suites" 'BEGIN { RS = ""; FS = "\n" }
      {
        types = ""; uri = ""; enabled = "yes"; match_suite = 0
        for (l = 1; l <= NF; l++) {
          line = $l
          if (line ~ /^[ \t]*#/) continue
          key = tolower(line); sub(/:.*/, "", key)
          value = line; sub(/^[^:]*:[ \t]*/, "", value)
          n = split(value, words, /[ \t]+/)
          if (key == "types") types = " " value " "
          else if (key == "enabled") enabled = tolower(words[1])
          else if (key == "uris") uri = words[1]
          else if (key == "suites") for (w = 1; w <= n; w++) if (words[w] ~ suites) match_suite = 1
        }
        if (types ~ / deb / && enabled != "no" && uri != "" && match_suite) print uri
      }' "${deb822[@]}"
  fi
  echo http://deb.debian.org/debian
} | grep -E '^(https?|file)://')"
first="${candidates%%$'\n'*}"
echo "${first%"${first##*[!/]}"}"
