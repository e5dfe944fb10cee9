"""An example strategy plugin for adaptive-fl (see examples/strategy_plugin/README.md)."""
