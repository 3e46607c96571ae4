"""agent.benchmark: the engine side of the benchmarks. `orin-agent bench run`, the end-to-end benchmark
of the running configuration in real time (run: the trace through the engine, controller and board;
report + plots: what it writes; session: one run from root to report); and `orin-agent bench power` /
`bench budget`, power.bench's policies replayed through the service's scheduler in virtual time
(power_replay)."""
from agent.benchmark.run import TRACES, BenchOptions, ProfileRun
from agent.benchmark.session import run_end_to_end

__all__ = ["TRACES", "BenchOptions", "ProfileRun", "run_end_to_end"]
