"""Data path: driver-side feed preparation and worker-side spooling and batching."""
