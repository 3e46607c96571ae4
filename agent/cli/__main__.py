"""`python -m agent.cli`: the same command as `orin-agent` (the tests start the service this way)."""
from agent.cli import main

main()
