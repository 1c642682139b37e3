"""Helpers for the integration tests: a source-tree generator and hubd/spokefs process wrappers."""
