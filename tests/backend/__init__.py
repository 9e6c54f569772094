"""The backends: how gpukv chooses one, the kernel cache, and the CUDA stream
a manager's work goes to."""
