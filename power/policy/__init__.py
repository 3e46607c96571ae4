"""power.policy: what the controller decides — profiles (TOML, resolved against power.hw.tables),
the DVFS controller and thermal control. Pure decisions: no files, nothing from power.twin."""
