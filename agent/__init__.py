"""agent: the on-device service — config, HTTP API, engine loop, generation and the `orin-agent` CLI."""
