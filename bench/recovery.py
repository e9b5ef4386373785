#!/usr/bin/env python3
"""Seconds lost to a failure: `kill -9` of one of 4 workers of `cohort train` at about step
--kill-at, for each way of coming back, in the same run:

  epoch     the driver restarts the group from the last checkpoint on disk, taken at epoch ends
            (today's default)
  steps     the same with --checkpoint-every-steps N
  async     the same with the checkpoints written behind the loop (--async-checkpoint)
  snapshot  checkpoints at epoch ends only, and an in-memory snapshot every --snapshot-every steps
            (--snapshot-every-steps, kept in /dev/shm with a buddy copy): the restarted group
            restores from the snapshot
  torchrun  PyTorch's torchrun --max_restarts 2 restarts its 4 `cohort train` ranks, which resume
            from their checkpoints (--checkpoint-every-steps N)
  torchrun-snapshot
            the same ranks with snapshots instead (--snapshot-every-steps): restored from the
            snapshots on /dev/shm under an external launcher
  live      live recovery (--recovery live): the 3 survivors abort the step in flight and go on
            in their processes with a replacement that takes a survivor's state (checkpoints at
            epoch ends only); the next completed step is the one the driver says trained again
  live-shrink
            the same without a replacement (--no-replace-lost --min-workers 3)
  live-diloco
            live recovery of DiLoCo (--sync diloco:--diloco-every): the survivors keep their
            replicas, the replacement takes the source's; the lost worker's steps since the last
            synchronisation are dropped (not counted as lost: their rows count as trained on)
  live-zero live recovery of ZeRO stage 2 in sharding groups of 2 (--zero-stage 2
            --shard-group-size 2): the survivors keep their shards, the replacement takes its
            shard from the survivor that held the same one
  live-zero3
            the same at ZeRO stage 3 (--zero-stage 3 --shard-group-size 2): the replacement takes
            its shard of the parameters too from that survivor
  launch-live
            live recovery under `cohort launch --nproc-per-node 4` instead of the local driver:
            the job host keeps the run and the decisions, the launcher starts the replacement
  launch-live-rank0
            the same with rank 0 killed instead of rank 1 (a rank as any under the job host)

A live mode whose survivors cannot go on (they say why) falls back to a restart: its row says so.
Printed per mode: the step at the kill, the step the group resumed after, the steps lost (done
again), the seconds from the kill to the next completed step and to the first step past the killed
one (rank 0's steps.jsonl, polled every 10 ms), then one JSON line per mode.

  bench/recovery.py [--cohort build/cohort] [--kill-at 200] [--every 20] [--snapshot-every 10]
                    [--diloco-every 8] [--model mlp] [--train-args "--epochs 2 --batch-size 64"]
                    [--modes ...]

"""
import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time


def steps_logged(path):
    """The "step" of every record of steps.jsonl so far."""
    try:
        with open(path) as f:
            out = []
            for line in f:
                try:
                    out.append(json.loads(line)["step"])
                except (ValueError, KeyError):
                    pass
            return out
    except FileNotFoundError:
        return []


def wait_until(condition, deadline_s, what):
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        value = condition()
        if value:
            return value
        time.sleep(0.01)
    raise TimeoutError(f"gave up after {deadline_s} s waiting for {what}")


