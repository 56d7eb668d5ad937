"""Engine backends a worker can drive. Each satisfies ``EngineBackend``."""
