"""Driver-side planning: model profiles, stage cuts and (later) the cost model that picks a strategy."""
