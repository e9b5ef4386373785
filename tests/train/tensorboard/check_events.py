#!/usr/bin/python3
"""Reads the TensorBoard event files cohort wrote, independently of cohort's code: TFRecord frames
checked with a CRC-32C of its own, Event messages decoded by Debian's protobuf from the .proto
files beside this script. Then checks them against the run's own records.

  check_events.py run RUN_DIR [--histograms]   a `cohort train` run: every numeric metric of
                                               metrics.jsonl is a scalar at its iteration
  check_events.py tune EXPERIMENT_DIR          a `cohort tune` experiment: the hparams plugin's
                                               experiment, and each trial's session and scalars
Exits 1 naming the first thing that is wrong.
"""
import importlib
import json
import math
import os
import struct
import subprocess
import sys
import tempfile


def fail(message):
    print("check_events: " + message, file=sys.stderr)
    sys.exit(1)


def crc32c_table():
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


TABLE = crc32c_table()


def masked_crc32c(data):
    crc = 0xFFFFFFFF
    for b in data:
        crc = TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    crc ^= 0xFFFFFFFF
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def load_messages(workdir):
    here = os.path.dirname(os.path.abspath(__file__))
    subprocess.run(["protoc", "--proto_path=" + here, "--python_out=" + workdir,
                    "event.proto", "hparams.proto"], check=True)
    sys.path.insert(0, workdir)
    return importlib.import_module("event_pb2"), importlib.import_module("hparams_pb2")


def read_records(path):
    with open(path, "rb") as f:
        data = f.read()
    pos = 0
    while pos < len(data):
        if len(data) - pos < 12:
            fail(f"{path}: cut inside the length of the record at byte {pos}")
        header = data[pos:pos + 8]
        (length,) = struct.unpack("<Q", header)
        (length_crc,) = struct.unpack("<I", data[pos + 8:pos + 12])
        if masked_crc32c(header) != length_crc:
            fail(f"{path}: the length CRC of the record at byte {pos} is wrong")
        body = data[pos + 12:pos + 12 + length]
        if len(body) != length or len(data) < pos + 16 + length:
            fail(f"{path}: the record at byte {pos} is cut short")
        (body_crc,) = struct.unpack("<I", data[pos + 12 + length:pos + 16 + length])
        if masked_crc32c(body) != body_crc:
            fail(f"{path}: the data CRC of the record at byte {pos} is wrong")
        yield body
        pos += 16 + length


class Folder:
    """Every event of one TensorBoard run folder."""

    def __init__(self, event_pb2, folder):
        self.folder = folder
        self.records = 0
        self.scalars = {}      # tag -> {step: value}
        self.histograms = {}   # tag -> [(step, HistogramProto)]
        self.texts = {}        # tag -> text
        self.hparams = []      # (tag, plugin content bytes)
        if not os.path.isdir(folder):
            fail(f"no folder {folder}")
        files = sorted(f for f in os.listdir(folder) if f.startswith("events.out.tfevents."))
        if not files:
            fail(f"no event file in {folder}")
        for name in files:
            path = os.path.join(folder, name)
            for i, body in enumerate(read_records(path)):
                self.records += 1
                event = event_pb2.Event()
                event.ParseFromString(body)
                if i == 0:
                    if event.file_version != "brain.Event:2":
                        fail(f"{path}: the first event is not the file version: {event}")
                    continue
                if event.wall_time < 1.6e9:
                    fail(f"{path}: event {i} has wall time {event.wall_time}")
                for value in event.summary.value:
                    self.add(path, event.step, value)

    def add(self, path, step, value):
        kind = value.WhichOneof("value")
        plugin = value.metadata.plugin_data.plugin_name
        if kind == "simple_value":
            self.scalars.setdefault(value.tag, {})[step] = value.simple_value
        elif kind == "histo":
            self.histograms.setdefault(value.tag, []).append((step, value.histo))
        elif plugin == "text":
            self.texts[value.tag] = b"".join(value.tensor.string_val).decode()
        elif plugin == "hparams":
            self.hparams.append((value.tag, value.metadata.plugin_data.content))
        else:
            fail(f"{path}: a value of an unexpected kind: {value}")


def check_histogram(tag, h):
    if not (h.min <= h.max):
        fail(f"histogram {tag}: min {h.min} > max {h.max}")
    if len(h.bucket) != len(h.bucket_limit) or not h.bucket:
        fail(f"histogram {tag}: {len(h.bucket)} buckets and {len(h.bucket_limit)} limits")
    if any(b > a for a, b in zip(h.bucket_limit[1:], h.bucket_limit)):
        fail(f"histogram {tag}: bucket limits not increasing")
    if abs(sum(h.bucket) - h.num) > 1e-6 or h.num < 1:
        fail(f"histogram {tag}: buckets count {sum(h.bucket)}, num is {h.num}")
    if abs(h.bucket_limit[-1] - h.max) > 1e-9 * max(1.0, abs(h.max)):
        fail(f"histogram {tag}: the last limit {h.bucket_limit[-1]} is not max {h.max}")


def flat_metrics(record, prefix=""):
    for key, value in record.items():
        if not prefix and key in ("training_iteration", "timestamp", "checkpoint"):
            continue
        tag = prefix + key
        if isinstance(value, dict):
            yield from flat_metrics(value, tag + "/")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            yield tag, float(value)


