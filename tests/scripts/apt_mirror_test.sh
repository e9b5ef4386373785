#!/usr/bin/env bash
# scripts/apt_mirror.sh finds the host's own Debian archive in either source format, whatever its
# path and trailing slash, skipping security, updates and other vendors' entries and disabled
# stanzas; with none it names deb.debian.org.
set -uo pipefail
mirror="$(dirname "$0")/../../scripts/apt_mirror.sh"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
failed=0
# expect WHAT WANT: the mirror found in $work/etc for codename bookworm.
expect() {
  local got
  got="$("$mirror" --etc "$work/etc" --codename bookworm)" || { echo "FAIL: $1: exit $?"; failed=1; return; }
  if [ "$got" = "$2" ]; then echo "ok: $1: $got"; else echo "FAIL: $1: got '$got', want '$2'"; failed=1; fi
}
fresh() { rm -rf "$work/etc"; mkdir -p "$work/etc/sources.list.d"; }

fresh
expect "no sources" http://deb.debian.org/debian

fresh
cat >"$work/etc/sources.list" <<'EOF'
# a comment
deb http://security.debian.org/debian-security bookworm-security main
deb-src http://src.example/debian bookworm main
deb [arch=amd64 signed-by=/usr/share/keyrings/k.gpg] http://mirror.example:3142/pub/linux/debian/ bookworm main contrib
EOF
expect "sources.list, options, another path, trailing slash" http://mirror.example:3142/pub/linux/debian

fresh
cat >"$work/etc/sources.list.d/vendor.list" <<'EOF'
deb [ arch=amd64 ] https://packages.vendor.example/apt cloud-sdk-bookworm main
deb https://deb.vendor.example/node_20.x nodistro main
EOF
cat >"$work/etc/sources.list.d/debian.list" <<'EOF'
deb http://local-proxy/debian-archive stable main
EOF
expect "a .list file, vendors skipped, suite stable" http://local-proxy/debian-archive

fresh
cat >"$work/etc/sources.list.d/debian.sources" <<'EOF'
Types: deb
# http://snapshot.debian.org/archive/debian/20250520T000000Z
URIs: http://archive.example/debian/
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://archive.example/debian-security
Suites: bookworm-security
Components: main
EOF
expect "deb822 with a trailing slash" http://archive.example/debian

fresh
cat >"$work/etc/sources.list.d/a-off.sources" <<'EOF'
Types: deb
URIs: http://disabled.example/debian
Suites: bookworm
Components: main
Enabled: no
EOF
cat >"$work/etc/sources.list.d/b-on.sources" <<'EOF'
types: deb deb-src
uris: https://mirror.example/mirrors/deb
suites: bookworm
components: main
EOF
expect "deb822, a disabled stanza, lower-case keys, any path" https://mirror.example/mirrors/deb

fresh
cat >"$work/etc/sources.list.d/src.sources" <<'EOF'
Types: deb-src
URIs: http://src-only.example/debian
Suites: bookworm
Components: main
EOF
expect "only deb-src entries" http://deb.debian.org/debian

if "$mirror" --etc "$work/etc" --bogus 2>/dev/null; then echo "FAIL: an unknown option was accepted"; failed=1; fi
exit "$failed"
