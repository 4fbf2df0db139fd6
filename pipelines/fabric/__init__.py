"""The fabric stage: an all-reduce across a ring's members, checked against the profile."""
