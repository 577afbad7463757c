"""Serving exports of trained drafters: engine conventions, guards, and the run-level `draftsmith export`."""
