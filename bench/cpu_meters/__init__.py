"""What the CPU can say about GPU cost without a GPU: bytes moved by Triton kernels in the
interpreter and by aten operators (`traffic`), from what each operator reads, writes and allocates
(`aten_ops`)."""
