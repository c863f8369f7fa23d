"""How a measurement is taken, whatever the op: one pass per subject (`measure`), GPU times
(`timing`), peak extra memory (`memory`), whether the cases fit (`budget`), progress on stderr
(`progress`) and the relative error against a float64 truth (`accuracy`)."""
