"""The planner: a rank's memory from the real sharding on the meta device (`memory_prediction`, `dry_run`),
a cost model of a training step on given hardware (`hardware`, `cost`), and the search over
parallel layouts that ranks them (`search`, `report`; `paratron plan` is `commands.plan`)."""
