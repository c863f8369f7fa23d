"""The rivals' fused LM heads, installed from the package registry and measured as bench subjects:
verl's Triton linear cross-entropy (the kernel slime's `--log-probs-backend triton` vendors) and
Liger-Kernel's fused linear losses. `verl_import` loads verl's kernel without verl's trainer stack;
`lm_heads` runs each rival on the LM-head workload."""