def worker_pids(process):
    """The training processes: the driver's workers, or torchrun's or cohort launch's ranks (and
    its job host)."""
    out = subprocess.run(["pgrep", "-P", str(process.pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def rank_pid(process, rank):
    """The process of `rank` among `process`'s children (RANK in its environment), or None."""
    for pid in worker_pids(process):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"RANK={rank}".encode() in f.read().split(b"\0"):
                    return pid
        except OSError:
            pass
    return None


def run_mode(args, mode, storage):
    name = mode
    live = "live" in mode
    train = [args.cohort, "train", "--workers", "4", "--model", args.model, "--optimizer", "adam",
             "--storage-path", storage, "--name", name, "--log-every-steps", "1"]
    # Live recovery: the driver's lines say when the group trains again.
    train += (["--recovery", "live"] if live else ["--quiet"]) + args.train_args.split()
    if mode == "live-shrink":
        train += ["--no-replace-lost", "--min-workers", "3"]
    if mode == "live-diloco":
        train += ["--sync", f"diloco:{args.diloco_every}"]
    if mode in ("live-zero", "live-zero3"):
        train += ["--zero-stage", "2" if mode == "live-zero" else "3", "--shard-group-size", "2"]
    if mode in ("snapshot", "torchrun-snapshot"):
        train += ["--snapshot-every-steps", str(args.snapshot_every), "--snapshot-dir",
                  args.snapshot_dir]
    elif mode != "epoch" and not live:
        train += ["--checkpoint-every-steps", str(args.every)]
    if mode == "async":
        train += ["--async-checkpoint"]
    if mode.startswith("launch-live"):
        # One node of cohort launch; its job host keeps the run directory.
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        command = [args.cohort, "launch", "--nnodes", "1", "--node-rank", "0", "--master",
                   f"127.0.0.1:{port}", "--nproc-per-node", "4", "--"] + train
    elif mode.startswith("torchrun"):
        # Each rank a `cohort train` of its own, restarted by torchrun (its run directory the same).
        # --redirects/--tee 1: Debian's torchrun (1.13 on Python 3.11) fails on its default 0.
        command = ["torchrun", "--standalone", "--nproc_per_node", "4", "--max_restarts", "2",
                   "--no_python", "--redirects", "1", "--tee", "1", args.cohort] + train[1:]
    else:
        command = train + ["--max-failures", "1"]
    log = open(os.path.join(storage, name + ".log"), "w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    steps_file = os.path.join(storage, name, "steps.jsonl")
    fell_back = False
    try:
        def reached_kill_step():
            if process.poll() is not None:
                with open(os.path.join(storage, name + ".log")) as f:
                    last = "\n".join(f.read().strip().splitlines()[-15:])
                raise RuntimeError(f"{mode}: the run ended (exit {process.returncode}) before step "
                                   f"{args.kill_at}; the end of its output:\n{last}")
            return [s for s in steps_logged(steps_file) if s >= args.kill_at]
        at_kill = wait_until(reached_kill_step, 600, f"step {args.kill_at}")[0]
        target = 0 if mode == "launch-live-rank0" else 1
        victim = wait_until(lambda: rank_pid(process, target), 30, f"rank {target}'s pid")
        seen = len(steps_logged(steps_file))
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        step_at_kill = steps_logged(steps_file)[-1]
        # The next completed step: a record below the step at the kill (the group came back from a
        # checkpoint), or one past it that was logged after the kill.
        def next_step():
            records = steps_logged(steps_file)[seen:]
            for s in records:
                if s <= step_at_kill or len(records) > 4:
                    return s
            return None
        if live:
            log_file = os.path.join(storage, name + ".log")
            def trained_again():
                with open(log_file) as f:
                    text = f.read()
                # The survivors could not go on (e.g. the lost shard's replica was a step
                # behind): the group restarts as without live recovery.
                if "live recovery cannot go on" in text:
                    return "restarted"
                marker = "live recovery: training again"
                if marker not in text:
                    return None
                after = text.split("go on after step ")[1].split()[0]
                return int(after) + 1
            resumed_step = wait_until(trained_again, 600, "the driver's 'training again'")
            if resumed_step == "restarted":
                fell_back = True
                resumed_step = wait_until(next_step, 600, "a step after the kill")
        else:
            resumed_step = wait_until(next_step, 600, "a step after the kill")
        seconds = time.monotonic() - killed_at
        # Back where the kill struck: the lost steps done again.
        wait_until(lambda: any(s > step_at_kill for s in steps_logged(steps_file)[seen:]
                               if s >= resumed_step), 600, "the step after the killed one")
        back_seconds = time.monotonic() - killed_at
        process.wait(timeout=900)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        log.close()
    return {"mode": mode, "step_at_kill": step_at_kill, "resumed_after": resumed_step - 1,
            # A step the survivors finished after rank 0 logged the one at the kill is not lost.
            "steps_lost": max(0, step_at_kill - (resumed_step - 1)), "kill_to_next_step_s": seconds,
            "kill_to_step_after_killed_s": back_seconds,
            "exit_code": process.returncode, "fell_back_to_restart": fell_back}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cohort", default=os.path.join(os.path.dirname(__file__), "..", "build",
                                                         "cohort"))
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--kill-at", type=int, default=200)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--snapshot-every", type=int, default=10)
    parser.add_argument("--diloco-every", type=int, default=8)
    parser.add_argument("--train-args", default="--epochs 2 --batch-size 64",
                        help="more options of cohort train, e.g. a GPT's: --layers 14 --width 768 "
                             "--heads 12 --data text:FILE --context 64 --batch-size 2 --epochs 1")
    parser.add_argument("--modes", default="epoch,steps,async,snapshot,live,live-shrink,"
                        "live-diloco,live-zero,live-zero3,launch-live,launch-live-rank0,torchrun,"
                        "torchrun-snapshot")
    args = parser.parse_args()
    args.cohort = os.path.abspath(args.cohort)
    modes = args.modes.split(",")
    if shutil.which("torchrun") is None:
        for mode in [m for m in modes if m.startswith("torchrun")]:
            print(f"{mode}: not measured: no torchrun here (apt install python3-torch)")
            modes.remove(mode)
    storage = tempfile.mkdtemp(prefix="cohort-bench-recovery-")
    # Memory-backed, as snapshots are meant to be kept.
    args.snapshot_dir = tempfile.mkdtemp(prefix="cohort-bench-snapshots-",
                                         dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    rows = []
    try:
        for mode in modes:
            print(f"{mode}: training, killing a worker at step {args.kill_at}...", flush=True)
            rows.append(run_mode(args, mode, storage))
    finally:
        shutil.rmtree(storage, ignore_errors=True)
        shutil.rmtree(args.snapshot_dir, ignore_errors=True)
    print(f"{'mode':<18}{'killed at':>10}{'resumed after':>15}{'steps lost':>12}"
          f"{'kill -> next step s':>21}{'-> past the kill s':>20}{'exit':>6}")
    for r in rows:
        print(f"{r['mode']:<18}{r['step_at_kill']:>10}{r['resumed_after']:>15}{r['steps_lost']:>12}"
              f"{r['kill_to_next_step_s']:>21.2f}{r['kill_to_step_after_killed_s']:>20.2f}"
              f"{r['exit_code']:>6}"
              + ("  (live recovery fell back to a restart)" if r["fell_back_to_restart"] else ""))
    for r in rows:
        print(json.dumps(r))
    return 0 if all(r["exit_code"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
