#!/usr/bin/env python3
"""What a process that does not hold a job's secret tries against the job's listening sockets
(issue 39's attack table), and a member's view of the store to find them.

  attacker.py coordinator HOST:PORT JOB_ID    as a member of the job (COHORT_JOB_SECRET): prints
                                              the coordinator's address from the store
  attacker.py attack NAME HOST:PORT FROM      runs every attack on HOST:PORT at once and prints
                                              one Markdown row per attack; exit 1 when a
                                              connection was not closed in time

Each attack connects without the secret; the server must close the connection (within its 10 s
handshake deadline, here 15 s) without answering anything but its challenge; the silent one at
that deadline, which the job must therefore outlast."""
import hashlib
import hmac
import os
import socket
import struct
import sys
import threading
import time

MAGIC = b"cohort1\n"
CLOSE_WITHIN = 15.0


def split(address):
    host, port = address.rsplit(":", 1)
    return host, int(port)


def read_exactly(sock, n, deadline):
    data = b""
    while len(data) < n:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


def member(address):
    """A connection that proves COHORT_JOB_SECRET, as a rank's does."""
    secret = os.environ["COHORT_JOB_SECRET"].encode()
    sock = socket.create_connection(split(address), timeout=10)
    deadline = time.monotonic() + 10
    challenge = read_exactly(sock, 40, deadline)
    assert challenge.startswith(MAGIC), challenge
    server_nonce, client_nonce = challenge[8:], os.urandom(16).hex().encode()
    mac = hmac.new(secret, b"client" + server_nonce + client_nonce, hashlib.sha256).digest()
    sock.sendall(client_nonce + mac)
    reply = read_exactly(sock, 32, deadline)
    expected = hmac.new(secret, b"server" + server_nonce + client_nonce, hashlib.sha256).digest()
    assert hmac.compare_digest(reply, expected), "the store did not prove the secret"
    return sock


def store_call(sock, request_id, op, fields):
    body = struct.pack("<QBI", request_id, op, len(fields))
    for f in fields:
        body += struct.pack("<I", len(f)) + f
    sock.sendall(struct.pack("<I", len(body)) + body)
    deadline = time.monotonic() + 60
    (length,) = struct.unpack("<I", read_exactly(sock, 4, deadline))
    reply = read_exactly(sock, length, deadline)
    _, status, count = struct.unpack("<QBI", reply[:13])
    at, values = 13, []
    for _ in range(count):
        (n,) = struct.unpack("<I", reply[at:at + 4])
        values.append(reply[at + 4:at + 4 + n])
        at += 4 + n
    return status, values


def coordinator_address(store, job_id):
    import json
    sock = member(store)
    assert store_call(sock, 1, 1, [job_id.encode()])[0] == 0, "the store refused the job id"
    assert store_call(sock, 2, 6, [b"job/0/run"])[0] == 0  # wait until rank 0 opened the run
    status, values = store_call(sock, 3, 3, [b"job/0/run"])
    assert status == 0, values
    return json.loads(values[0])["coordinator"]


def attempt(address, payload, results, name):
    """Connects, reads the challenge, sends `payload` (None: nothing) and times the close."""
    start = time.monotonic()
    try:
        sock = socket.create_connection(split(address), timeout=10)
        deadline = start + CLOSE_WITHIN
        challenge = read_exactly(sock, 40, deadline)
        if not challenge.startswith(MAGIC):
            results[name] = "NOT CHALLENGED: first bytes %r" % challenge[:8]
            return
        if payload is not None:
            sock.sendall(payload)
        extra = b""
        while time.monotonic() < deadline:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                chunk = sock.recv(4096)
            except socket.timeout:
                continue  # still open: the loop ends at the deadline
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                answer = "nothing" if not extra else "%d bytes" % len(extra)
                results[name] = "closed after %.1f s; answered %s" % (time.monotonic() - start, answer)
                return
            extra += chunk
        results[name] = "OPEN after %.0f s" % CLOSE_WITHIN
    except (OSError, ConnectionError) as e:
        results[name] = "closed after %.1f s (%s)" % (time.monotonic() - start, e.__class__.__name__)


def attack(target, address, origin):
    hello = b'{"type":"hello","rank":1,"token":"guessed"}\n'
    attacks = {
        "a message without a proof": hello + b" " * 64,
        "a wrong proof": os.urandom(64),
        "an oversized frame (2 GiB length)": struct.pack("<I", 0x7FFFFFFF) + os.urandom(60),
        "a malformed line (rank as a string)": b'{"rank":"1","token":42}\n' + b"x" * 64,
        "a connection that says nothing": None,
    }
    results, threads = {}, []
    for name, payload in attacks.items():
        t = threading.Thread(target=attempt, args=(address, payload, results, name))
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    ok = True
    for name in attacks:
        print("| %s (%s) | %s | %s | %s |" % (target, address, origin, name, results[name]))
        ok = ok and results[name].startswith("closed") and results[name].endswith("nothing")
    # The silent one is closed by the server's handshake deadline (10 s), not by the job ending.
    silent = float(results["a connection that says nothing"].split()[2])
    return ok and 9.0 <= silent <= CLOSE_WITHIN


if __name__ == "__main__":
    if sys.argv[1] == "coordinator":
        print(coordinator_address(sys.argv[2], sys.argv[3]))
    elif sys.argv[1] == "attack":
        sys.exit(0 if attack(sys.argv[2], sys.argv[3], sys.argv[4]) else 1)
    else:
        sys.exit("usage: attacker.py coordinator HOST:PORT JOB_ID | attack NAME HOST:PORT FROM")
