"""The CPU threads of a g-of-N-GPU share of this machine, counted in physical cores (with their sibling
threads), for pinning a sweep as a node of g GPUs would run it:

    taskset -c $(python3 bench/cpu_share.py 1 2) python3 bench/device_sweep.py ...
    taskset -c $(python3 bench/cpu_share.py 1 2 1) ...    # the second 1-of-2 share (the other GPU's cores)
    python3 bench/cpu_share.py --describe     # cores, threads per core, sockets

Taking the first half of the logical CPU numbers is not a fair share where the numbering interleaves sibling
threads (0 and 1 on one core) or puts them half a machine apart (0 and 16): one half would get whole cores,
the other the siblings of cores already busy.
"""

from __future__ import annotations

import os
import sys


def physical_cores() -> dict[tuple[int, int], list[int]]:
    """The allowed logical CPUs grouped by (socket, core), in order of each core's first CPU."""
    cores: dict[tuple[int, int], list[int]] = {}
    for cpu in sorted(os.sched_getaffinity(0)):
        topo = f"/sys/devices/system/cpu/cpu{cpu}/topology"
        try:
            with open(f"{topo}/physical_package_id") as a, open(f"{topo}/core_id") as b:
                key = (int(a.read()), int(b.read()))
        except (OSError, ValueError):
            key = (0, cpu)  # no topology: every logical CPU its own core
        cores.setdefault(key, []).append(cpu)
    return cores


def main() -> None:
    by_core = physical_cores()
    cores = list(by_core.values())
    if sys.argv[1:] == ["--describe"]:
        print(f"{sum(map(len, cores))} logical CPUs, {len(cores)} physical cores on {len({k[0] for k in by_core})} "
              f"sockets, up to {max(map(len, cores))} threads per core; first sibling sets {cores[:4]}")
        return
    g, n = (int(a) for a in sys.argv[1:3])
    i = int(sys.argv[3]) if len(sys.argv) > 3 else 0  # which of the machine's N // g such shares
    if not 0 < g <= n or not 0 <= i < n // g:
        sys.exit(f"cpu_share: need 0 < g <= N and 0 <= i < N // g, got g={g} N={n} i={i}")
    size = max(1, len(cores) * g // n)
    take = cores[i * size:(i + 1) * size]
    if not take:
        sys.exit(f"cpu_share: {len(cores)} physical cores have no share {i} of {n // g}")
    print(",".join(str(c) for core in take for c in core))


if __name__ == "__main__":
    main()
