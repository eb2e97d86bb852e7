"""spec/drafters/: the drafters (prompt lookup, a draft model, DSpark heads) and what
they share: their KV book, the draft draw, row planning and temperature scaling."""
