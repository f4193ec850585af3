"""Settings: the one place metrale reads the environment.

- `parsing`: how a setting's text becomes its value (sizes, hex, units) and how a refused one is told;
- `hooks`: how metrale calls a plugin's hook: through pluggy, one plugin at a time;
- `plugins`: a plugin's settings model (`PluginSettings`) and the entry-point scan that finds each one;
- `model`: `MetraleSettings` (the core's fields and every plugin's) and `LaunchEnvironment` (the launcher's);
- `sources`: where each setting's value came from (its default, a variable, a ``.env`` file, a keyword).

Each module imports only those above it; ``parsing`` and ``plugins`` know no field of the model, which
passes its field names in.
"""
