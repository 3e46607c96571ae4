"""`python -m agent`: the `orin-agent` command, SIGTERM handled from its first line (agent.boot)."""
from agent.boot import main

main()
