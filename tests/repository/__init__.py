"""The repository's own rules: the documentation stands alone and its code
runs, the package's import layers, gpukv's errors in one module."""
