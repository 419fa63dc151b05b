"""quill serve under hostile load (issue 14): bursts of concurrent streaming clients, slowloris
connections, a long run of requests in a row, and SIGTERM with streams in flight.

Usage (inside quill's venv; traffic goes to 127.0.0.1 only, bounded in count and time):
    python -m benchmarks.serve_hostile_load [--bursts 100,300] [--slowloris 200]
        [--in-a-row 1000] [--parallel 4] [--max-queue 16] > result.md

Starts `quill serve` on a free port and measures, printing a Markdown report:

- burst N: N threads each open a connection at once and send one streaming request (16 tokens).
  Every client must get an HTTP answer: 200 with a stream that ends in [DONE], or 429 (queue
  full). A connection reset, a refused connection or a timeout is counted as a failure.
- slowloris: N connections send a request's headers one line every half second and never
  finish; meanwhile normal requests are sent one after another and must all be answered (200).
  Each slow connection should end with a 408 once the header timeout passes.
- in a row: N small requests one after another (streaming and not, alternately); the server's
  RSS after the first 10% and at the end must agree within 10%.
- /health is polled every 0.25 s during all of the above: every answer must be 200 "ok" with
  slots_processing within 0..parallel.
- SIGTERM: `parallel` long streams in flight, then SIGTERM; the server must exit 0 within the
  drain timeout (plus a second or two), and every stream end with [DONE] or an error event.
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import statistics
import subprocess
import threading
import time

import httpx2 as httpx

from benchmarks.harness import QUILL, in_threads, rss_mib, start_server, stop_server

PROMPT = "Write a short story about a lighthouse."


def start(args: argparse.Namespace, *extra: str) -> tuple[subprocess.Popen, str]:
    command = [QUILL, "serve", args.model, "--parallel", str(args.parallel), "--ctx", "512",
               "--max-queue", str(args.max_queue), *extra]  # fmt: skip
    if args.threads:
        command += ["--threads", str(args.threads)]
    return start_server(command)


class HealthWatch(threading.Thread):
    """Polls /health; counts answers that are not an honest 200 "ok"."""

    def __init__(self, url: str, parallel: int) -> None:
        super().__init__(daemon=True)
        self.url, self.parallel = url, parallel
        self.polls = 0
        self.bad: list[str] = []
        self.busiest = 0
        self.stop = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=10) as client:
            while not self.stop.is_set():
                try:
                    response = client.get(f"{self.url}/health")
                    body = response.json()
                    self.polls += 1
                    busy = body["slots_processing"]
                    self.busiest = max(self.busiest, busy)
                    if response.status_code != 200 or body["status"] != "ok":
                        self.bad.append(f"{response.status_code} {body['status']}")
                    elif not 0 <= busy <= self.parallel:
                        self.bad.append(f"slots_processing {busy}")
                except (httpx.HTTPError, ValueError, KeyError) as error:
                    self.bad.append(repr(error))
                self.stop.wait(0.25)


def stream_once(
    url: str, max_tokens: int, timeout: float = 300, on_data: threading.Event | None = None
) -> str:
    """One streaming request: its last `data:` line ('[DONE]' where the stream ended), the
    status where it was not 200 ('429'), or the name of the client-side failure (a reset, a
    timeout). on_data is set at the first data line."""
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    last = ""
    try:
        with (
            httpx.Client(timeout=timeout) as client,
            client.stream("POST", f"{url}/v1/chat/completions", json=body) as response,
        ):
            if response.status_code != 200:
                response.read()
                return str(response.status_code)
            for line in response.iter_lines():
                if line.startswith("data: "):
                    last = line[6:]
                    if on_data:
                        on_data.set()
            return last
    except httpx.HTTPError as error:
        cause = error.__cause__ or error.__context__
        return type(cause).__name__ if isinstance(cause, OSError) else type(error).__name__


def burst(url: str, clients: int) -> dict:
    outcomes: list[str] = []
    lock = threading.Lock()
    gate = threading.Barrier(clients)

    def client() -> None:
        gate.wait()
        last = stream_once(url, 16)
        outcome = ("200" if last == "[DONE]" else "200 unfinished") if last[:1] in "[{" else last
        with lock:
            outcomes.append(outcome)

    wall = in_threads(client, clients)
    counts = {key: outcomes.count(key) for key in sorted(set(outcomes))}
    return {"clients": clients, "counts": counts, "wall_s": wall}


def slowloris(url: str, connections: int, normal_requests: int) -> dict:
    port = int(url.rsplit(":", 1)[1])
    sockets = []
    for _ in range(connections):
        sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        sockets.append(sock)
    ended: dict[str, int] = {}
    stop = threading.Event()

    def drip() -> None:
        alive = list(sockets)
        while alive and not stop.is_set():
            for sock in list(alive):
                try:
                    sock.sendall(b"X-Slow: 1\r\n")
                except OSError:
                    alive.remove(sock)
            stop.wait(0.5)

    dripper = threading.Thread(target=drip, daemon=True)
    dripper.start()
    latencies, codes = [], []
    with httpx.Client(timeout=120) as client:
        for _ in range(normal_requests):
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                    "temperature": 0}  # fmt: skip
            sent = time.perf_counter()
            codes.append(client.post(f"{url}/v1/chat/completions", json=body).status_code)
            latencies.append(time.perf_counter() - sent)
    for sock in sockets:  # each should have been answered 408 and closed by now, or soon
        sock.settimeout(15)
        try:
            reply = b""
            while chunk := sock.recv(65536):
                reply += chunk
            key = reply.split(b" ", 2)[1].decode() if reply else "closed silently"
        except OSError as error:
            key = type(error).__name__
        ended[key] = ended.get(key, 0) + 1
        sock.close()
    stop.set()
    return {
        "connections": connections,
        "normal_codes": {c: codes.count(c) for c in sorted(set(codes))},
        "normal_p50_ms": statistics.median(latencies) * 1000,
        "normal_max_ms": max(latencies) * 1000,
        "slow_ended": ended,
    }


def in_a_row(url: str, pid: int, requests: int) -> dict:
    codes: dict[int, int] = {}
    rss_early = 0.0
    started = time.perf_counter()
    with httpx.Client(timeout=120) as client:
        for index in range(requests):
            body = {"messages": [{"role": "user", "content": f"Say {index}."}],
                    "max_tokens": 2, "temperature": 0, "stream": index % 2 == 1}  # fmt: skip
            response = client.post(f"{url}/v1/chat/completions", json=body)
            codes[response.status_code] = codes.get(response.status_code, 0) + 1
            if index == requests // 10:
                rss_early = rss_mib(pid)
    rss_end = rss_mib(pid)
    return {
        "requests": requests,
        "codes": codes,
        "wall_s": time.perf_counter() - started,
        "rss_early_mib": rss_early,
        "rss_end_mib": rss_end,
        "rss_change": rss_end / rss_early - 1,
    }


def sigterm(args: argparse.Namespace) -> dict:
    server, url = start(args, "--drain-timeout", str(args.drain_timeout))
    outcomes: list[str] = ["" for _ in range(args.parallel)]
    first = [threading.Event() for _ in range(args.parallel)]

    def client(index: int) -> None:
        last = stream_once(url, 480, timeout=120, on_data=first[index])
        first[index].set()
        if last == "[DONE]":
            outcomes[index] = "[DONE]"
        elif last.startswith("{") and "error" in json.loads(last):
            outcomes[index] = "error event"
        else:
            outcomes[index] = f"cut off ({last[:40]})"

    threads = [threading.Thread(target=client, args=(i,)) for i in range(args.parallel)]
    for thread in threads:
        thread.start()
    for event in first:
        event.wait(120)
    time.sleep(0.5)
    signalled = time.perf_counter()
    server.send_signal(signal.SIGTERM)
    code = server.wait(timeout=args.drain_timeout + 60)
    exit_s = time.perf_counter() - signalled
    for thread in threads:
        thread.join(timeout=30)
    stderr = server.stderr.read()
    return {
        "exit_code": code,
        "exit_s": exit_s,
        "drain_timeout_s": args.drain_timeout,
        "streams": {o: outcomes.count(o) for o in sorted(set(outcomes))},
        "tracebacks": stderr.count("Traceback"),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--bursts", default="100,300")
    parser.add_argument("--slowloris", type=int, default=200)
    parser.add_argument("--normal-requests", type=int, default=20)
    parser.add_argument("--in-a-row", type=int, default=1000)
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--max-queue", type=int, default=16)
    parser.add_argument("--drain-timeout", type=float, default=5.0)
    parser.add_argument("--threads", type=int, default=0, help="quill serve --threads (0: its own)")
    args = parser.parse_args()

    server, url = start(args)
    watch = HealthWatch(url, args.parallel)
    try:
        stream_once(url, 4)  # warm-up
        watch.start()
        bursts = [burst(url, int(n)) for n in args.bursts.split(",") if n]
        loris = slowloris(url, args.slowloris, args.normal_requests) if args.slowloris else None
        row = in_a_row(url, server.pid, args.in_a_row) if args.in_a_row else None
    finally:
        watch.stop.set()
        watch.join(timeout=15)
        stop_server(server)
    stderr = server.stderr.read()
    drained = sigterm(args)

    print(f"# quill serve under hostile load ({time.strftime('%Y-%m-%d')})\n")
    threads = f" --threads {args.threads}" if args.threads else ""
    print(
        f"`quill serve {args.model} --parallel {args.parallel} --ctx 512 --max-queue "
        f"{args.max_queue}{threads}` on 127.0.0.1; clients are this script's threads.\n"
    )
    print("| burst of streaming clients | outcomes | wall s |")
    print("|---|---|---|")
    for result in bursts:
        counts = ", ".join(f"{k}: {v}" for k, v in result["counts"].items())
        print(f"| {result['clients']} | {counts} | {result['wall_s']:.1f} |")
    if loris:
        print(f"\nSlowloris: {loris['connections']} connections dripping headers; "
              f"{sum(loris['normal_codes'].values())} normal requests meanwhile: "
              f"{loris['normal_codes']}, p50 {loris['normal_p50_ms']:.0f} ms, max "
              f"{loris['normal_max_ms']:.0f} ms. Slow connections ended with: "
              f"{loris['slow_ended']}.")  # fmt: skip
    if row:
        print(f"\nIn a row: {row['requests']} requests, {row['codes']}, {row['wall_s']:.0f} s; "
              f"RSS {row['rss_early_mib']:.0f} MiB after 10%, {row['rss_end_mib']:.0f} MiB at "
              f"the end ({row['rss_change']:+.1%}).")  # fmt: skip
    print(
        f"\n/health: {watch.polls} polls during the run, {len(watch.bad)} not an honest 200 ok"
        f"{': ' + str(watch.bad[:5]) if watch.bad else ''}; most slots busy seen: "
        f"{watch.busiest}. Tracebacks on the server's stderr: {stderr.count('Traceback')}."
    )
    print(f"\nSIGTERM with {args.parallel} streams in flight (--drain-timeout "
          f"{drained['drain_timeout_s']:g}): exit code {drained['exit_code']} after "
          f"{drained['exit_s']:.1f} s; streams ended with {drained['streams']}; tracebacks: "
          f"{drained['tracebacks']}.")  # fmt: skip


if __name__ == "__main__":
    main()
