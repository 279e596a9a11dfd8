"""Helpers the test files share (a package: no test file imports another)."""
