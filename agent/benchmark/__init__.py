"""agent.benchmark: `orin-agent bench run`, the end-to-end benchmark of the running configuration
(run: the trace through the engine, controller and board; report + plots: what it writes; session:
one run from root to report)."""
from agent.benchmark.run import TRACES, BenchOptions, ProfileRun
from agent.benchmark.session import run_end_to_end

__all__ = ["TRACES", "BenchOptions", "ProfileRun", "run_end_to_end"]
