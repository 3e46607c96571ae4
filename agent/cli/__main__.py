"""`python -m agent.cli`: the same CLI as the `orin-agent` command."""
from agent.cli import main

main()
