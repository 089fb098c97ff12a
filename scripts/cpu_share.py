"""Where the machine's CPU time goes while a command runs (issue 56: does the API server take the
engine's cores during `../shared/peers/serve_sampling.sh`?): the CPU seconds of each named process
(utime + stime from /proc), the machine's busy and idle seconds, and the rest (the load client,
the system).

    python scripts/cpu_share.py "PID=api,PID=engine" \\
        "cd ../shared/peers && ./serve_sampling.sh 8021 x"
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

TICK = os.sysconf("SC_CLK_TCK")


def process_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def machine_seconds() -> tuple[float, float]:
    """(busy, idle) CPU seconds since boot; busy counts user, nice, system, irq, softirq and
    steal."""
    v = list(map(int, open("/proc/stat").readline().split()[1:]))
    return (sum(v[:3]) + v[5] + v[6] + v[7]) / TICK, v[3] / TICK


def main() -> None:
    names = {int(pid): name for pid, name in (a.split("=") for a in sys.argv[1].split(","))}
    before = {pid: process_seconds(pid) for pid in names}
    busy0, idle0 = machine_seconds()
    start = time.time()
    subprocess.run(sys.argv[2], shell=True, check=False)  # nosec B602: the caller's own command
    wall = time.time() - start
    busy1, idle1 = machine_seconds()
    busy, ours = busy1 - busy0, 0.0
    print(f"wall {wall:.1f} s, machine busy {busy:.1f} CPU-s of {os.cpu_count() * wall:.1f}, "
          f"idle {idle1 - idle0:.1f}")
    for pid, name in names.items():
        spent = process_seconds(pid) - before[pid]
        ours += spent
        print(f"  {name}: {spent:.1f} CPU-s ({spent / busy:.0%} of the busy time)")
    print(f"  everything else (the load client, the system): {busy - ours:.1f} CPU-s "
          f"({(busy - ours) / busy:.0%})")


if __name__ == "__main__":
    main()
