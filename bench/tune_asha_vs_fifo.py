#!/usr/bin/python3
"""Issue 8's figure: ASHA against FIFO over the same sampled trials on the cnn and Fashion-MNIST.

Runs `cohort tune` twice with the same --search-seed (so both see the same configurations):
once with the FIFO scheduler (every trial runs every epoch), once with ASHA. Prints, per
scheduler, the trials, how many were stopped early, the training steps they took in all, the
best test accuracy and its config, and the wall time; then ASHA's accuracy gap to FIFO's best and
its share of FIFO's steps, against the targets (within 1 point, at most half the steps).

  bench/tune_asha_vs_fifo.py [--cohort build/cohort] [--samples 24] [--epochs 6]
                             [--reduction-factor 3] [--train-examples 6000] [--max-concurrent 2]
                             [--seed 1] [--keep DIR]

With --keep DIR the experiments stay in DIR, and a later run with the same settings reuses them
(e.g. FIFO's, while trying another ASHA reduction factor).

Training steps count what each trial reported (its last "steps"); a stopped trial's partial
epoch after its last report is not counted.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time


def run(args, scheduler, storage):
    # Named by every setting that shapes it, so that --keep reuses a finished experiment of the
    # same settings (cohort tune continues an experiment of the same name: here, nothing to do).
    name = f"{scheduler}-s{args.samples}-e{args.epochs}-n{args.train_examples}-c{args.max_concurrent}-seed{args.seed}"
    if scheduler == "asha":
        name += f"-rf{args.reduction_factor:g}"
    command = [
        args.cohort, "tune", "--model", "cnn", "--dataset", "fashion-mnist",
        "--workers", "1", "--threads", "1", "--epochs", str(args.epochs),
        "--train-examples", str(args.train_examples),
        "--param", "lr=loguniform:1e-3:2e-1", "--param", "batch_size=choice:32,64,128",
        "--param", "momentum=uniform:0.5:0.95",
        "--samples", str(args.samples), "--search-seed", str(args.seed),
        "--scheduler", scheduler, "--grace-period", "1", "--reduction-factor", str(args.reduction_factor),
        "--max-concurrent", str(args.max_concurrent), "--cpus", str(args.max_concurrent),
        "--storage-path", storage, "--name", name, "--quiet",
    ]
    wall_file = os.path.join(storage, name + ".wall_s")
    reused = os.path.exists(wall_file)
    start = time.monotonic()
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        sys.exit(f"{scheduler}: cohort tune failed ({done.returncode}):\n{done.stdout}")
    if not reused:
        with open(wall_file, "w") as out:
            out.write(str(time.monotonic() - start))
    wall = float(open(wall_file).read())
    state = json.load(open(os.path.join(storage, name, "experiment_state.json")))
    steps, epochs, stopped, best = 0, 0, 0, None
    for trial in state["trials"]:
        result = trial["last_result"]
        steps += result.get("steps", 0)
        epochs += trial["iterations"]
        stopped += trial["stopped_early"]
        if "test_accuracy" in result and (best is None or result["test_accuracy"] > best[0]):
            best = (result["test_accuracy"], trial["name"], trial["config"])
    return {"trials": len(state["trials"]), "stopped": stopped, "steps": steps, "epochs": epochs, "best": best,
            "wall": wall, "reused": reused}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cohort", default=os.path.join(os.path.dirname(__file__), "..", "build", "cohort"))
    parser.add_argument("--samples", type=int, default=24)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--reduction-factor", type=float, default=3)
    parser.add_argument("--train-examples", type=int, default=6000)
    parser.add_argument("--max-concurrent", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--keep", help="keep the experiments in this folder")
    args = parser.parse_args()
    storage = args.keep or tempfile.mkdtemp(prefix="cohort_tune_bench_")
    print(f"cnn on Fashion-MNIST ({args.train_examples} training examples, {args.epochs} epochs per trial), "
          f"{args.samples} samples of lr, batch_size, momentum (search seed {args.seed}), "
          f"ASHA grace 1, reduction factor {args.reduction_factor:g}, max_t {args.epochs}; "
          f"{args.max_concurrent} trials at once, 1 worker x 1 thread each", flush=True)
    results = {}
    for scheduler in ("fifo", "asha"):
        results[scheduler] = r = run(args, scheduler, storage)
        acc, name, config = r["best"]
        print(f"{scheduler:5s} trials {r['trials']} | stopped early {r['stopped']} | training steps {r['steps']} | "
              f"epochs {r['epochs']} | best test_accuracy {acc:.4f} ({name} {json.dumps(config)}) | "
              f"wall {r['wall']:.0f} s{' (kept from an earlier run)' if r['reused'] else ''}", flush=True)
    fifo, asha = results["fifo"], results["asha"]
    gap = (fifo["best"][0] - asha["best"][0]) * 100
    share = asha["steps"] / fifo["steps"]
    print(f"asha/fifo: accuracy gap {gap:+.2f} points (target <= 1), steps {share:.2f} of fifo's (target <= 0.5), "
          f"epochs {asha['epochs'] / fifo['epochs']:.2f}, wall {asha['wall'] / fifo['wall']:.2f}")
    print("targets", "met" if gap <= 1 and share <= 0.5 else "NOT met")
    if not args.keep:
        shutil.rmtree(storage, ignore_errors=True)


if __name__ == "__main__":
    main()