def check_scalars(folder, run_dir, file, step_key, prefix=""):
    """Every metric of every line of `file` (metrics.jsonl: a report at its training_iteration;
    steps.jsonl: train::log_step's at its step, as "step/<metric>") is that scalar in `folder`."""
    with open(os.path.join(run_dir, file)) as f:
        records = [json.loads(line) for line in f if line.strip()]
    if not records:
        fail(f"{run_dir}/{file} has no record")
    checked = 0
    for record in records:
        step = record[step_key]
        values = {k: v for k, v in record.items() if k not in (step_key, "timestamp")}
        for tag, value in flat_metrics(values, prefix):
            got = folder.scalars.get(tag, {}).get(step)
            if got is None:
                fail(f"{folder.folder}: no scalar {tag} at step {step} ({file} has {value})")
            want = struct.unpack("<f", struct.pack("<f", value))[0]
            if not (got == want or (math.isnan(got) and math.isnan(want))):
                fail(f"{folder.folder}: scalar {tag} at step {step} is {got}, {file} {value}")
            checked += 1
    return records, checked


def check_run(event_pb2, run_dir, histograms):
    folder = Folder(event_pb2, os.path.join(run_dir, "tensorboard"))
    records, checked = check_scalars(folder, run_dir, "metrics.jsonl", "training_iteration")
    steps, step_scalars = check_scalars(folder, run_dir, "steps.jsonl", "step", "step/")
    config = folder.texts.get("config")
    if config is None or '"model"' not in config:
        fail(f"{folder.folder}: no config text with the model in it: {config!r}")
    summary = (f"{folder.records} records, {checked} scalars match metrics.jsonl, "
               f"{len(steps)} logged steps, their {step_scalars} scalars match steps.jsonl")
    if histograms:
        params = [t for t in folder.histograms if t.startswith("parameters/")]
        grads = [t for t in folder.histograms if t.startswith("gradients/")]
        if not params or len(grads) != len(params):
            fail(f"{folder.folder}: {len(params)} parameter and {len(grads)} gradient histograms")
        for tag, entries in folder.histograms.items():
            if sorted(s for s, _ in entries) != [r["training_iteration"] for r in records]:
                fail(f"{folder.folder}: histogram {tag} at steps {[s for s, _ in entries]}")
            for _, h in entries:
                check_histogram(tag, h)
        summary += f", {len(params)} parameter and {len(grads)} gradient histograms per report"
    elif folder.histograms:
        fail(f"{folder.folder}: histograms written without being asked for")
    print(f"check_events: {run_dir}: {summary}")


def check_tune(event_pb2, hparams_pb2, experiment_dir):
    top = Folder(event_pb2, os.path.join(experiment_dir, "tensorboard"))
    experiments = [c for t, c in top.hparams if t == "_hparams_/experiment"]
    if len(experiments) != 1:
        fail(f"{top.folder}: {len(experiments)} hparams experiments")
    data = hparams_pb2.HParamsPluginData()
    data.ParseFromString(experiments[0])
    infos = {h.name: h for h in data.experiment.hparam_infos}
    metrics = [m.name.tag for m in data.experiment.metric_infos]
    if "lr" not in infos or infos["lr"].WhichOneof("domain") is None:
        fail(f"{top.folder}: the experiment has no lr domain: {data.experiment}")
    trials = sorted(d for d in os.listdir(experiment_dir) if d.startswith("trial_"))
    if len(trials) < 2:
        fail(f"{experiment_dir}: {len(trials)} trials")
    for trial in trials:
        run_dir = os.path.join(experiment_dir, trial)
        folder = Folder(event_pb2, os.path.join(run_dir, "tensorboard"))
        check_scalars(folder, run_dir, "metrics.jsonl", "training_iteration")
        starts = [c for t, c in folder.hparams if t == "_hparams_/session_start_info"]
        ends = [c for t, c in folder.hparams if t == "_hparams_/session_end_info"]
        if len(starts) != 1 or len(ends) != 1:
            fail(f"{folder.folder}: {len(starts)} session starts and {len(ends)} ends")
        start = hparams_pb2.HParamsPluginData()
        start.ParseFromString(starts[0])
        with open(os.path.join(run_dir, "params.json")) as f:
            params = json.load(f)
        lr = start.session_start_info.hparams["lr"].number_value
        if lr != params["lr"]:
            fail(f"{folder.folder}: session lr {lr}, params.json {params['lr']}")
        end = hparams_pb2.HParamsPluginData()
        end.ParseFromString(ends[0])
        if end.session_end_info.status != 1:
            fail(f"{folder.folder}: session status {end.session_end_info.status}, not success")
        for metric in metrics:
            if metric not in folder.scalars:
                fail(f"{folder.folder}: the experiment's metric {metric} is no scalar here")
    print(f"check_events: {experiment_dir}: an experiment of {len(infos)} hparams and metrics "
          f"{metrics}; {len(trials)} trial sessions with their lr and scalars")


def main():
    if len(sys.argv) < 3 or sys.argv[1] not in ("run", "tune"):
        fail("usage: check_events.py run RUN_DIR [--histograms] | tune EXPERIMENT_DIR")
    with tempfile.TemporaryDirectory() as workdir:
        event_pb2, hparams_pb2 = load_messages(workdir)
        if sys.argv[1] == "run":
            check_run(event_pb2, sys.argv[2], "--histograms" in sys.argv[3:])
        else:
            check_tune(event_pb2, hparams_pb2, sys.argv[2])


if __name__ == "__main__":
    main()
