"""Settings: the one place metrale reads the environment.

- `parsing`: how a setting's text becomes its value (sizes, hex, units) and how a refused one is told;
- `plugins`: a plugin's settings model (`PluginSettings`) and the entry-point scan that finds each one;
- `model`: `MetraleSettings` (the core's fields and every plugin's) and `LaunchEnvironment` (the launcher's).

Each module imports only those above it; ``parsing`` and ``plugins`` know no field of the model, which
passes its field names in.
"""
