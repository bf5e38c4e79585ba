"""The Ripple front end: pipeline workers publish deltas into entity kinds."""
