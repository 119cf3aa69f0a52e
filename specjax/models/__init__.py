"""Model families behind the one step-function contract (DESIGN.md, contract 1)."""
