"""Model weights: locks, fetching into a content-addressed blob store, staging, config patches."""
