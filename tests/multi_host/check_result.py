#!/usr/bin/env python3
"""Checks a result.json of `cohort train` run by a launcher: no error, the expected world size and
steps, and every replica in sync. Usage: check_result.py RESULT_JSON WORKERS STEPS LABEL"""
import json
import sys

path, workers, steps, label = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
r = json.load(open(path))
assert r["error"] is None, r["error"]
assert r["workers"] == workers and r["world_size"] == workers, (r["workers"], r["world_size"])
assert r["replica_spread"] == 0.0, r["replica_spread"]
assert r["steps"] == steps, r["steps"]
print(f"{label}: {workers} ranks in sync, steps {r['steps']} accuracy {r['test_accuracy']}")
