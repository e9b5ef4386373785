# Sourced by the multi-host tests: two hosts A and B made with network namespaces joined by a veth
# pair, $net.1 on A and $net.2 on B (nothing else reachable), removed with every process in them
# on exit. Before sourcing, set `name` (the test's name, for messages) and `subnet` (the second
# octet of 10.X.R.0/24; R comes from the pid, so that parallel tests differ). Gives: $a and $b
# (the namespaces), $net, $work (a temporary folder), fail, wait_for, and $pids (killed on exit).
# Both hosts' processes share one job secret (COHORT_JOB_SECRET, exported), as the nodes of a
# multi-node job must.
# A machine that does not allow network namespaces or veth pairs (not root, no CAP_SYS_ADMIN in a
# container, no veth driver) skips the test (exit 77) with the reason; as root here it runs.
fail() { echo "$name: FAIL: $*" >&2; exit 1; }
skip() { echo "$name: SKIPPED: $*" >&2; exit 77; }
[ "$(id -u)" = 0 ] || skip "needs root to make hosts with ip netns (run the tests as root)"
command -v ip >/dev/null || fail "ip is missing: scripts/setup.sh installs iproute2"

tag="${name:0:1}$$"
COHORT_JOB_SECRET="$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')"
export COHORT_JOB_SECRET
a="${tag}a"
b="${tag}b"
net="10.$subnet.$(( $$ % 200 + 1 ))"
work="$(mktemp -d)"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; done
  for ns in "$a" "$b"; do
    for p in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$p" 2>/dev/null; done
    ip netns del "$ns" 2>/dev/null
  done
  rm -rf "$work"
}
trap cleanup EXIT

error="$(ip netns add "$a" 2>&1 && ip netns add "$b" 2>&1)" \
  || skip "this machine does not allow network namespaces (ip netns add: $error)"
error="$(ip link add "${tag}va" type veth peer name "${tag}vb" 2>&1)" \
  || skip "this machine does not allow veth pairs (ip link add type veth: $error)"
ip link set "${tag}va" netns "$a"
ip link set "${tag}vb" netns "$b"
ip -n "$a" addr add "$net.1/24" dev "${tag}va"
ip -n "$b" addr add "$net.2/24" dev "${tag}vb"
for ns in "$a" "$b"; do ip -n "$ns" link set lo up; done
ip -n "$a" link set "${tag}va" up
ip -n "$b" link set "${tag}vb" up

# wait_for PID SECONDS: its exit status in $status; fails the test at the deadline.
wait_for() {
  local pid="$1" deadline=$(( $(date +%s) + $2 ))
  while kill -0 "$pid" 2>/dev/null; do
    [ "$(date +%s)" -lt "$deadline" ] || fail "process $pid still running after $2 s"
    sleep 0.1
  done
  wait "$pid"
  status=$?
}

# wait_for_launchers NAME SECONDS: waits for host A's launcher ($pa, up to SECONDS) and then host
# B's ($pb, up to 60 s more), their exit statuses in $ca and $cb, and prints their logs of run
# NAME ($work/NAME-0.log and -1.log).
wait_for_launchers() {
  wait_for "$pa" "$2"; ca=$status
  wait_for "$pb" 60; cb=$status
  cat "$work/$1-0.log" "$work/$1-1.log"
}
