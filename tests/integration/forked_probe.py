"""Run by test_forked: says what a forked service sees of its process, then exits with argv[1]
(or, given "hang", waits until it is stopped)."""

import os
import sys
import time

if __name__ == "__main__":
    session = os.getsid(0) == os.getpid()
    with open("/proc/self/cmdline", "rb") as f:
        print("cmdline=" + f.read().replace(b"\0", b" ").decode().strip())
    print(f"session={session} nice={os.nice(0)} probe={os.environ.get('PROBE')} argv={sys.argv[1:]}")
    sys.stdout.flush()
    if sys.argv[1] == "hang":
        time.sleep(600)
    sys.exit(int(sys.argv[1]))
