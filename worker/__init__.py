"""The worker: a thin Redis adapter (stream consumer, heartbeats, control channel)
around an engine backend. ``worker.engine`` and ``worker.models`` import no redis."""
