"""training package of AgentForesight (see README.md)."""
