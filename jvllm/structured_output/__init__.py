"""Structured outputs: a request's output constrained to a JSON schema, a regex, a choice or a
grammar, through llguidance's token masks (design.md, "Structured outputs")."""
