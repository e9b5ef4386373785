#!/usr/bin/python3
"""Alternates the contenders of issue 3 on this machine and prints medians and ratios:
  cohort       build/bench/ddp_throughput --mode ddp
  torch_ddp    bench/ddp_throughput_torch.py (PyTorch DDP, gloo)
  limit        build/bench/ddp_throughput --mode independent (no communication at all)
  before       BUILD/bench/ddp_throughput --mode ddp, with --before BUILD: another build of cohort
               (e.g. the commit before a change), in the same rounds
Usage: bench/ddp_throughput.py [--rounds 5] [--steps 200] [--before BUILD]
                               [-- extra flags for the C++ program]"""
import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(cmd):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--before", help="another build folder whose DDP runs in the same rounds")
    parser.add_argument("extra", nargs="*", help="extra flags for the C++ program")
    args = parser.parse_args()
    common = ["--steps", str(args.steps), "--workers", "2", "--threads", "1", "--batch-size", "64"]
    program = os.path.join(args.build, "bench", "ddp_throughput")
    contenders = {
        "cohort": [program, "--mode", "ddp"] + common + args.extra,
        "torch_ddp": ["/usr/bin/python3", os.path.join(ROOT, "bench", "ddp_throughput_torch.py")] + common,
        "limit": [program, "--mode", "independent"] + common,
    }
    if args.before:
        contenders["before"] = [os.path.join(args.before, "bench", "ddp_throughput"), "--mode",
                                "ddp"] + common + args.extra
    results = {name: [] for name in contenders}
    for r in range(args.rounds):
        for name, cmd in contenders.items():
            result = run(cmd)
            results[name].append(result)
            print(f"round {r + 1} {name:10s} samples_per_s {result['samples_per_s']:8.1f}"
                  f"  peak_rss_mb {result['peak_rss_mb']:6.1f}"
                  + (f"  comm_wait_fraction {result['comm_wait_fraction']:.3f}"
                     if name in ("cohort", "before") else ""), flush=True)
    med = {n: statistics.median(x["samples_per_s"] for x in v) for n, v in results.items()}
    print()
    for name, v in results.items():
        rates = [x["samples_per_s"] for x in v]
        print(f"{name:10s} median {med[name]:8.1f} samples/s  min {min(rates):8.1f}  max {max(rates):8.1f}")
    wait = statistics.median(x["comm_wait_fraction"] for x in results["cohort"])
    print(f"cohort comm_wait_fraction median {wait:.3f}")
    rss_cohort = statistics.median(x["peak_rss_mb"] for x in results["cohort"])
    rss_single = statistics.median(x["peak_rss_mb"] for x in results["limit"])
    print(f"peak_rss_mb cohort worker {rss_cohort:.1f}, single process {rss_single:.1f}, "
          f"ratio {rss_cohort / rss_single:.2f}")
    print(f"ratio cohort/torch_ddp {med['cohort'] / med['torch_ddp']:.3f}")
    print(f"ratio cohort/limit     {med['cohort'] / med['limit']:.3f}")
    print(f"ratio torch_ddp/limit  {med['torch_ddp'] / med['limit']:.3f}")
    if args.before:
        print(f"ratio cohort/before    {med['cohort'] / med['before']:.3f}")


if __name__ == "__main__":
    sys.exit(main())
