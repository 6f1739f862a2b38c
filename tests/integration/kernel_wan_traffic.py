"""Real TCP traffic for tests/integration/test_kernel_wan.py, run inside a namespace with
`ip netns exec` (a process joins a network namespace at its start, hence a separate script).

    python kernel_wan_traffic.py recv ADDR N WARMUP_S WINDOW_S
        listens on ADDR (a free port, printed as "port P"), takes N connections, and once all N
        deliver data waits WARMUP_S (slow start, htb's burst), then counts the bytes each
        connection receives during WINDOW_S and prints them as one JSON line, then exits.
    python kernel_wan_traffic.py send DST PORT SRC [SRC ...]
        one connection per SRC address (bound to it; "-" lets the kernel pick), each sending as
        fast as it can until the receiver goes away.

Standard library only, so it starts fast.
"""

from __future__ import annotations

import json
import selectors
import socket
import sys
import threading
import time


def recv(addr: str, n: int, warmup_s: float, window_s: float) -> None:
    srv = socket.create_server((addr, 0))
    print(f"port {srv.getsockname()[1]}", flush=True)
    sel = selectors.DefaultSelector()
    sel.register(srv, selectors.EVENT_READ)
    counts: dict[int, int] = {}
    buf = bytearray(1 << 20)
    start: float | None = None  # the window opens once all n connections deliver
    at_start: dict[int, int] | None = None
    while True:
        timeout = None
        if start is not None:
            now = time.monotonic()
            if at_start is None and now >= start:
                at_start = dict(counts)
            if at_start is not None and now >= start + window_s:
                break
            timeout = max(0.0, (start if at_start is None else start + window_s) - now)
        for key, _ in sel.select(timeout):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            if sock is srv:
                conn, _ = srv.accept()
                conn.setblocking(False)
                sel.register(conn, selectors.EVENT_READ)
                counts[conn.fileno()] = 0
                continue
            try:
                got = sock.recv_into(buf)
            except BlockingIOError:
                continue
            if got == 0:
                sel.unregister(sock)
                continue
            counts[sock.fileno()] += got
            if start is None and len(counts) == n and all(counts.values()):
                start = time.monotonic() + warmup_s
    assert at_start is not None
    rates = [(counts[fd] - at_start.get(fd, 0)) / window_s for fd in sorted(counts)]
    print(json.dumps({"rates": rates, "total": sum(rates)}), flush=True)


def send(dst: str, port: int, sources: list[str]) -> None:
    chunk = b"\0" * (256 << 10)

    def one(src: str) -> None:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if src != "-":
            s.bind((src, 0))
        s.connect((dst, port))
        try:
            while True:
                s.sendall(chunk)
        except OSError:
            pass

    threads = [threading.Thread(target=one, args=(src,), daemon=True) for src in sources]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


if __name__ == "__main__":
    match sys.argv[1:]:
        case ["recv", addr, n, warmup, window]:
            recv(addr, int(n), float(warmup), float(window))
        case ["send", dst, port, *sources] if sources:
            send(dst, int(port), sources)
        case _:
            sys.exit(__doc__)
