"""slime's rollout side: functions slime calls in its rollout actor, which attach the package's
carried data (`slime_ext.carry`) to each sample. Nothing here imports the kernels or the losses."""
