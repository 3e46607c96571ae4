"""power: the board — discovery and journaled access (sysfs, nvpmodel, jetson_clocks, jtop), the twin,
the cost model, power profiles and the DVFS / thermal controllers."""
