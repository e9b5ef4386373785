#!/usr/bin/env bash
# The live dashboard in a real browser (Debian's headless Chromium): a 2-worker run started with
# --dashboard; the page shows both ranks in the worker table and curves with points; /metrics has
# each rank's step time; a screenshot is saved; the time to the first render is printed. Then a
# port in use is refused, `cohort dashboard` shows the finished run and a Tune experiment's trials.
# Usage: dashboard_test.sh COHORT_CLI ARTIFACT_DIR
set -euo pipefail
cli="$1"
artifacts="$2"
mkdir -p "$artifacts"
browser="$(command -v chromium || true)"
promtool="${PROMTOOL:-$(command -v promtool || true)}"
if [ ! -x "$promtool" ]; then
  echo "dashboard_test: SKIPPED: no promtool at '$promtool' (scripts/setup.sh unpacks it into .tools/)"
  exit 77
fi
if [ -z "$browser" ]; then
  echo "dashboard_test: SKIPPED: no chromium (scripts/setup.sh installs it)"
  exit 77
fi
tmp="$(mktemp -d)"
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$tmp"
}
trap cleanup EXIT
fail() { echo "dashboard_test: $*" >&2; exit 1; }

# Waits (up to $2 seconds) until the command $1 succeeds.
wait_until() {
  local deadline=$((SECONDS + $2))
  until eval "$1"; do
    [ $SECONDS -lt $deadline ] || fail "timed out waiting for: $1"
    sleep 0.2
  done
}
browse() {  # browse URL: the page's DOM after its scripts ran
  timeout 90 "$browser" --headless --no-sandbox --disable-gpu --user-data-dir="$tmp/chrome" \
    --virtual-time-budget=4000 --dump-dom "$1" 2>/dev/null
}
fetch() { /usr/bin/python3 -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())' "$1"; }

storage="$tmp/runs"
"$cli" train --workers 2 --epochs 1000 --train-examples 512 --test-examples 128 --batch-size 32 \
  --storage-path "$storage" --name live --log-every-steps 2 --dashboard 0 >"$tmp/train.log" 2>&1 &
pids+=($!)
train_pid=$!
wait_until "grep -q 'dashboard at http' '$tmp/train.log'" 60
url="$(grep -o 'http://[0-9.]*:[0-9]*/' "$tmp/train.log" | head -1)"
port="${url##*:}"; port="${port%/}"
# A report with both ranks' step times.
wait_until "grep -q '\"step_time_ms\":[0-9]' '$storage/live/status.json' 2>/dev/null && [ -s '$storage/live/metrics.jsonl' ]" 120

dom="$(browse "$url?run=live")"
for rank in 0 1; do
  grep -q "data-rank=\"$rank\"" <<<"$dom" || fail "the worker table has no rank $rank: $dom"
done
points="$(grep -o 'id="loss-chart"[^>]*data-points="[0-9]*"' <<<"$dom" | grep -o '[0-9]*"$' | tr -d '"')"
[ "${points:-0}" -ge 1 ] || fail "the loss curve has no points: $dom"
step_points="$(grep -o 'id="step-loss-chart"[^>]*data-points="[0-9]*"' <<<"$dom" | grep -o '[0-9]*"$' | tr -d '"')"
[ "${step_points:-0}" -ge 2 ] || fail "the loss-by-step curve has fewer than 2 points: $dom"
first_render="$(grep -o 'data-first-render-ms="[0-9.]*"' <<<"$dom" | grep -o '[0-9.]*')"
[ -n "$first_render" ] || fail "the page never rendered: $dom"
echo "dashboard: first render in Chromium after ${first_render} ms; loss curve with $points point(s), by step with $step_points"
timeout 90 "$browser" --headless --no-sandbox --disable-gpu --user-data-dir="$tmp/chrome" \
  --virtual-time-budget=4000 --window-size=1280,1100 --screenshot="$artifacts/dashboard.png" \
  "$url?run=live" >/dev/null 2>&1
[ -s "$artifacts/dashboard.png" ] || fail "no screenshot"
echo "dashboard: screenshot $artifacts/dashboard.png"

metrics="$(fetch "${url}metrics")"
for rank in 0 1; do
  grep -q "^cohort_rank_step_time_seconds{run=\"live\",rank=\"$rank\"} [0-9]" <<<"$metrics" ||
    fail "/metrics has no step time of rank $rank: $metrics"
done
grep -q '^cohort_running{run="live"} 1.0$' <<<"$metrics" || fail "/metrics: the run is not running"
grep -q '^# TYPE cohort_loss gauge$' <<<"$metrics" || fail "/metrics: no loss gauge: $metrics"
# Prometheus' own linter: base units (seconds, bytes), help and type lines.
lint="$("$promtool" check metrics <<<"$metrics" 2>&1)" || fail "promtool check metrics: $lint"
echo "dashboard: /metrics passes promtool check metrics ($(grep -c '^# TYPE' <<<"$metrics") metrics)"

# The port is taken: a second dashboard is refused, naming it and the fix.
if timeout 30 "$cli" dashboard "$storage" --port "$port" >"$tmp/second.log" 2>&1; then
  fail "a second dashboard on port $port started"
fi
grep -q "cannot listen on 127.0.0.1:$port: the port is in use" "$tmp/second.log" ||
  fail "unexpected refusal: $(cat "$tmp/second.log")"

# Ctrl-C: the run stops after a checkpoint; the dashboard of the finished run says so.
kill -INT "$train_pid"
wait_until "! kill -0 $train_pid 2>/dev/null" 120
"$cli" tune --workers 1 --param lr=loguniform:0.001:0.1 --samples 2 --epochs 1 \
  --train-examples 256 --test-examples 128 --storage-path "$storage" --name experiment --quiet >/dev/null
"$cli" dashboard "$storage" --port 0 >"$tmp/dashboard.log" 2>&1 &
pids+=($!)
wait_until "grep -q 'dashboard of' '$tmp/dashboard.log'" 30
url="$(grep -o 'http://[0-9.]*:[0-9]*/' "$tmp/dashboard.log" | head -1)"
dom="$(browse "$url?run=live")"
grep -q 'class="state-interrupted">(interrupted)' <<<"$dom" || fail "the stopped run is not shown as interrupted: $dom"
dom="$(browse "$url?run=experiment")"
for trial in trial_00000 trial_00001; do
  grep -q "data-trial=\"$trial\"" <<<"$dom" || fail "the trials table has no $trial: $dom"
done
echo "dashboard: the finished run and the experiment's 2 trials shown by cohort dashboard"
