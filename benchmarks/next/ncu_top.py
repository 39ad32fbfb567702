"""Top SASS instructions by warp-stall samples from an Nsight Compute source-page CSV
(``ncu --import R --page source --csv --print-source sass``), one table a kernel.

Usage: python3 benchmarks/next/ncu_top.py CSV [N]
"""

from __future__ import annotations

import csv
import sys


def main(path: str, n: int) -> None:
    rows = list(csv.reader(open(path, newline="")))
    header_at = [i for i, r in enumerate(rows) if r and ("Source" in r or "# Address" in r or "Address" in r)]
    if not header_at:
        print("no header found; first lines:", rows[:5])
        return
    for k, start in enumerate(header_at):
        end = header_at[k + 1] - 1 if k + 1 < len(header_at) else len(rows)
        head = rows[start]
        body = [r for r in rows[start + 1:end] if len(r) == len(head)]
        col = next((i for i, h in enumerate(head) if h.startswith("Warp Stall Sampling (All")), None)
        src = next((i for i, h in enumerate(head) if h == "Source"), None)
        if col is None or src is None:
            print("columns:", head)
            continue
        total = sum(float(r[col] or 0) for r in body)
        title = rows[start - 1] if start > 0 else []
        print(f"== {' '.join(title)[:160]}  instructions {len(body)}, samples {total:.0f}")
        extra = [i for i, h in enumerate(head) if h.startswith("Warp Stall Sampling (Not")]
        for r in sorted(body, key=lambda r: -float(r[col] or 0))[:n]:
            share = float(r[col] or 0) / max(total, 1)
            print(f"{share:6.1%} {r[col]:>7} {r[extra[0]] if extra else '':>7}  {r[src][:110]}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 40)
