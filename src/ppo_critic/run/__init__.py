"""A training run on disk: durable writes (`files`), the run directory and its one writer (`rundir`), checkpoints
(`checkpoint`), metrics (`runlog`, `loggers`), what the console shows (`console`) and the curves (`plots`)."""
