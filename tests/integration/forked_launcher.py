"""Run by test_forked: a launcher that forks the probe (waiting until stopped), reads what the
probe says first (so the probe is in its wait, its writes done), prints the fork's pid, and waits to
be killed."""

import asyncio
import os

from bubbletea.launcher import forked


async def main() -> None:
    proc = await forked.fork("tests.integration.forked_probe", ["hang"], dict(os.environ), nice=0)
    for _ in range(2):  # its cmdline and session lines
        await proc.stdout.readline()
    print(proc.pid, flush=True)
    await asyncio.sleep(600)


if __name__ == "__main__":
    asyncio.run(main())
