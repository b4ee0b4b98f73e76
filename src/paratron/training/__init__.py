"""The training loop, one step, metrics, plots and FLOPs accounting.

Nothing is imported here: `paratron.training.flops` (which the planner and the inference engine
read) must not load the whole training stack with it. Import from the modules: `training.run`
(`run_training`), `training.loop` (`Trainer`), `training.resume` (`TrainState`)."""
