"""The checks of a run's settings, a module per group; `config.validation.validate` runs them in order.

Each check reads settings only and raises a ConfigError whose one line names the flag and the fix. The
files a run will read are checked with them before launch (`training.preflight`)."""
