"""`python3 -m agent.cli`: the same command as `orin-agent` (the service tests start it this way)."""
from agent.cli import main

main()
