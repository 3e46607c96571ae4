"""power.hw: the board's files and tools — sysfs access, parsers, discovery, one class per clock/sensor
domain, nvpmodel and jetson_clocks, the journaled writer, and the backends (sysfs, jtop) behind one
factory (:func:`power.hw.backends.open_board`)."""
