"""What the gateway and the workers both import: wire protocol, key names, settings,
sampling parameters and model-source loading."""
