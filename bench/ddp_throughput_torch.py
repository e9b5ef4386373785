#!/usr/bin/python3
"""The peer for bench/ddp_throughput: PyTorch DDP (gloo) on the same CNN, data, batch,
optimizer, thread settings and step count. Prints one JSON line like the C++ program.
Uses Debian's python3-torch; run with /usr/bin/python3."""
import argparse
import datetime
import gzip
import json
import os
import socket
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F


class CNN(nn.Module):  # seed 000
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=3, padding=1)
        self.fc1 = nn.Linear(64 * 7 * 7, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = F.max_pool2d(torch.relu(self.conv2(x)), 2)
        x = x.view(-1, 64 * 7 * 7)
        return self.fc2(torch.relu(self.fc1(x)))


def read_idx(path):
    with (gzip.open(path) if path.endswith(".gz") else open(path, "rb")) as f:
        data = f.read()
    dims = data[3]
    shape = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def peak_rss_mb():
    """This process's peak resident memory since its program started (VmHWM), as cohort's bench
    measures its workers: getrusage's ru_maxrss would begin at the parent's at the start."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    return 0.0


def worker(rank, args, port, out):
    torch.set_num_threads(args.threads)
    timeout = datetime.timedelta(seconds=60)
    try:
        # Debian's torch 2.x is built without libuv, which TCPStore otherwise asks for.
        store = dist.TCPStore("127.0.0.1", port, args.workers, rank == 0, timeout=timeout,
                              use_libuv=False)
    except TypeError:  # torch 1.13 has no use_libuv
        store = dist.TCPStore("127.0.0.1", port, args.workers, rank == 0, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=args.workers)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(CNN())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    images = read_idx(os.path.join(args.data_dir, "train-images-idx3-ubyte.gz"))
    labels = read_idx(os.path.join(args.data_dir, "train-labels-idx1-ubyte.gz"))
    inputs = torch.from_numpy(images.copy()).unsqueeze(1)
    targets = torch.from_numpy(labels.astype(np.int64))
    dataset = torch.utils.data.TensorDataset(inputs, targets)
    sampler = torch.utils.data.distributed.DistributedSampler(dataset, drop_last=True)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler,
                                         drop_last=True)
    done, samples, start = 0, 0, 0.0
    epoch = 0
    while done < args.warmup + args.steps:
        sampler.set_epoch(epoch)
        epoch += 1
        for x, y in loader:
            if done == args.warmup:
                dist.barrier()
                start = time.perf_counter()
            x = (x.float() / 255.0 - 0.2860) / 0.3530
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            if done >= args.warmup:
                samples += y.size(0)
            done += 1
            if done == args.warmup + args.steps:
                break
    seconds = time.perf_counter() - start
    rss = peak_rss_mb()
    mine = torch.tensor([samples / seconds, seconds, rss], dtype=torch.float64)
    gathered = [torch.zeros_like(mine) for _ in range(args.workers)]
    dist.all_gather(gathered, mine)
    if rank == 0:
        slowest = max(g[1].item() for g in gathered)
        out.put({"mode": "torch_ddp", "workers": args.workers,
                 "samples_per_s": samples * args.workers / slowest,
                 "peak_rss_mb": max(g[2].item() for g in gathered), "steps": args.steps})
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.spawn(worker, args=(args, port, out), nprocs=args.workers, join=True)
    print(json.dumps(out.get()))


if __name__ == "__main__":
    main()
