"""power.twin: the simulated Orin — a board's sysfs tree laid out in a folder (``create_twin``) and a
model of the board that runs on it (``Twin``), in real time or in virtual time."""
from power.physics.boards import BOARDS, L4T_RELEASES
from power.twin.layout import WORKLOAD_FILE, TwinPaths, create_twin, read_meta, twin_paths
from power.twin.model import IDLE, PHASES, TwinLimits, Twin, TwinState, Workload

__all__ = ["BOARDS", "IDLE", "L4T_RELEASES", "PHASES", "WORKLOAD_FILE", "TwinLimits", "Twin",
           "TwinPaths", "TwinState", "Workload", "create_twin", "read_meta", "twin_paths"]
