"""Each feature's slime flags and startup checks, one module per feature; `slime_ext.arguments`
registers and validates them all, in the order their dependencies require."""
