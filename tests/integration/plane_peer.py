"""One end of a data-plane pair (or a member of a DP group) for tests/integration/test_dataplane.py,
run as a process of its own (gloo groups belong to processes).

    python plane_peer.py URL RUN ME PEER RANK CONNECTIONS ACTION

ACTION is one of
    send      send the test tensors (`tensors()`), in order, then wait for "bye" on stdin
    recv      receive them and print one JSON line: each tensor's dtype, shape and whether it equals
              the expected one; then wait for "bye"
    hold      form the pair, print "formed", wait for "bye" (the connection count is read meanwhile)
    recv_lost post a receive for a tensor that never comes; print how it ended and after how long
    reduce    all-reduce the DP group's mean of (rank + 1) * ones(1000) and print it (PEER is the
              group size)
Every process prints "formed" once its groups exist.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from shared.dataplane import DataPlane, GroupSpec, PairSpec, PlaneError, tag_of


def tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [
        torch.randn(2, 32, 32, generator=g),  # a demo activation
        torch.randn(3, 1001, generator=g).to(torch.bfloat16),  # odd size: uneven chunks
        torch.randint(0, 1 << 40, (5,), generator=g),  # fewer elements than connections
        torch.randn(4 << 20, generator=g),  # 16 MB
    ]


def main(url: str, run: str, me: str, peer: str, rank: int, connections: int, action: str) -> None:
    plane = DataPlane(url, run, ["127.0.0.1"], timeout_s=30)
    if action == "reduce":
        plane.form(1, [], GroupSpec("dp:s0", rank, int(peer)))
        print("formed", flush=True)
        out, latest = plane.all_reduce_mean(torch.full((1000,), float(rank + 1)), float(rank))
        print(json.dumps({"mean": sorted(set(out.tolist())), "latest": latest}), flush=True)
        return
    plane.form(1, [PairSpec(peer, "r0:s0-s1", rank, connections)], None)
    print("formed", flush=True)
    if action == "send":
        for i, t in enumerate(tensors()):
            plane.send(1, peer, t, tag_of("act", 0, i))
    elif action == "recv":
        got = []
        for i, want in enumerate(tensors()):
            t = plane.recv(1, peer, want.dtype, tuple(want.shape), tag_of("act", 0, i))
            got.append({"dtype": str(t.dtype), "shape": list(t.shape), "equal": bool(torch.equal(t, want))})
            plane.release(t)
        print(json.dumps(got), flush=True)
    elif action == "recv_lost":
        t0 = time.monotonic()
        try:
            plane.recv(1, peer, torch.float32, (1000,), tag_of("grad", 0, 0))
            print(json.dumps({"ended": "received", "after_s": time.monotonic() - t0}), flush=True)
        except PlaneError as exc:
            print(json.dumps({"ended": "PlaneError", "error": str(exc), "after_s": time.monotonic() - t0}), flush=True)
        return
    sys.stdin.readline()  # "bye": keep the connections open until the test has looked


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], a[1], a[2], a[3], int(a[4]), int(a[5]), a[6])
