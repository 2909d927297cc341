"""serve package of AgentForesight (see README.md)."""
