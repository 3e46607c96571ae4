"""power.physics: what the board is and how it behaves — board specs, the power and thermal equations and
the cost model. Shared by the controller (power.policy) and the twin; imports nothing from power.twin."""
