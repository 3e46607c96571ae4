"""How fast the twin runs in virtual time: one hour of alternating prefill/decode/idle traffic at a
100 ms step, with a flush every simulated second (what the energy benchmark does).

Usage: python scripts/bench_twin_speed.py [--board agx-orin-64gb] [--l4t r36] [--hours 1]
"""
from __future__ import annotations

import argparse
import tempfile
import time

from power.twin import IDLE, Twin, Workload, create_twin


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--board", default="agx-orin-64gb")
    ap.add_argument("--l4t", default="r36")
    ap.add_argument("--hours", type=float, default=1.0)
    args = ap.parse_args()
    phases = [Workload("prefill", 1.0, 0.2)] + [Workload("decode", 1.0, 0.8)] * 7 + [IDLE] * 2
    with tempfile.TemporaryDirectory() as d:
        create_twin(d, args.board, args.l4t)
        twin = Twin(d)
        steps = int(args.hours * 36000)
        t0 = time.perf_counter()
        for i in range(steps):
            twin.step(0.1, phases[(i // 20) % len(phases)])
            if i % 10 == 0:
                twin.flush()
        wall = time.perf_counter() - t0
    st = twin.state
    print(f"{steps} steps ({st.t_s / 3600:.2f} h virtual) in {wall:.2f} s: {steps / wall:,.0f} steps/s, "
          f"{st.t_s / wall:,.0f}x real time; energy {st.energy_j / 3600:.1f} Wh, max {st.max_temp_c:.1f} C")


if __name__ == "__main__":
    main()
