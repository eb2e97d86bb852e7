"""models/: reference model definitions, checkpoint loading, paged attention."""
