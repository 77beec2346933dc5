"""Where a programmatic dependent launch lets the next launch start: the trigger points the staged ``*_trig``
families search (gemm_splitk_trig says why), shared by them."""

LATE = (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 1024)  # 1024: at the loop's first stage (right after the wait)


def late_seeds(ktiles: int) -> list[int]:
    """Trigger points worth a seed for a slice of ``ktiles`` stages, as LATE values: its second stage, its middle,
    its first (s55-r2/r3, H100: the best of the 16-token layouts on TP8's 1536 x 7168 and 7168 x 1536 ops)."""
    def at(stage: int) -> int:  # the LATE value that fires at the latest point no later than ``stage``
        return min((x for x in LATE if x >= ktiles - stage), default=LATE[-1])

    return list(dict.fromkeys(at(s) for s in (1, ktiles // 2, 0)))
