"""power: the board and its control. Layers, lowest first: ``power.hw`` (files and tools), ``power.physics``
(specs, equations, cost model), ``power.policy`` (tables, profiles, DVFS, thermal), the runtime
(``power.control``, ``power.applier``, ``power.controller``), and ``power.twin`` (the simulated board) and
``power.bench`` on top. ``power`` never imports ``agent``."""
