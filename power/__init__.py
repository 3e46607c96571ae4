"""power: the board and its control, in ranks, lowest first, each importing only lower ones:
``power.hw`` (files, tools, clock tables) < ``power.physics`` (specs, equations, cost model) < ``power.policy``
(profiles, DVFS, thermal, budget: pure decisions) < ``power.twin`` (the simulated board) < ``power.runtime``
(the board session, applier, loop, the service's controller thread, meter, state, status) < ``power.bench``
(the energy benchmark in virtual time). ``power`` never imports ``agent``; tests/test_architecture.py checks."""
