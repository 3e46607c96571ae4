"""power.runtime: the board under control in a running process — the session that opens it (profile ->
board -> journaled writer -> mode and budget -> tables -> planner -> loop: session.py), the applier that
writes decisions (applier.py), the loop that makes them (loop.py), the service's thread around it
(controller.py), the power cap (cap.py), the rails' meter (meter.py), the state file (state.py) and the
status snapshot (status.py)."""
