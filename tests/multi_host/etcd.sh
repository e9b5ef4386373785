# Sourced by the tests that run a real etcd (Debian's etcd-server, which scripts/setup.sh unpacks
# into .tools/). Needs $work (its data goes to $work/etcd, its log to $work/etcd.log), $pids (its
# pid is added, for the test's cleanup to kill) and fail.

# start_etcd BINARY HOST:PORT PEER_PORT [NS]: starts etcd serving its clients on HOST:PORT (its
# peer port on 127.0.0.1), in network namespace NS when given, and waits until its /health says
# so; fails the test after 60 s.
start_etcd() {
  local binary="$1" client="http://$2" peer="http://127.0.0.1:$3" run=()
  [ -n "${4:-}" ] && run=(ip netns exec "$4")
  "${run[@]}" "$binary" --name etcd --data-dir "$work/etcd" --listen-client-urls "$client" \
    --advertise-client-urls "$client" --listen-peer-urls "$peer" \
    --initial-advertise-peer-urls "$peer" --initial-cluster "etcd=$peer" >"$work/etcd.log" 2>&1 &
  pids+=("$!")
  for _ in $(seq 600); do
    "${run[@]}" python3 -c "import sys, urllib.request
sys.exit(b'\"health\":\"true\"' not in urllib.request.urlopen(sys.argv[1] + '/health', timeout=2).read())" \
      "$client" 2>/dev/null && return 0
    sleep 0.1
  done
  cat "$work/etcd.log"
  fail "etcd did not serve at $client within 60 s"
}
