"""power.twin: the simulated Orin — a board's sysfs tree laid out in a folder (``create_twin``,
power.twin.layout), a model of the board that runs on it (``Twin``, power.twin.model) in real or
virtual time, its real-time driver next to an engine (power.twin.driver) and the twin's nvpmodel /
jetson_clocks (power.twin.runner)."""
from power.physics.boards import BOARDS, L4T_RELEASES
from power.physics.equations import IDLE, PHASES, Workload
from power.twin.layout import WORKLOAD_FILE, TwinPaths, create_twin, read_meta, twin_paths
from power.twin.model import Twin, TwinLimits, TwinState

__all__ = ["BOARDS", "IDLE", "L4T_RELEASES", "PHASES", "WORKLOAD_FILE", "Twin", "TwinLimits",
           "TwinPaths", "TwinState", "Workload", "create_twin", "read_meta", "twin_paths"]
