"""eval package of AgentForesight (see README.md)."""
