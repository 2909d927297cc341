"""AgentForesight: trajectory schema and readers, the prompt builder and verdict parser, the fold,
and the corpus builder. See README.md and docs/design.md."""

__version__ = "0.1.0"
