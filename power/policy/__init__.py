"""power.policy: what the controller decides — clock tables and the one snap helper, profiles (TOML),
the DVFS controller and thermal control. Pure decisions: no files, nothing from power.twin."""
